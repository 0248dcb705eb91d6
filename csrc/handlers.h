// The XLA FFI handlers, one per operation and platform, with the target
// names "mpijax_<name>" that Python registers them under.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace mpijax {

// A point-to-point call's peer (dest or source) given as kRouted is taken,
// with its tag, at run time from the call's route operand: the Envelope of
// an earlier receive, whose sender it names. The derivatives of a receive
// from MPI_ANY_SOURCE or with MPI_ANY_TAG answer whoever actually sent.
inline constexpr int kRouted = -2000000;

// A receive's envelope output, the route of the calls that answer it: its
// status, and the bytes of each part of its message (of one batch element's
// message under vmap), or -1 where they are not known. The route of a call
// whose peers are known at trace time is a status from MPI_PROC_NULL with -1
// (Python's unrouted()).
struct Envelope {
  MPI_Status status;
  int64_t part_bytes;
};

// The route of no message, every byte set (Python's unrouted() is its bytes).
inline Envelope NoRoute() {
  Envelope e;
  std::memset(&e, 0, sizeof e);
  e.status.MPI_SOURCE = MPI_PROC_NULL;
  e.status.MPI_TAG = MPI_ANY_TAG;
  e.part_bytes = -1;
  return e;
}

// Platform ("cpu", and "CUDA" in CUDA builds) -> (target name, handler).
using HandlerTable = std::map<std::string, std::vector<std::pair<const char*, XLA_FFI_Handler*>>>;
const HandlerTable& HandlersByPlatform();

}  // namespace mpijax
