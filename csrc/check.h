// Check mode (MPIJAX_CHECK=1): before each call, the ranks it involves agree
// on what they are about to do, so that a rank passing another shape, dtype,
// root, op or tag fails on every rank involved with a message saying who
// passed what, instead of hanging or corrupting memory.
//
// Collectives allgather a fixed-size signature over the communicator.
// Point-to-point calls shake hands with their peer under check mode's tags
// (tags.h): the sender announces its message, the
// receiver answers with what it expects, and both judge the pair alike. A
// receive from MPI_ANY_SOURCE or with MPI_ANY_TAG then takes the message of
// the sender it shook hands with.
#pragma once

#include <mpi.h>

#include <string>

#include "call.h"

namespace mpijax {

bool CheckEnabled();
void SetCheckEnabled(bool enabled);

// Agrees on `call` with the other ranks involved. On disagreement fills
// *mismatch (the same text on every rank that took part) and returns
// MPI_SUCCESS; the call must then not run. May narrow call.source and
// call.recv_tag to the sender it matched. Returns an MPI error code or
// mpi::kTimedOut otherwise.
int Agree(CallInfo& call, MPI_Comm comm, std::string* mismatch);

}  // namespace mpijax
