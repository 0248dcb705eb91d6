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
// an in-place call (a buffer is its address and size: XLA may place an empty
// buffer at another's address). A call takes its views in any order, all of them before
// it writes to one. Copy and Zero (and Fill, below) work on views of any
// kind. Finish() hands the outputs back after a successful call; Abandon()
// leaves the views to MPI for good after a collective that timed out (MPI may
// still complete it); error() is empty unless the policy itself failed (a
// CUDA error), and then the views are not to be used.
//
// It is also told whether the call may be abandoned so (a collective under
// the watchdog), and then gives MPI memory of its own, never XLA's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace mpijax {

// Host buffers, as XLA:CPU passes them: views are the buffers, but for a
// call that the watchdog may abandon (a collective under MPIJAX_TIMEOUT,
// which MPI cannot cancel and may still complete after the call gave up,
// into memory that XLA has reused since: benchmarks/late_collective.py).
// Its views are copies of mpijax's own, which Abandon() leaves to MPI.
class HostMemory {
 public:
  struct Context {};  // XLA:CPU hands the handler nothing to work with
  HostMemory(Context, bool /*host_access*/, bool abandonable = false) : own_(abandonable) {}

  void* In(const xla::ffi::AnyBuffer& b) {
    if (!own_) return b.untyped_data();
    View& view = ViewOf(b);
    if (!view.loaded && view.bytes > 0) std::memcpy(view.copy.get(), view.buffer, view.bytes);
    view.loaded = true;
    return view.copy.get();
  }
  void* Out(xla::ffi::AnyBuffer& b) {
    if (!own_) return b.untyped_data();
    View& view = ViewOf(b);
    view.output = true;
    return view.copy.get();
  }
  void Copy(void* to, const void* from, size_t bytes) const { std::memcpy(to, from, bytes); }
  void Zero(void* to, size_t bytes) const { std::memset(to, 0, bytes); }
  void Finish() {
    for (const View& v : views_) {
      if (v.output && v.bytes > 0) std::memcpy(v.buffer, v.copy.get(), v.bytes);
    }
  }
  // The call timed out: MPI keeps its views for good.
  void Abandon() {
    for (View& v : views_) v.copy.release();
  }
  std::string error() const { return {}; }

 private:
  struct View {
    void* buffer;
    size_t bytes;
    std::unique_ptr<char[]> copy;
    bool output = false;
    bool loaded = false;  // the copy holds the input
  };
  View& ViewOf(const xla::ffi::AnyBuffer& b) {
    for (View& v : views_) {
      if (v.buffer == b.untyped_data() && v.bytes == b.size_bytes()) return v;
    }
    return views_.emplace_back(
        View{b.untyped_data(), b.size_bytes(), std::unique_ptr<char[]>(new char[b.size_bytes()])});
  }

  bool own_;
  std::vector<View> views_;
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
