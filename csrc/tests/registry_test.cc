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
  ASSERT_TRUE(LookupComm(other, &found));
  EXPECT_EQ(found, dup);
  MPI_Comm_free(&dup);
}

TEST(Registry, UnknownIdsAndNullAreRejected) {
  MPI_Comm found;
  EXPECT_FALSE(LookupComm(-1, &found));
  EXPECT_FALSE(LookupComm(1 << 30, &found));
  EXPECT_THROW(RegisterComm(MPI_COMM_NULL), std::invalid_argument);
}

}  // namespace
}  // namespace mpijax
