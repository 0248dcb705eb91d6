// The text of a failed call: each error class's usual cause, as
// docs/failure-modes.md quotes it, whichever MPI library reported it.
#include "errors.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "mpi_calls.h"

namespace mpijax {
namespace {

std::string Text(const CallInfo& call, int code) {
  return Failure(call, Comm{MPI_COMM_WORLD, 0, 2}, code).message();
}

void ExpectIn(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << text;
}

CallInfo Call(const char* op) {
  CallInfo call;
  call.op = op;
  call.dtype = "float64";
  return call;
}

TEST(Errors, TruncationInACollectiveWithoutARootNamesTheCauses) {
  const std::string text = Text(Call("allgather"), MPI_ERR_TRUNCATE);
  EXPECT_EQ(text.rfind("mpijax.allgather failed on rank 0 of 2: MPI_ERR_TRUNCATE", 0), 0u) << text;
  ExpectIn(text,
           ". The ranks' arrays differ in size, or the ranks called different collectives "
           "(MPIJAX_CHECK=1 names the difference)");
}

TEST(Errors, TruncationInACollectiveWithARootNamesTheBatchedCause) {
  CallInfo call = Call("bcast");
  call.root = 0;
  ExpectIn(Text(call, MPI_ERR_TRUNCATE),
           ". The ranks' arrays differ in size (under jax.vmap of a derivative, also where one "
           "rank's array is batched and another's is not");
}

TEST(Errors, TruncationOfAMessageNamesItAndAWiderDtype) {
  CallInfo call = Call("recv");
  call.source = 1;
  call.recv_tag = 3;
  ExpectIn(Text(call, MPI_ERR_TRUNCATE),
           "(receiving from rank 1 with tag 3). The message is longer than the array receiving it: "
           "either the sender's array is larger (or of a wider dtype)");
}

TEST(Errors, AMessageEndingInsideAnElementNamesTheReceivingDtype) {
  CallInfo call = Call("sendrecv");
  call.source = 1;
  call.recv_tag = 0;
  call.dest = 1;
  call.send_tag = 0;
  call.dtype = "float32";
  call.recv_dtype = "float64";
  EXPECT_EQ(Text(call, mpi::kPartElement),
            "mpijax.sendrecv failed on rank 0 of 2: the message ends inside an element of the "
            "float64 array receiving it (receiving from rank 1 with tag 0 and sending to rank 1 "
            "with tag 0): the sender's array has another dtype, and MPI does not convert it (with "
            "x64 on, jnp.zeros(n) is float64); give the receive buffer the sender's dtype");
}

}  // namespace
}  // namespace mpijax
