// Check mode's agreement and the watchdog, at whatever size ctest runs.
#include "check.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "mpi_calls.h"

namespace mpijax {
namespace {

int Rank() {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int Size() {
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// A call on a vector of n four-byte elements.
CallInfo Vector(const char* op, const char* dtype, int64_t n) {
  CallInfo call;
  call.op = op;
  call.count = n;
  call.dtype = dtype;
  call.bytes = 4 * n;
  call.shape.ndim = 1;
  call.shape.dims[0] = n;
  return call;
}

CallInfo Allreduce(int64_t n) {
  CallInfo call = Vector("allreduce", "float32", n);
  call.reduction = 0;
  return call;
}

CallInfo Send(int dest, int tag, int64_t n) {
  CallInfo call = Vector("send", "int32", n);
  call.dest = dest;
  call.send_tag = tag;
  return call;
}

CallInfo Recv(int source, int tag, int64_t n) {
  CallInfo call = Vector("recv", "int32", n);
  call.source = source;
  call.recv_tag = tag;
  return call;
}

TEST(Check, CollectiveAgreementPasses) {
  CallInfo call = Allreduce(4);
  std::string mismatch;
  ASSERT_EQ(Agree(call, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
  EXPECT_EQ(mismatch, "");
}

TEST(Check, CollectiveMismatchIsReportedOnEveryRank) {
  if (Size() < 2) GTEST_SKIP() << "needs two ranks";
  CallInfo call = Allreduce(Rank() == 1 ? 5 : 4);
  if (Rank() == 1) call.root = 0;
  std::string mismatch;
  ASSERT_EQ(Agree(call, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
  std::string want = "mpijax check mode: the ranks disagree on a collective call: ";
  want += Size() == 2 ? "rank 0" : "ranks 0, 2";
  if (Size() > 3) want += ", 3";
  want +=
      " called allreduce(SUM) of float32[4]; rank 1 called allreduce(SUM) of float32[5] with root "
      "0";
  if (Size() <= 4) {
    EXPECT_EQ(mismatch, want);
  }
}

TEST(Check, AnySourceAndAnyTagAreNarrowedToTheMatchedSender) {
  if (Size() < 2) GTEST_SKIP() << "needs two ranks";
  std::string mismatch;
  if (Rank() == 0) {
    CallInfo send = Send(1, 7, 3);
    ASSERT_EQ(Agree(send, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
    EXPECT_EQ(send.dest, 1);
  } else if (Rank() == 1) {
    CallInfo recv = Recv(MPI_ANY_SOURCE, MPI_ANY_TAG, 3);
    ASSERT_EQ(Agree(recv, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
    EXPECT_EQ(recv.source, 0);
    EXPECT_EQ(recv.recv_tag, 7);
  }
  EXPECT_EQ(mismatch, "");
}

// A message to oneself shakes no hands, so a receive from anyone takes it
// where it waits, rather than wait for an announcement that never comes.
TEST(Check, AnySourceTakesAMessageToOneselfThatWaits) {
  int x = 5, y = 0;
  ASSERT_EQ(mpi::Send(&x, 1, MPI_INT, Rank(), 9, MPI_COMM_WORLD), MPI_SUCCESS);
  CallInfo recv = Recv(MPI_ANY_SOURCE, MPI_ANY_TAG, 1);
  std::string mismatch;
  ASSERT_EQ(Agree(recv, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
  EXPECT_EQ(mismatch, "");
  EXPECT_EQ(recv.source, Rank());
  EXPECT_EQ(recv.recv_tag, 9);
  ASSERT_EQ(
      mpi::Recv(&y, 1, MPI_INT, recv.source, recv.recv_tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
      MPI_SUCCESS);
  EXPECT_EQ(y, 5);
}

// Rank 0 sends `sent`, rank 1 receives into `wanted`; returns each end's
// mismatch text and whether its peer was kept.
std::pair<std::string, bool> Pair(const CallInfo& sent, const CallInfo& wanted) {
  std::string mismatch;
  CallInfo call = Rank() == 0 ? sent : wanted;
  if (Rank() < 2) {
    EXPECT_EQ(Agree(call, MPI_COMM_WORLD, &mismatch), MPI_SUCCESS);
  }
  return {mismatch, Rank() == 0 ? call.dest == 1 : call.source == 0};
}

TEST(Check, MessageIntoALargerBufferOfAnyShapeFits) {
  if (Size() < 2) GTEST_SKIP() << "needs two ranks";
  // 24 elements in ten dimensions, of which the last three are folded (call.h).
  CallInfo sent = Send(1, 7, 0);
  sent.shape.ndim = 10;
  std::fill(sent.shape.dims, sent.shape.dims + Shape::kMaxDims - 1, 1);
  sent.shape.dims[Shape::kMaxDims - 1] = 2 * 3 * 4;
  for (int64_t n : {24, 25}) {
    const auto [mismatch, kept] = Pair(sent, Recv(0, 7, n));
    if (Rank() < 2) {
      EXPECT_EQ(mismatch, "") << n;
      EXPECT_TRUE(kept) << n;
    }
  }
}

TEST(Check, OverrunDtypeAndTagMismatchesAreReportedAlikeByBothEnds) {
  if (Size() < 2) GTEST_SKIP() << "needs two ranks";
  CallInfo other_dtype = Recv(0, 7, 4);
  other_dtype.dtype = "float32";
  const std::pair<CallInfo, const char*> cases[] = {
      {Recv(0, 7, 3), "int32[3] with tag 7"},
      {other_dtype, "float32[4] with tag 7"},
      {Recv(0, 8, 4), "int32[4] with tag 8"},
  };
  for (const auto& [wanted, expects] : cases) {
    const auto [mismatch, kept] = Pair(Send(1, 7, 4), wanted);
    if (Rank() < 2) {
      EXPECT_EQ(mismatch,
                "mpijax check mode: a message does not match its receive: rank 0 sends int32[4] "
                "with tag 7 (send), rank 1 expects " +
                    std::string(expects) + " (recv)");
      EXPECT_FALSE(kept);
    }
  }
}

class Watchdog : public ::testing::Test {
 protected:
  void SetUp() override { mpi::SetTimeout(0.2); }
  void TearDown() override { mpi::SetTimeout(0.0); }
};

TEST_F(Watchdog, UnmatchedReceiveTimesOutAndIsCancelled) {
  int x = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(mpi::Recv(&x, 1, MPI_INT, MPI_ANY_SOURCE, 12345, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            mpi::kTimedOut);
  const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited.count(), 0.2);
  EXPECT_LT(waited.count(), 10.0);
  // Cancelled: a later message with that tag goes to a later receive.
  int sent = 42;
  MPI_Request request;
  MPI_Isend(&sent, 1, MPI_INT, Rank(), 12345, MPI_COMM_WORLD, &request);
  EXPECT_EQ(mpi::Recv(&x, 1, MPI_INT, Rank(), 12345, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            MPI_SUCCESS);
  MPI_Wait(&request, MPI_STATUS_IGNORE);
  EXPECT_EQ(x, 42);
}

TEST_F(Watchdog, CollectiveMissingARankTimesOut) {
  if (Size() < 2) GTEST_SKIP() << "needs two ranks";
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (Rank() == 0) {
    EXPECT_EQ(mpi::Barrier(comm), mpi::kTimedOut);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // The others join late, still in nonblocking form (blocking and nonblocking
  // collectives do not match), and complete rank 0's abandoned barrier while
  // rank 0 drives progress from a later blocking call.
  mpi::SetTimeout(30.0);
  if (Rank() != 0) {
    EXPECT_EQ(mpi::Barrier(comm), MPI_SUCCESS);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_free(&comm);
}

}  // namespace
}  // namespace mpijax
