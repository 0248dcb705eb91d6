// Compiled programs name a communicator, or a user-defined reduction
// operator, by a small id, never by a raw handle: ids are stable for the life
// of the process and an unknown id is an error rather than a dangling pointer.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace mpijax {

// Returns the id of `comm`, registering it on first sight. Throws
// std::invalid_argument for MPI_COMM_NULL.
int64_t RegisterComm(MPI_Comm comm);

// A communicator's id holds its size above its index in the registry. A
// program made by another job (jax.export) names each communicator by the
// order in which that process first used them; it must not run on a
// communicator of another size here, which its shapes would not fit.
inline constexpr int kIndexBits = 24;

// What a compiled program's id finds in this process: its communicator; none
// (freed since, or never made here); or a communicator of another size, which
// is put in `comm`.
enum class Found { kYes, kGone, kOtherSize };
Found LookupComm(int64_t id, MPI_Comm* comm);

// A collective that timed out stays pending in MPI, which cannot cancel it,
// and may still write into buffers that XLA has since reused: its
// communicator takes no more calls. AbandonedBy gives the op of the
// collective that timed out on `id`, or "".
void AbandonComm(int64_t id, const char* op);
std::string AbandonedBy(int64_t id);

// The same for user-defined reduction operators (mpi4py's MPI.Op.Create).
// Throws std::invalid_argument for MPI_OP_NULL.
int64_t RegisterOp(MPI_Op op);
bool LookupOp(int64_t id, MPI_Op* op);

// `comm` with its ranks in reverse order, for suffix scans. Created on first
// use by MPI_Comm_split, which is collective: call it where every rank of
// `comm` makes the same call. Kept as an attribute of `comm` (so it is freed
// with it, and a later communicator that reuses the handle starts afresh on
// every rank alike). Returns an MPI error code.
int ReversedComm(MPI_Comm comm, MPI_Comm* reversed);

}  // namespace mpijax
