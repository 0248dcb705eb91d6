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
// it writes to one. Copy and Zero (and Fill, below) work on views of any
// kind. Finish() hands the outputs back after a successful call; error() is
// empty unless the policy itself failed (a CUDA error), and then the views
// are not to be used.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
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

// Writes `element` over the `bytes` of view `out`: the first copy from the
// host, then doubling copies within `out`, which the policy's Copy makes in
// any memory; a zero element is one Zero.
template <class Memory>
void Fill(Memory& m, void* out, xla::ffi::Span<const uint8_t> element, size_t bytes) {
  if (bytes == 0) return;
  if (std::all_of(element.begin(), element.end(), [](uint8_t b) { return b == 0; })) {
    m.Zero(out, bytes);
    return;
  }
  char* to = static_cast<char*>(out);
  m.Copy(to, element.begin(), element.size());
  for (size_t done = element.size(); done < bytes;) {
    const size_t n = std::min(done, bytes - done);
    m.Copy(to + done, to, n);
    done += n;
  }
}

}  // namespace mpijax
