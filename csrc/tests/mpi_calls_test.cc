// The large-count paths, run on small arrays by lowering the per-call limit,
// each with the blocking calls and with the watchdog's nonblocking ones.
#include "mpi_calls.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <climits>
#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "pending.h"
#include "tags.h"

namespace mpijax::mpi {
namespace {

class MpiCalls : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    SetCountLimit(3);
    SetTimeout(std::get<1>(GetParam()) ? 60.0 : 0.0);
  }
  void TearDown() override {
    SetCountLimit(INT_MAX);
    SetTimeout(0.0);
  }
  int64_t Count() const { return std::get<0>(GetParam()); }

  // Distinct values per rank and position.
  std::vector<int> Data(int rank, int64_t n) const {
    std::vector<int> v(n);
    std::iota(v.begin(), v.end(), 1000 * rank);
    return v;
  }

  int rank_ = 0, size_ = 1;
};

TEST_P(MpiCalls, Collectives) {
  const int64_t n = Count();
  const int root = size_ - 1;
  const auto mine = Data(rank_, n);
  std::vector<int> all, stacked;
  for (int r = 0; r < size_; ++r) {
    const auto d = Data(r, n);
    stacked.insert(stacked.end(), d.begin(), d.end());
  }

  std::vector<int> out(n * size_, -1);
  ASSERT_EQ(Allgather(mine.data(), out.data(), n, MPI_INT, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(out, stacked);

  out.assign(n * size_, -1);
  ASSERT_EQ(Gather(mine.data(), out.data(), n, MPI_INT, root, MPI_COMM_WORLD), MPI_SUCCESS);
  if (rank_ == root) {
    EXPECT_EQ(out, stacked);
  }

  std::vector<int> block(n, -1);
  ASSERT_EQ(Scatter(stacked.data(), block.data(), n, MPI_INT, root, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(block, Data(rank_, n));

  block = rank_ == root ? mine : std::vector<int>(n, -1);
  ASSERT_EQ(Bcast(block.data(), n, MPI_INT, root, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(block, Data(root, n));

  // alltoall: block j of rank r holds Data(r, n)[.] + j; rank i gets blocks i of all.
  std::vector<int> send, want;
  for (int j = 0; j < size_; ++j) {
    for (int v : mine) send.push_back(v + j);
  }
  for (int r = 0; r < size_; ++r) {
    for (int v : Data(r, n)) want.push_back(v + rank_);
  }
  out.assign(n * size_, -1);
  ASSERT_EQ(Alltoall(send.data(), out.data(), n, MPI_INT, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(out, want);
}

// Rank r has Count() + r elements (zero for some ranks when Count() is 0):
// with the limit at 3, small counts take the v-collectives and larger ones
// (or their offsets) the MPI_Alltoallw path.
TEST_P(MpiCalls, VCollectives) {
  const int root = size_ - 1;
  Counts counts;
  std::vector<int> concatenated;
  for (int r = 0; r < size_; ++r) {
    counts.push_back(Count() + r);
    const auto d = Data(r, Count() + r);
    concatenated.insert(concatenated.end(), d.begin(), d.end());
  }
  const auto mine = Data(rank_, Count() + rank_);
  std::vector<int> out(concatenated.size(), -1);
  ASSERT_EQ(Allgatherv(mine.data(), out.data(), counts, MPI_INT, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(out, concatenated);

  out.assign(concatenated.size(), -1);
  ASSERT_EQ(Gatherv(mine.data(), out.data(), counts, MPI_INT, root, MPI_COMM_WORLD), MPI_SUCCESS);
  if (rank_ == root) {
    EXPECT_EQ(out, concatenated);
  }

  std::vector<int> block(mine.size(), -1);
  ASSERT_EQ(Scatterv(concatenated.data(), block.data(), counts, MPI_INT, root, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(block, mine);

  // alltoallv: rank r sends Count() + j elements to rank j, valued 1000 * r + 100 * j + i.
  Counts send_counts, recv_counts;
  std::vector<int> send, want;
  for (int j = 0; j < size_; ++j) {
    send_counts.push_back(Count() + j);
    recv_counts.push_back(Count() + rank_);
    for (int64_t i = 0; i < Count() + j; ++i) send.push_back(1000 * rank_ + 100 * j + int(i));
    for (int64_t i = 0; i < Count() + rank_; ++i) want.push_back(1000 * j + 100 * rank_ + int(i));
  }
  out.assign(want.size(), -1);
  ASSERT_EQ(Alltoallv(send.data(), send_counts, out.data(), recv_counts, MPI_INT, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(out, want);
}

TEST_P(MpiCalls, Reductions) {
  const int64_t n = Count();
  const int root = 0;
  std::vector<int> sum(n, 0), prefix(n, 0);
  for (int r = 0; r < size_; ++r) {
    const auto d = Data(r, n);
    for (int64_t i = 0; i < n; ++i) {
      sum[i] += d[i];
      if (r <= rank_) prefix[i] += d[i];
    }
  }
  std::vector<int> out(n, -1);
  ASSERT_EQ(Allreduce(Data(rank_, n).data(), out.data(), n, MPI_INT, MPI_SUM, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(out, sum);

  auto in_place = Data(rank_, n);
  ASSERT_EQ(Allreduce(in_place.data(), in_place.data(), n, MPI_INT, MPI_SUM, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(in_place, sum);

  in_place = Data(rank_, n);
  ASSERT_EQ(Scan(in_place.data(), in_place.data(), n, MPI_INT, MPI_SUM, false, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(in_place, prefix);

  out.assign(n, -1);
  ASSERT_EQ(Scan(Data(rank_, n).data(), out.data(), n, MPI_INT, MPI_SUM, true, MPI_COMM_WORLD),
            MPI_SUCCESS);
  if (rank_ > 0) {  // MPI leaves the first rank's result undefined
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], prefix[i] - Data(rank_, n)[i]);
  }

  in_place = Data(rank_, n);
  ASSERT_EQ(Reduce(in_place.data(), rank_ == root ? in_place.data() : nullptr, n, MPI_INT, MPI_SUM,
                   root, MPI_COMM_WORLD),
            MPI_SUCCESS);
  EXPECT_EQ(in_place, rank_ == root ? sum : Data(rank_, n));

  // reduce_scatter: block r of rank q is Data(q, n * size)[r * n ...].
  std::vector<int> blocks_sum(n, 0);
  for (int q = 0; q < size_; ++q) {
    const auto d = Data(q, n * size_);
    for (int64_t i = 0; i < n; ++i) blocks_sum[i] += d[rank_ * n + i];
  }
  out.assign(n, -1);
  ASSERT_EQ(
      ReduceScatter(Data(rank_, n * size_).data(), out.data(), n, MPI_INT, MPI_SUM, MPI_COMM_WORLD),
      MPI_SUCCESS);
  EXPECT_EQ(out, blocks_sum);
}

TEST_P(MpiCalls, SendrecvRing) {
  const int64_t n = Count();
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  std::vector<int> out(n + 2, -1);
  MPI_Status status;
  ASSERT_EQ(Sendrecv(Data(rank_, n).data(), n, MPI_INT, next, 5, out.data(), n + 2, MPI_INT, prev,
                     5, MPI_COMM_WORLD, &status),
            MPI_SUCCESS);
  out.resize(n);
  EXPECT_EQ(out, Data(prev, n));
  int bytes;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  EXPECT_EQ(bytes, n * static_cast<int>(sizeof(int)));
  EXPECT_EQ(status.MPI_SOURCE, prev);
}

// Every message in flight at once: to the next rank, the previous one,
// oneself, and nowhere (MPI_PROC_NULL); then a message shorter than its
// receive, which NeighborExchange reports.
TEST_P(MpiCalls, NeighborExchange) {
  const int64_t n = Count();
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  auto a = Data(rank_, n), b = Data(rank_ + 10, n), c = Data(rank_ + 20, n);
  std::vector<int> from_prev(n, -1), from_next(n, -1), from_self(n, -1), none(n, -1);
  const std::vector<Transfer> sends = {{a.data(), n, MPI_INT, next, 0},
                                       {b.data(), n, MPI_INT, prev, 1},
                                       {c.data(), n, MPI_INT, rank_, 2},
                                       {a.data(), n, MPI_INT, MPI_PROC_NULL, 3}};
  const std::vector<Transfer> recvs = {{from_prev.data(), n, MPI_INT, prev, 0},
                                       {from_next.data(), n, MPI_INT, next, 1},
                                       {from_self.data(), n, MPI_INT, rank_, 2},
                                       {none.data(), n, MPI_INT, MPI_PROC_NULL, 3}};
  int failed = 0;
  ASSERT_EQ(NeighborExchange(recvs, sends, MPI_COMM_WORLD, &failed), MPI_SUCCESS);
  EXPECT_EQ(failed, -1);
  EXPECT_EQ(from_prev, Data(prev, n));
  EXPECT_EQ(from_next, Data(next + 10, n));
  EXPECT_EQ(from_self, c);
  EXPECT_EQ(none, std::vector<int>(n, -1));

  std::vector<int> longer(n + 1);
  ASSERT_EQ(NeighborExchange({{longer.data(), n + 1, MPI_INT, rank_, 4}},
                             {{a.data(), n, MPI_INT, rank_, 4}}, MPI_COMM_WORLD, &failed),
            kWrongSize);
  EXPECT_EQ(failed, 0);
}

// Started messages outlive the call that started them, in the Pending table
// under their id, until one Take completes them.
TEST_P(MpiCalls, PostedMessagesFinishLater) {
  const int64_t n = Count();
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Pending p;
  p.comm = MPI_COMM_WORLD;
  p.buffers = {std::vector<char>(n * sizeof(int)), std::vector<char>(n * sizeof(int))};
  const auto mine = Data(rank_, n);
  std::memcpy(p.buffers[0].data(), mine.data(), p.buffers[0].size());
  p.sends = {{p.buffers[0].data(), n, MPI_INT, next, 6}};
  p.recvs = {{p.buffers[1].data(), n, MPI_INT, prev, 6}};
  int failed = 0;
  ASSERT_EQ(Post(p.recvs, p.sends, MPI_COMM_WORLD, &p.requests, &failed), MPI_SUCCESS);
  const int32_t id = Keep(std::move(p));
  EXPECT_GT(id, 0);
  EXPECT_LT(id, kDifferentiated);  // and so exact as the float32 the program carries
  const int32_t other = Keep(Pending{});
  EXPECT_NE(other, id);
  EXPECT_TRUE(Take(other | kDifferentiated));  // the mark of a differentiated start
  std::optional<Pending> taken = Take(id);
  ASSERT_TRUE(taken);
  EXPECT_FALSE(Take(id));  // taken once
  EXPECT_EQ(PendingCount(), 0u);
  ASSERT_EQ(Finish(taken->recvs, &taken->requests, &failed), MPI_SUCCESS);
  std::vector<int> got(n);
  std::memcpy(got.data(), taken->buffers[1].data(), taken->buffers[1].size());
  EXPECT_EQ(got, Data(prev, n));
}

// Sends to oneself return before their receive runs (they could never
// complete otherwise: mpijax makes one MPI call at a time), and keep order.
TEST_P(MpiCalls, SendsToSelfBeforeTheirReceives) {
  const int64_t n = Count();
  auto first = Data(rank_, n), second = Data(rank_ + 1, n);
  ASSERT_EQ(Send(first.data(), n, MPI_INT, rank_, 4, MPI_COMM_WORLD), MPI_SUCCESS);
  ASSERT_EQ(Send(second.data(), n, MPI_INT, rank_, 4, MPI_COMM_WORLD), MPI_SUCCESS);
  first.assign(n, -1);  // the message was copied: the buffer is the caller's again
  std::vector<int> out(n, -1);
  ASSERT_EQ(Recv(out.data(), n, MPI_INT, rank_, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE), MPI_SUCCESS);
  EXPECT_EQ(out, Data(rank_, n));
  ASSERT_EQ(Recv(out.data(), n, MPI_INT, MPI_ANY_SOURCE, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            MPI_SUCCESS);
  EXPECT_EQ(out, second);
}

// A receive from anyone passes over derivative messages (tags.h) that came
// first, keeping them for their own receive, in order.
TEST_P(MpiCalls, ReceivesFromAnyoneSetDerivativeMessagesAside) {
  const int64_t n = Count();
  const int derivative = DerivativeTag(4);
  const auto first = Data(rank_, n), second = Data(rank_ + 1, n), value = Data(rank_ + 2, n);
  ASSERT_EQ(Send(first.data(), n, MPI_INT, rank_, derivative, MPI_COMM_WORLD), MPI_SUCCESS);
  ASSERT_EQ(Send(second.data(), n, MPI_INT, rank_, derivative, MPI_COMM_WORLD), MPI_SUCCESS);
  std::vector<int> out(n + 1, -1);
  MPI_Status status;
  ASSERT_EQ(Sendrecv(value.data(), n, MPI_INT, rank_, 4, out.data(), n + 1, MPI_INT, MPI_ANY_SOURCE,
                     MPI_ANY_TAG, MPI_COMM_WORLD, &status),
            MPI_SUCCESS);
  EXPECT_EQ(std::vector<int>(out.begin(), out.begin() + n), value);
  EXPECT_EQ(status.MPI_TAG, 4);
  const auto third = Data(rank_ + 3, n);
  ASSERT_EQ(Send(third.data(), n, MPI_INT, rank_, derivative, MPI_COMM_WORLD), MPI_SUCCESS);
  ASSERT_EQ(Send(value.data(), n, MPI_INT, rank_, 5, MPI_COMM_WORLD), MPI_SUCCESS);
  out.assign(n + 1, -1);
  ASSERT_EQ(Recv(out.data(), n + 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &status),
            MPI_SUCCESS);
  EXPECT_EQ(std::vector<int>(out.begin(), out.begin() + n), value);
  EXPECT_EQ(status.MPI_TAG, 5);
  std::vector<char> kept;
  for (const auto* expected : {&first, &second, &third}) {
    ASSERT_TRUE(TakeAside(rank_, derivative, MPI_COMM_WORLD, &kept, &status));
    EXPECT_EQ(status.MPI_TAG, derivative);
    EXPECT_EQ(status.MPI_SOURCE, rank_);
    ASSERT_EQ(kept.size(), n * sizeof(int));
    EXPECT_EQ(std::memcmp(kept.data(), expected->data(), kept.size()), 0);
  }
  EXPECT_FALSE(TakeAside(rank_, derivative, MPI_COMM_WORLD, &kept, &status));
}

INSTANTIATE_TEST_SUITE_P(Counts, MpiCalls,
                         ::testing::Combine(::testing::Values(0, 2, 3, 6, 10), ::testing::Bool()));

TEST(Block, DescribesLargeCountsWithOneDerivedType) {
  SetCountLimit(4);
  {
    Block small(4, MPI_DOUBLE);
    EXPECT_EQ(small.count(), 4);
    EXPECT_EQ(small.type(), MPI_DOUBLE);
    Block large(11, MPI_DOUBLE);
    ASSERT_EQ(large.error(), MPI_SUCCESS);
    EXPECT_EQ(large.count(), 1);
    int size;
    MPI_Aint lb, extent;
    MPI_Type_size(large.type(), &size);
    MPI_Type_get_extent(large.type(), &lb, &extent);
    EXPECT_EQ(size, 11 * 8);
    EXPECT_EQ(extent, 11 * 8);
    EXPECT_EQ(lb, 0);
    Block exact(8, MPI_DOUBLE);  // a multiple of the limit: empty tail
    MPI_Type_size(exact.type(), &size);
    EXPECT_EQ(size, 8 * 8);
  }
  SetCountLimit(INT_MAX);
  EXPECT_EQ(CountLimit(), INT_MAX);
}

TEST(SelfSends, LargerThanAnyEagerLimit) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<double> message(4 << 20), out(4 << 20, 0.0);  // 32 MiB
  std::iota(message.begin(), message.end(), 0.5);
  ASSERT_EQ(Send(message.data(), message.size(), MPI_DOUBLE, rank, 0, MPI_COMM_WORLD), MPI_SUCCESS);
  ASSERT_EQ(Recv(out.data(), out.size(), MPI_DOUBLE, rank, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            MPI_SUCCESS);
  EXPECT_EQ(out, message);
}

TEST(Errors, NullTypeAndOpAreReportedNotPassedOn) {
  int x = 1, y = 0;
  EXPECT_EQ(Allreduce(&x, &y, 1, MPI_DATATYPE_NULL, MPI_SUM, MPI_COMM_WORLD), MPI_ERR_TYPE);
  EXPECT_EQ(Allreduce(&x, &y, 1, MPI_INT, MPI_OP_NULL, MPI_COMM_WORLD), MPI_ERR_OP);
  EXPECT_EQ(Bcast(&x, 1, MPI_DATATYPE_NULL, 0, MPI_COMM_WORLD), MPI_ERR_TYPE);
}

TEST(Errors, OverrunningSelfMessageIsTruncationNotSilence) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<double> send(8, 1.0), recv(4, 0.0);
  EXPECT_EQ(Sendrecv(send.data(), 8, MPI_DOUBLE, rank, 0, recv.data(), 4, MPI_DOUBLE, rank, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            MPI_ERR_TRUNCATE);
  EXPECT_EQ(recv, std::vector<double>(4, 0.0));
}

}  // namespace
}  // namespace mpijax::mpi
