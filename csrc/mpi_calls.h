// MPI calls that take 64-bit element counts. Classic MPI takes `int` counts,
// and Open MPI 4 has no MPI-4 `_c` calls, so counts above the limit are
// described by a derived datatype (data movement) or split into chunks
// (reductions, whose predefined ops only apply to predefined types).
// Every function returns an MPI error code: MPI_ERR_TYPE for MPI_DATATYPE_NULL
// and MPI_ERR_OP for MPI_OP_NULL, which callers pass for what they cannot map,
// or kTimedOut (kWrongSize where said).
//
// The watchdog (MPIJAX_TIMEOUT): with a timeout set, each call starts the
// nonblocking form and polls it, and gives up with kTimedOut once it has not
// completed in time. A timed-out receive is cancelled; a collective cannot be
// (MPI forbids it) and stays pending, so its communicator takes no more
// calls (AbandonComm, registry.h). Without a timeout the blocking forms
// run, which MPI libraries tune better than the nonblocking ones. Since MPI
// never matches a blocking collective with a nonblocking one, every rank
// must use the same setting.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace mpijax::mpi {

// The largest count passed to one MPI call: INT_MAX, or lower in tests so
// that the large-count paths run on small arrays.
int64_t CountLimit();
void SetCountLimit(int64_t limit);

// Seconds a call may wait; 0 waits forever.
double Timeout();
void SetTimeout(double seconds);
inline constexpr int kTimedOut = -1;  // MPI error codes are >= 0
// A message shorter than its receive, where it must fill it (NeighborExchange).
inline constexpr int kWrongSize = -2;
// A message that ends inside an element of its receive (recv, sendrecv): the
// sender's dtype is not the buffer's, whose element MPI cannot convert.
inline constexpr int kPartElement = -3;

// `count` elements of `element` as one (int count, datatype) pair.
class Block {
 public:
  Block(int64_t count, MPI_Datatype element);
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  int error() const { return error_; }
  int count() const { return count_; }
  MPI_Datatype type() const { return type_; }

 private:
  int count_ = 0;
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  bool owned_ = false;
  int error_ = MPI_SUCCESS;
};

// A receive from MPI_ANY_SOURCE with MPI_ANY_TAG takes the first message of
// values that reaches it (tags.h): derivative messages it meets first, sent
// early by a rank that is further along, are received whole and set aside.
// Their own receive then takes them with TakeAside, which finds the earliest
// one from `source` with `tag` on `comm`, if any.
bool TakeAside(int source, int tag, MPI_Comm comm, std::vector<char>* data, MPI_Status* status);

int Send(const void* buf, int64_t count, MPI_Datatype type, int dest, int tag, MPI_Comm comm);
int Recv(void* buf, int64_t count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
         MPI_Status* status);
int Sendrecv(const void* send, int64_t send_count, MPI_Datatype send_type, int dest, int send_tag,
             void* recv, int64_t recv_count, MPI_Datatype recv_type, int source, int recv_tag,
             MPI_Comm comm, MPI_Status* status);

// One message of NeighborExchange: `count` elements of `type` at `data`, to
// or from `peer` (which may be MPI_PROC_NULL) under `tag`.
struct Transfer {
  void* data;
  int64_t count;
  MPI_Datatype type;
  int peer;
  int tag;
};
// Posts every receive, then every send, and completes them together: one
// round of MPI for any number of neighbours, oneself included. A message must
// fill its receive exactly: a longer one is MPI_ERR_TRUNCATE, a shorter one
// kWrongSize. On an
// error or timeout *failed is the message's index (receives first, then
// sends), or -1 if no one message is to blame.
int NeighborExchange(const std::vector<Transfer>& recvs, const std::vector<Transfer>& sends,
                     MPI_Comm comm, int* failed);
// Its two halves, for calls that let computation run between them: Post
// starts every message (receives first), one request each; Finish completes
// them. In between, the buffers belong to MPI.
int Post(const std::vector<Transfer>& recvs, const std::vector<Transfer>& sends, MPI_Comm comm,
         std::vector<MPI_Request>* requests, int* failed);
int Finish(const std::vector<Transfer>& recvs, std::vector<MPI_Request>* requests, int* failed);

int Barrier(MPI_Comm comm);
// `count` is the per-rank block for the rooted and all-to-all collectives.
int Bcast(void* buf, int64_t count, MPI_Datatype type, int root, MPI_Comm comm);
int Gather(const void* in, void* out, int64_t count, MPI_Datatype type, int root, MPI_Comm comm);
int Scatter(const void* in, void* out, int64_t count, MPI_Datatype type, int root, MPI_Comm comm);
int Allgather(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Comm comm);
int Alltoall(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Comm comm);

// The v-variants: counts[i] elements for rank i, one block after the other in
// rank order (no gaps); one entry per rank of `comm`. Where a count or offset
// exceeds CountLimit(), one MPI_Alltoallw moves the same blocks, each
// described by a datatype at its 64-bit byte offset. The counts of
// Allgatherv, Gatherv and Scatterv are the same on every rank (so is the
// choice). Alltoallv's are each rank's own, so whether they fit could differ
// between ranks, which must all make the same collective call: it calls
// MPI_Alltoallw, or MPI_Alltoallv where the caller knows that every rank's
// counts and offsets fit (`int_counts`, true on every rank alike).
using Counts = std::vector<int64_t>;
int Allgatherv(const void* in, void* out, const Counts& counts, MPI_Datatype type, MPI_Comm comm);
int Gatherv(const void* in, void* out, const Counts& counts, MPI_Datatype type, int root,
            MPI_Comm comm);
int Scatterv(const void* in, void* out, const Counts& counts, MPI_Datatype type, int root,
             MPI_Comm comm);
int Alltoallv(const void* in, const Counts& send_counts, void* out, const Counts& recv_counts,
              MPI_Datatype type, MPI_Comm comm, bool int_counts = false);

// in == out reduces in place. `out` is ignored off the root for Reduce.
int Allreduce(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op,
              MPI_Comm comm);
int Reduce(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op, int root,
           MPI_Comm comm);
// Whether Reduce reads an in-place input through a host copy on `rank`:
// MPICH 4.0-4.1.1 crash on MPI_IN_PLACE at a root other than 0
// (pmodels/mpich#6540), and its derivatives carry their own version numbers.
constexpr bool ReduceCopiesInput([[maybe_unused]] int rank, [[maybe_unused]] int root) {
#ifdef MPICH_VERSION
  return rank == root && root != 0;
#else
  return false;
#endif
}
// Rank r gets the reduction of every rank's block r (`count` elements each).
// Blocks above CountLimit() are reduced one root at a time, in chunks.
int ReduceScatter(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm);

// exclusive: MPI_Exscan, which leaves `out` on the first rank undefined.
int Scan(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op, bool exclusive,
         MPI_Comm comm);

}  // namespace mpijax::mpi
