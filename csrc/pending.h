// Messages that one call starts and a later call completes (mpijax.isend,
// irecv and ineighbor_exchange, then mpijax.wait), kept here with the
// buffers MPI works on, under an id that the program carries from the start
// to the wait as data.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "mpi_calls.h"

namespace mpijax {

struct Pending {
  MPI_Comm comm = MPI_COMM_NULL;
  // Their data points into `buffers`: the sends' copies (XLA may reuse the
  // sends' own buffers once the start returns) and the receives' places.
  std::vector<mpi::Transfer> recvs, sends;
  std::vector<MPI_Request> requests;  // receives first (mpi::Post)
  std::vector<std::vector<char>> buffers;
};

// The program carries ids as float32 scalars (so that a request's id can
// carry its derivatives: the id of the request that moves them), so ids stay
// below 2^24, where every integer is a float32; 0 is no request (a wait on it
// completes nothing and gives zeros).
constexpr int32_t kIdLimit = 1 << 24;
// Keep's ids stay below this bit, which a start made under differentiation
// adds to its id: the transpose of its wait, which may run in a loop that
// also waits for requests started outside the differentiation, reads it to
// tell whether derivative messages exist.
constexpr int32_t kDifferentiated = 1 << 23;
// What a wait under vmap gets where the batch's elements hold different ids
// (nonblocking.py, MIXED).
constexpr float kMixedBatch = -1;

// Keeps `pending` and returns its id (never 0, below kDifferentiated).
int32_t Keep(Pending pending);
// The pending messages of `id` (with or without kDifferentiated), which are
// no longer kept; none if there are none under that id (never started, or
// already waited for).
std::optional<Pending> Take(int32_t id);
// How many are kept: started and not yet waited for.
size_t PendingCount();

}  // namespace mpijax
