// The memory policy: where a handler's MPI call reads and writes. One handler
// body serves every platform; the policy it is instantiated with decides
// whether MPI sees the buffers themselves (host memory, or device memory with
// a CUDA-aware MPI) or host copies of them (cuda_memory.h).
//
// A policy is made for one call, after the communicator is known, and is told
// whether the call needs host access to the data (arithmetic or copies of its
// own beyond Copy and Zero). It hands out views:
//   In(buffer)   the buffer's data, for reading;
//   Out(buffer)  the buffer's place, for writing: the call writes all of it,
//                through MPI or Copy/Zero;
// and the same buffer always gives the same view, so `in == out` still tells
// an in-place call. A call takes its views in any order, all of them before
// it writes to one. Copy and Zero work on views of any kind. Finish() hands
// the outputs back after a successful call; error() is empty unless the
// policy itself failed (a CUDA error), and then the views are not to be used.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace mpijax {

// Host buffers, as XLA:CPU passes them: views are the buffers.
class HostMemory {
 public:
  struct Context {};  // XLA:CPU hands the handler nothing to work with
  HostMemory(Context, bool /*host_access*/) {}

  void* In(const xla::ffi::AnyBuffer& b) const { return b.untyped_data(); }
  void* Out(xla::ffi::AnyBuffer& b) const { return b.untyped_data(); }
  void Copy(void* to, const void* from, size_t bytes) const { std::memcpy(to, from, bytes); }
  void Zero(void* to, size_t bytes) const { std::memset(to, 0, bytes); }
  void Finish() const {}
  std::string error() const { return {}; }
};

}  // namespace mpijax
