// The memory policy of the CUDA handlers (see memory.h).
//
// Staged (the default): the handler runs on the host while XLA's stream may
// still be working on the buffers. Each input is copied to pinned host memory
// by a copy queued on that stream, so it follows the kernels that produce the
// input, and the policy waits for the copy before MPI reads it; MPI works in
// host memory, and outputs go back with copies queued on the stream, after
// the kernels that still use their memory. So a staged call waits for the
// stream once per input and not at all without one. The pinned memory is one
// arena reused by every call (grown on demand, never allocated per call);
// before handing it out again the policy waits for the previous call's copies
// back.
//
// CUDA-aware (MPIJAX_CUDA_AWARE=1): the policy synchronises the stream first,
// then views are the device buffers themselves and MPI moves device memory. A
// call that needs host access to its data (accumulating transposes, messages
// to oneself) is staged all the same, and so is a collective under the
// watchdog: its nonblocking form, whose device buffers Open MPI's CUDA
// support does not take (it covers blocking collectives only, and libnbc
// reduces on the host), may be abandoned, and then keeps its pinned memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace mpijax {

bool CudaAware();
void SetCudaAware(bool enabled);

class CudaMemory {
 public:
  using Context = cudaStream_t;  // XLA's stream for the call
  CudaMemory(Context stream, bool host_access, bool abandonable = false);
  ~CudaMemory();
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;

  void* In(const xla::ffi::AnyBuffer& b);
  void* Out(xla::ffi::AnyBuffer& b);
  void Copy(void* to, const void* from, size_t bytes);
  void Zero(void* to, size_t bytes);
  void Finish();
  void Abandon();
  std::string error() const { return error_; }

 private:
  struct View {
    void* device;
    void* host;
    size_t bytes;
    bool output;
    bool loaded;  // the host copy holds the input
  };
  View& ViewOf(const xla::ffi::AnyBuffer& b);
  bool Check(cudaError_t status, const char* what);

  cudaStream_t stream_;
  bool staged_;
  std::unique_lock<std::mutex> arena_lock_;
  std::vector<View> views_;
  std::vector<std::vector<char>> scratch_;  // host memory for views after a CUDA error
  std::string error_;
};

// How many CUDA devices this process can see (0 without a driver).
int CudaDeviceCount();

}  // namespace mpijax
