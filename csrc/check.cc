#include "check.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mpi_calls.h"
#include "reductions.h"
#include "tags.h"

namespace mpijax {
namespace {

std::atomic<bool> enabled{false};

// What a rank is about to do, as it travels between ranks: fixed size, and
// zeroed through so that equal signatures compare equal byte for byte.
struct Signature {
  char op[24];
  char dtype[16];
  int32_t root, reduction, tag, ndim;
  int64_t dims[Shape::kMaxDims];
};

Signature Sign(const char* op, const char* dtype, const Shape& shape, int root, int reduction,
               int tag) {
  Signature s;
  std::memset(&s, 0, sizeof s);
  std::strncpy(s.op, op, sizeof s.op - 1);
  std::strncpy(s.dtype, dtype, sizeof s.dtype - 1);
  s.root = root;
  s.reduction = reduction;
  s.tag = tag;
  s.ndim = shape.ndim;
  std::copy(shape.dims, shape.dims + Shape::kMaxDims, s.dims);
  return s;
}

bool Same(const Signature& a, const Signature& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// A v-collective's leading dimension, which differs between ranks.
constexpr int64_t kVaries = -1;

std::string Array(const Signature& s) {
  std::string text = std::string(s.dtype) + "[";
  for (int i = 0; i < std::min(s.ndim, Shape::kMaxDims); ++i) {
    text += (i ? ", " : "") + (s.dims[i] == kVaries ? "*" : std::to_string(s.dims[i]));
  }
  return text + "]";
}

std::string Collective(const Signature& s) {
  std::string text = s.op;
  if (s.reduction != kUnset) text += "(" + ReductionLabel(s.reduction) + ")";
  if (std::strcmp(s.dtype, "-") != 0) text += " of " + Array(s);  // a barrier moves no data
  if (s.root != kUnset) text += " with root " + std::to_string(s.root);
  return text;
}

// The ranks grouped by what they did: "ranks 0, 2 <what(0)>; rank 1 <what(1)>",
// with what(r) = " called allreduce(SUM) of float32[4]", say.
template <class T, class Same, class What>
std::string Tally(const std::vector<T>& all, Same same, What what) {
  std::string text;
  std::vector<bool> listed(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    if (listed[r]) continue;
    std::string ranks;
    int n = 0;
    for (size_t q = r; q < all.size(); ++q) {
      if (listed[q] || !same(all[q], all[r])) continue;
      listed[q] = true;
      ranks += (n++ ? ", " : "") + std::to_string(q);
    }
    text +=
        (text.empty() ? "" : "; ") + std::string(n > 1 ? "ranks " : "rank ") + ranks + what(all[r]);
  }
  return text;
}

std::string List(const int64_t* values, size_t n) {
  std::string text = "[";
  for (size_t i = 0; i < n; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// The v-collectives' counts: every rank's row of `counts` (and of
// recv_counts, for alltoallv), gathered, judged alike on every rank.
int AgreeCounts(const CallInfo& call, MPI_Comm comm, std::string* mismatch) {
  const auto n = static_cast<size_t>(call.num_counts);
  std::vector<int64_t> sends(n * n), receives(n * n);
  if (int rc = mpi::Allgather(call.counts, sends.data(), call.num_counts, MPI_INT64_T, comm)) {
    return rc;
  }
  const std::string prefix =
      "mpijax check mode: the ranks disagree on the counts of " + std::string(call.op) + ": ";
  if (!call.recv_counts) {
    std::vector<std::string> rows;
    for (size_t r = 0; r < n; ++r) rows.push_back(List(&sends[r * n], n));
    if (std::any_of(rows.begin(), rows.end(), [&](const std::string& s) { return s != rows[0]; })) {
      *mismatch = prefix + Tally(rows, std::equal_to<>(),
                                 [](const std::string& s) { return " passed counts " + s; });
    }
    return MPI_SUCCESS;
  }
  if (int rc =
          mpi::Allgather(call.recv_counts, receives.data(), call.num_counts, MPI_INT64_T, comm)) {
    return rc;
  }
  std::string text;
  for (size_t from = 0; from < n; ++from) {
    for (size_t to = 0; to < n; ++to) {
      const int64_t sent = sends[from * n + to], expected = receives[to * n + from];
      if (sent == expected) continue;
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(from) + " sends " +
              std::to_string(sent) + " rows to rank " + std::to_string(to) + ", which expects " +
              std::to_string(expected);
    }
  }
  if (!text.empty()) *mismatch = prefix + text;
  return MPI_SUCCESS;
}

int AgreeCollective(const CallInfo& call, MPI_Comm comm, std::string* mismatch) {
  int size;
  if (int rc = MPI_Comm_size(comm, &size)) return rc;
  Signature mine = Sign(call.op, call.dtype, call.shape, call.root, call.reduction, kUnset);
  if (call.counts) mine.dims[0] = kVaries;
  if (call.ragged_axis >= 0 && call.ragged_axis < Shape::kMaxDims) {
    mine.dims[call.ragged_axis] = kVaries;
  }
  std::vector<Signature> all(size);
  if (int rc = mpi::Allgather(&mine, all.data(), sizeof mine, MPI_BYTE, comm)) return rc;
  const bool agree =
      std::all_of(all.begin(), all.end(), [&](const Signature& s) { return Same(s, all[0]); });
  if (!agree) {
    *mismatch = "mpijax check mode: the ranks disagree on a collective call: " +
                Tally(all, Same, [](const Signature& s) { return " called " + Collective(s); });
    return MPI_SUCCESS;
  }
  return call.counts ? AgreeCounts(call, comm, mismatch) : MPI_SUCCESS;
}

// Elements in the array: folding (call.h) keeps the product of the dims.
int64_t Count(const Signature& s) {
  int64_t count = 1;
  for (int i = 0; i < std::min(s.ndim, Shape::kMaxDims); ++i) count *= s.dims[i];
  return count;
}

// A message fits its receive exactly where MPI takes it without error: the
// same dtype, no more elements than the receive buffer holds (whatever their
// shapes; the rest of the buffer is zeroed), and the tag asked for (or any).
bool Fits(const Signature& sent, const Signature& wanted) {
  return std::strcmp(sent.dtype, wanted.dtype) == 0 && Count(sent) <= Count(wanted) &&
         (wanted.tag == MPI_ANY_TAG || wanted.tag == sent.tag);
}

std::string Pair(int sender, const Signature& sent, int receiver, const Signature& wanted) {
  return "rank " + std::to_string(sender) + " sends " + Array(sent) + " with tag " +
         TagName(sent.tag) + " (" + sent.op + "), rank " + std::to_string(receiver) + " expects " +
         Array(wanted) + " with tag " + TagName(wanted.tag) + " (" + wanted.op + ")";
}

// Both directions at once (either may be MPI_PROC_NULL): round one carries
// senders' announcements, round two receivers' answers. A direction that does
// not fit becomes MPI_PROC_NULL on both of its ends, so that the rest of the
// exchange (the other half of a sendrecv) still completes everywhere.
// Messages to oneself are not checked: their receive runs in a later call,
// while a handshake must have both ends at once (and no other rank can
// disagree about them).
int AgreePair(CallInfo& call, MPI_Comm comm, std::string* mismatch) {
  int rank;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  // So a receive from anyone takes a message of values that this rank sent
  // itself, where one waits: no announcement would come for it.
  if (call.source == MPI_ANY_SOURCE) {
    int waiting = 0;
    MPI_Status probed;
    if (int rc = MPI_Iprobe(rank, call.recv_tag, comm, &waiting, &probed)) return rc;
    if (waiting && !IsDerivativeTag(probed.MPI_TAG)) {
      call.source = rank;
      call.recv_tag = probed.MPI_TAG;
    }
  }
  const auto peer = [rank](int p) { return p == kUnset || p == rank ? MPI_PROC_NULL : p; };
  const int dest = peer(call.dest);
  const int source = peer(call.source);
  const Signature outgoing = Sign(call.op, call.dtype, call.shape, kUnset, kUnset, call.send_tag);
  const Signature expected =
      call.recv_dtype
          ? Sign(call.op, call.recv_dtype, call.recv_shape, kUnset, kUnset, call.recv_tag)
          : Sign(call.op, call.dtype, call.shape, kUnset, kUnset, call.recv_tag);
  Signature announced{}, answer{};
  MPI_Status status;
  // Derivative calls shake hands under tags of their own, so that a receive
  // of values from MPI_ANY_SOURCE never takes their announcement.
  const bool derivative = IsDerivativeTag(call.send_tag) || IsDerivativeTag(call.recv_tag);
  const int announce = CheckTag(false, derivative), reply = CheckTag(true, derivative);
  if (int rc = mpi::Sendrecv(&outgoing, sizeof outgoing, MPI_BYTE, dest, announce, &announced,
                             sizeof announced, MPI_BYTE, source, announce, comm, &status)) {
    return rc;
  }
  const int sender = source == MPI_PROC_NULL ? MPI_PROC_NULL : status.MPI_SOURCE;
  if (int rc = mpi::Sendrecv(&expected, sizeof expected, MPI_BYTE, sender, reply, &answer,
                             sizeof answer, MPI_BYTE, dest, reply, comm, MPI_STATUS_IGNORE)) {
    return rc;
  }
  std::string text;
  if (sender != MPI_PROC_NULL) {
    call.source = sender;
    call.recv_tag = announced.tag;
    if (!Fits(announced, expected)) {
      text = Pair(sender, announced, rank, expected);
      call.source = MPI_PROC_NULL;
    }
  }
  if (dest != MPI_PROC_NULL && !Fits(outgoing, answer)) {
    text += (text.empty() ? "" : "; ") + Pair(rank, outgoing, dest, answer);
    call.dest = MPI_PROC_NULL;
  }
  if (!text.empty()) *mismatch = "mpijax check mode: a message does not match its receive: " + text;
  return MPI_SUCCESS;
}

}  // namespace

bool CheckEnabled() { return enabled.load(std::memory_order_relaxed); }
void SetCheckEnabled(bool on) { enabled.store(on, std::memory_order_relaxed); }

int Agree(CallInfo& call, MPI_Comm comm, std::string* mismatch) {
  return PointToPoint(call) ? AgreePair(call, comm, mismatch)
                            : AgreeCollective(call, comm, mismatch);
}

}  // namespace mpijax
