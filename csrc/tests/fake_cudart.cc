#include "fake_cudart.h"

#include <cstdlib>
#include <cstring>

namespace fake_cudart {
namespace {
Counts the_counts;
bool fail_next_pinned_alloc = false;
int event;  // every event is this one: events only order copies, which are done at once
}  // namespace

Counts& counts() { return the_counts; }
void Reset() { the_counts = {}; }
void FailNextPinnedAlloc() { fail_next_pinned_alloc = true; }

}  // namespace fake_cudart

using fake_cudart::the_counts;

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int) {
  if (fake_cudart::fail_next_pinned_alloc) {
    fake_cudart::fail_next_pinned_alloc = false;
    return cudaErrorMemoryAllocation;
  }
  ++the_counts.pinned_allocs;
  *p = std::malloc(size);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void* p) {
  ++the_counts.pinned_frees;
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  the_counts.to_host += kind == cudaMemcpyDeviceToHost;
  the_counts.to_device += kind == cudaMemcpyHostToDevice;
  std::memcpy(to, from, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* to, int value, size_t bytes, cudaStream_t) {
  std::memset(to, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
  ++the_counts.stream_syncs;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(&fake_cudart::event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }

cudaError_t cudaEventSynchronize(cudaEvent_t) {
  ++the_counts.event_waits;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }

const char* cudaGetErrorString(cudaError_t status) {
  return status == cudaErrorMemoryAllocation ? "out of memory" : "fake error";
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
