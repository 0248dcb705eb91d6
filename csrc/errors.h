// The text of a failed call: what the Python exception says, the same way on
// every MPI library.
#pragma once

#include <mpi.h>

#include <string>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax {

// The communicator a call runs on.
struct Comm {
  MPI_Comm handle;
  int rank;
  int size;
};

// "rank 0 of 2": how every error names the rank.
std::string RankOf(const Comm& comm);

// The error that `call` returns for MPI error code `code` (or mpi::kTimedOut):
// the op, the rank, the standard error class and the library's own words, or
// for a timeout whom the call was waiting for.
xla::ffi::Error Failure(const CallInfo& call, const Comm& comm, int code);

// The error of a call on a communicator whose collective `abandoned` timed
// out (AbandonComm, registry.h).
xla::ffi::Error Abandoned(const CallInfo& call, const Comm& comm, const std::string& abandoned);

}  // namespace mpijax
