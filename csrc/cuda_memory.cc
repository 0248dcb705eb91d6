#include "cuda_memory.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "log.h"

namespace mpijax {
namespace {

std::atomic<bool> cuda_aware{false};

// Pinned host memory for staging, reused by every call: one block in the
// steady state. A call that outgrows it takes a further block, and the next
// call replaces them all by one block of their total size.
class Arena {
 public:
  ~Arena() {
    // At exit the CUDA runtime may be gone already: nothing to report to.
    for (const Block& b : blocks_) cudaFreeHost(b.data);
    if (returned_) cudaEventDestroy(returned_);
  }

  std::mutex& mutex() { return mutex_; }

  // A call starts: the previous call's copies back must have left the memory.
  cudaError_t Begin() {
    used_ = 0;
    if (pending_) {
      pending_ = false;
      if (cudaError_t s = cudaEventSynchronize(returned_)) return s;
    }
    if (blocks_.size() <= 1) return cudaSuccess;
    size_t total = 0;
    for (const Block& b : blocks_) {
      total += b.size;
      if (cudaError_t s = cudaFreeHost(b.data)) return s;
    }
    blocks_.clear();
    return Grow(total);
  }

  // `bytes` of pinned memory, 256-byte aligned.
  cudaError_t Take(size_t bytes, void** out) {
    bytes = (bytes + 255) & ~size_t{255};
    if (blocks_.empty() || blocks_.back().size - used_ < bytes) {
      const size_t last = blocks_.empty() ? 0 : blocks_.back().size;
      if (cudaError_t s = Grow(std::max(bytes, 2 * last))) return s;
    }
    *out = blocks_.back().data + used_;
    used_ += bytes;
    return cudaSuccess;
  }

  // The call holding the blocks timed out, and MPI may still write into
  // them: they are never handed out or freed again.
  void Abandon() {
    blocks_.clear();
    used_ = 0;
  }

  // The copies back of the call now ending are queued on `stream`.
  cudaError_t Returning(cudaStream_t stream) {
    if (!returned_) {
      if (cudaError_t s = cudaEventCreateWithFlags(&returned_, cudaEventDisableTiming)) return s;
    }
    pending_ = true;
    return cudaEventRecord(returned_, stream);
  }

 private:
  struct Block {
    char* data;
    size_t size;
  };

  cudaError_t Grow(size_t bytes) {
    void* data = nullptr;
    if (cudaError_t s = cudaHostAlloc(&data, bytes, cudaHostAllocPortable)) return s;
    blocks_.push_back({static_cast<char*>(data), bytes});
    used_ = 0;
    return cudaSuccess;
  }

  std::mutex mutex_;
  std::vector<Block> blocks_;
  size_t used_ = 0;
  cudaEvent_t returned_ = nullptr;
  bool pending_ = false;
};

Arena& TheArena() {
  static Arena arena;
  return arena;
}

}  // namespace

bool CudaAware() { return cuda_aware.load(std::memory_order_relaxed); }
void SetCudaAware(bool enabled) { cuda_aware.store(enabled, std::memory_order_relaxed); }

CudaMemory::CudaMemory(cudaStream_t stream, bool host_access, bool abandonable)
    : stream_(stream), staged_(host_access || abandonable || !CudaAware()) {
  // Kernels queued before this call may still be producing its inputs or
  // using the memory of its outputs. Staged, the copies queued on the stream
  // wait for them (and an input's copy is waited for before MPI reads it);
  // MPI moving device memory itself must wait here.
  if (!staged_) {
    CountDevicePointerCall();
    Check(cudaStreamSynchronize(stream_), "synchronising XLA's stream");
    return;
  }
  arena_lock_ = std::unique_lock<std::mutex>(TheArena().mutex());
  Check(TheArena().Begin(), "waiting for the previous call's copies to the device");
}

CudaMemory::~CudaMemory() = default;

bool CudaMemory::Check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  if (error_.empty())
    error_ = std::string("CUDA error ") + what + ": " + cudaGetErrorString(status);
  return false;
}

CudaMemory::View& CudaMemory::ViewOf(const xla::ffi::AnyBuffer& b) {
  void* device = b.untyped_data();
  auto found = std::find_if(views_.begin(), views_.end(), [&](const View& v) {
    return v.device == device && v.bytes == b.size_bytes();
  });
  if (found != views_.end()) return *found;
  View view{device, device, b.size_bytes(), false, !staged_};
  if (staged_ && view.bytes > 0) {
    if (error_.empty())
      Check(TheArena().Take(view.bytes, &view.host), "allocating pinned host memory");
    if (!error_.empty()) {
      // MPI must never see a device pointer here: after a CUDA error the call
      // still runs (so that the other ranks do not wait for it), on scratch
      // memory, and then reports the error.
      view.host = scratch_.emplace_back(view.bytes).data();
    }
  }
  views_.push_back(view);
  return views_.back();
}

// The input is copied when it is first asked for as an input, so an in-place
// call may take its views in either order (f(m.In(x), m.Out(y)) evaluates its
// arguments in an unspecified order); every view is taken before MPI writes.
void* CudaMemory::In(const xla::ffi::AnyBuffer& b) {
  View& view = ViewOf(b);
  if (!view.loaded && view.bytes > 0 && error_.empty() &&
      Check(cudaMemcpyAsync(view.host, view.device, view.bytes, cudaMemcpyDeviceToHost, stream_),
            "copying an input to the host")) {
    Check(cudaStreamSynchronize(stream_), "copying an input to the host");
  }
  view.loaded = true;
  return view.host;
}

void* CudaMemory::Out(xla::ffi::AnyBuffer& b) {
  View& view = ViewOf(b);
  view.output = true;
  return view.host;
}

void CudaMemory::Copy(void* to, const void* from, size_t bytes) {
  if (staged_) {
    std::memcpy(to, from, bytes);
  } else if (Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, stream_), "copying")) {
    Check(cudaStreamSynchronize(stream_), "copying");
  }
}

void CudaMemory::Zero(void* to, size_t bytes) {
  if (staged_) {
    std::memset(to, 0, bytes);
  } else if (Check(cudaMemsetAsync(to, 0, bytes, stream_), "zeroing")) {
    Check(cudaStreamSynchronize(stream_), "zeroing");
  }
}

void CudaMemory::Finish() {
  if (!staged_ || !error_.empty()) return;
  bool any = false;
  for (const View& v : views_) {
    if (!v.output || v.bytes == 0) continue;
    any = true;
    if (!Check(cudaMemcpyAsync(v.device, v.host, v.bytes, cudaMemcpyHostToDevice, stream_),
               "copying an output to the device")) {
      return;
    }
  }
  if (any) Check(TheArena().Returning(stream_), "recording the copies to the device");
}

void CudaMemory::Abandon() {
  if (!staged_) return;
  TheArena().Abandon();
  static auto* kept = new std::vector<std::vector<char>>();  // under the arena's lock
  for (auto& s : scratch_) kept->push_back(std::move(s));
}

int CudaDeviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

}  // namespace mpijax
