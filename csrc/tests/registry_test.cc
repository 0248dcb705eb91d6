#include "registry.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <stdexcept>

namespace mpijax {
namespace {

TEST(Registry, IdsAreStableAndDistinct) {
  MPI_Comm dup;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
  const int64_t world = RegisterComm(MPI_COMM_WORLD);
  const int64_t other = RegisterComm(dup);
  EXPECT_NE(world, other);
  EXPECT_EQ(RegisterComm(MPI_COMM_WORLD), world);
  MPI_Comm found;
  ASSERT_EQ(LookupComm(other, &found), Found::kYes);
  EXPECT_EQ(found, dup);
  MPI_Comm_free(&dup);
}

TEST(Registry, ANewCommunicatorThatReusesAFreedHandleGetsANewId) {
  MPI_Comm first, second;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &first), MPI_SUCCESS);
  const MPI_Comm handle = first;
  const int64_t id = RegisterComm(first);
  EXPECT_EQ(RegisterComm(first), id);
  ASSERT_EQ(MPI_Comm_free(&first), MPI_SUCCESS);
  MPI_Comm found;
  EXPECT_EQ(LookupComm(id, &found), Found::kGone);  // retired with the communicator
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, 0, 0, &second), MPI_SUCCESS);
  const int64_t again = RegisterComm(second);
  EXPECT_NE(again, id);
  EXPECT_EQ(LookupComm(id, &found), Found::kGone);
  if (second == handle) {  // the case this is about, which MPI libraries tend to produce
    ASSERT_EQ(LookupComm(again, &found), Found::kYes);
    EXPECT_EQ(found, second);
  }
  MPI_Comm_free(&second);
}

// What a program exported by another job finds under its communicator's id.
TEST(Registry, AnIdHoldsItsCommunicatorsSize) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm dup, alone;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank, 0, &alone), MPI_SUCCESS);
  const int64_t id = RegisterComm(dup);
  EXPECT_EQ(id >> kIndexBits, size);
  EXPECT_EQ(RegisterComm(alone) >> kIndexBits, 1);
  MPI_Comm found = MPI_COMM_NULL;
  EXPECT_EQ(LookupComm(id + (int64_t{1} << kIndexBits), &found), Found::kOtherSize);
  EXPECT_EQ(found, dup);
  MPI_Comm_free(&dup);
  MPI_Comm_free(&alone);
}

TEST(Registry, ReversedCommunicatorIsMadeOnceAndFreedWithItsParent) {
  MPI_Comm dup, reversed, again;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
  ASSERT_EQ(ReversedComm(dup, &reversed), MPI_SUCCESS);
  ASSERT_EQ(ReversedComm(dup, &again), MPI_SUCCESS);
  EXPECT_EQ(reversed, again);
  int rank, size, reversed_rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(reversed, &reversed_rank);
  EXPECT_EQ(reversed_rank, size - 1 - rank);
  // A new communicator, even one that reuses the freed handle, gets its own.
  ASSERT_EQ(MPI_Comm_free(&dup), MPI_SUCCESS);
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
  ASSERT_EQ(ReversedComm(dup, &again), MPI_SUCCESS);
  MPI_Comm_rank(again, &reversed_rank);
  EXPECT_EQ(reversed_rank, size - 1 - rank);
  MPI_Comm_free(&dup);
}

void Keep(void*, void*, int*, MPI_Datatype*) {}

TEST(Registry, UserOpIdsAreStableAndDistinct) {
  MPI_Op a, b;
  ASSERT_EQ(MPI_Op_create(Keep, 1, &a), MPI_SUCCESS);
  ASSERT_EQ(MPI_Op_create(Keep, 0, &b), MPI_SUCCESS);
  const int64_t id = RegisterOp(a);
  EXPECT_NE(RegisterOp(b), id);
  EXPECT_EQ(RegisterOp(a), id);
  MPI_Op found;
  ASSERT_TRUE(LookupOp(id, &found));
  EXPECT_EQ(found, a);
  MPI_Op_free(&a);
  MPI_Op_free(&b);
}

TEST(Registry, UnknownIdsAndNullAreRejected) {
  MPI_Comm found;
  EXPECT_EQ(LookupComm(-1, &found), Found::kGone);
  EXPECT_EQ(LookupComm(1 << 20, &found), Found::kGone);
  EXPECT_THROW(RegisterComm(MPI_COMM_NULL), std::invalid_argument);
  MPI_Op op;
  EXPECT_FALSE(LookupOp(-1, &op));
  EXPECT_FALSE(LookupOp(1 << 30, &op));
  EXPECT_THROW(RegisterOp(MPI_OP_NULL), std::invalid_argument);
}

}  // namespace
}  // namespace mpijax
