#include "mpi_calls.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "tags.h"

namespace mpijax::mpi {
namespace {

std::atomic<int64_t> count_limit{INT_MAX};
std::atomic<double> timeout{0.0};

// Polls `n` requests until all complete or the timeout passes, filling
// `statuses` (n of them). On timeout, point-to-point requests are let go:
// the first `receives` of them (receives) cancelled, the others (sends)
// freed, which may still complete; *pending (if given) is then the first
// that had not completed.
int AwaitAll(int n, MPI_Request* requests, MPI_Status* statuses, int receives, bool point_to_point,
             int* pending = nullptr) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(Timeout());
  int done = 0;
  while (true) {
    const int rc = MPI_Testall(n, requests, &done, statuses);
    if (rc == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < n; ++i) {
        const int e = statuses[i].MPI_ERROR;
        if (e != MPI_SUCCESS && e != MPI_ERR_PENDING) return e;
      }
    }
    if (rc) return rc;
    if (done) return MPI_SUCCESS;
    if (Clock::now() > deadline) {
      for (int i = 0; point_to_point && i < n; ++i) {
        if (requests[i] == MPI_REQUEST_NULL) continue;
        int complete = 0;
        MPI_Request_get_status(requests[i], &complete, MPI_STATUS_IGNORE);
        if (pending && *pending < 0 && !complete) *pending = i;
        if (i < receives) MPI_Cancel(&requests[i]);
        MPI_Request_free(&requests[i]);
      }
      return kTimedOut;
    }
    std::this_thread::yield();  // ranks may share cores
  }
}

// AwaitAll of a receive (first, whose status it fills) and a send.
int Await(MPI_Request (&requests)[2], bool point_to_point, MPI_Status* status) {
  MPI_Status statuses[2];
  const int rc = AwaitAll(2, requests, statuses, 1, point_to_point);
  if (rc == MPI_SUCCESS && status != MPI_STATUS_IGNORE) *status = statuses[0];
  return rc;
}

// Runs `blocking()`, or with a timeout `start(requests)` and Await.
template <class Blocking, class Start>
int Complete(Blocking blocking, Start start, bool point_to_point = false,
             MPI_Status* status = MPI_STATUS_IGNORE) {
  if (Timeout() <= 0) return blocking();
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  if (int rc = start(requests)) return rc;
  return Await(requests, point_to_point, status);
}

// Calls `call(src, dst, n)` on consecutive chunks of at most CountLimit()
// elements, at least once so that zero-size reductions still take part.
// in == out (and non-empty) means in place.
template <class Call>
int Chunked(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op, Call call) {
  if (type == MPI_DATATYPE_NULL) return MPI_ERR_TYPE;
  if (op == MPI_OP_NULL) return MPI_ERR_OP;
  MPI_Aint lb, extent;
  if (int rc = MPI_Type_get_extent(type, &lb, &extent)) return rc;
  const bool in_place = in == out && count > 0;
  const int64_t limit = CountLimit();
  int64_t done = 0;
  do {
    const int n = static_cast<int>(std::min(limit, count - done));
    const void* src = in_place ? MPI_IN_PLACE : static_cast<const char*>(in) + done * extent;
    void* dst = out ? static_cast<char*>(out) + done * extent : nullptr;
    if (int rc = call(src, dst, n)) return rc;
    done += n;
  } while (done < count);
  return MPI_SUCCESS;
}

}  // namespace

int64_t CountLimit() { return count_limit.load(std::memory_order_relaxed); }

void SetCountLimit(int64_t limit) {
  count_limit.store(std::clamp<int64_t>(limit, 1, INT_MAX), std::memory_order_relaxed);
}

double Timeout() { return timeout.load(std::memory_order_relaxed); }
void SetTimeout(double seconds) {
  timeout.store(std::max(seconds, 0.0), std::memory_order_relaxed);
}

Block::Block(int64_t count, MPI_Datatype element) {
  if (element == MPI_DATATYPE_NULL) {
    error_ = MPI_ERR_TYPE;
    return;
  }
  const int64_t limit = CountLimit();
  if (count <= limit) {
    count_ = static_cast<int>(count);
    type_ = element;
    return;
  }
  // count = chunks * limit + rest, laid out as struct {chunks x [limit], [rest]},
  // resized so that consecutive blocks (gather, alltoall) sit count elements apart.
  const int64_t chunks = count / limit;
  const int64_t rest = count % limit;
  if (chunks > INT_MAX) {
    error_ = MPI_ERR_COUNT;
    return;
  }
  MPI_Aint lb, extent;
  MPI_Datatype chunk = MPI_DATATYPE_NULL, body = MPI_DATATYPE_NULL, tail = MPI_DATATYPE_NULL;
  MPI_Datatype whole = MPI_DATATYPE_NULL;
  int rc = MPI_Type_get_extent(element, &lb, &extent);
  if (!rc) rc = MPI_Type_contiguous(static_cast<int>(limit), element, &chunk);
  if (!rc) rc = MPI_Type_contiguous(static_cast<int>(chunks), chunk, &body);
  if (!rc) rc = MPI_Type_contiguous(static_cast<int>(rest), element, &tail);
  if (!rc) {
    int lengths[2] = {1, 1};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(chunks * limit * extent)};
    MPI_Datatype types[2] = {body, tail};
    rc = MPI_Type_create_struct(2, lengths, displacements, types, &whole);
  }
  if (!rc) rc = MPI_Type_create_resized(whole, 0, static_cast<MPI_Aint>(count * extent), &type_);
  if (!rc) rc = MPI_Type_commit(&type_);
  for (MPI_Datatype* t : {&chunk, &body, &tail, &whole}) {
    if (*t != MPI_DATATYPE_NULL) MPI_Type_free(t);
  }
  error_ = rc;
  owned_ = type_ != MPI_DATATYPE_NULL;
  count_ = 1;
}

Block::~Block() {
  if (owned_) MPI_Type_free(&type_);
}

namespace {

// Sends to oneself. mpijax runs one MPI call at a time per process, so a
// blocking send to oneself could only complete if MPI buffered it (Open MPI
// does for small messages, MPICH never does). Such a send is copied and
// started nonblocking instead, and completes when its receive runs.
struct SelfSend {
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<char> data;
};
std::mutex self_sends_mutex;
std::vector<SelfSend> self_sends;

// Lets go of the self-sends that have completed. Holds the lock.
int ReapSelfSends() {
  for (auto it = self_sends.begin(); it != self_sends.end();) {
    int done = 0;
    if (int rc = MPI_Test(&it->request, &done, MPI_STATUS_IGNORE)) return rc;
    it = done ? self_sends.erase(it) : it + 1;
  }
  return MPI_SUCCESS;
}

int SendToSelf(const void* buf, const Block& b, int rank, int tag, MPI_Comm comm) {
  MPI_Aint lb, extent;
  if (int rc = MPI_Type_get_extent(b.type(), &lb, &extent)) return rc;
  std::lock_guard<std::mutex> lock(self_sends_mutex);
  if (int rc = ReapSelfSends()) return rc;
  SelfSend& send = self_sends.emplace_back();
  const char* bytes = static_cast<const char*>(buf);
  send.data.assign(bytes, bytes + b.count() * extent);
  const int rc = MPI_Isend(send.data.data(), b.count(), b.type(), rank, tag, comm, &send.request);
  if (rc) self_sends.pop_back();
  return rc;
}

}  // namespace

int Send(const void* buf, int64_t count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  int rank;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  if (dest == rank) return SendToSelf(buf, b, rank, tag, comm);
  return Complete(
      [&] { return MPI_Send(buf, b.count(), b.type(), dest, tag, comm); },
      [&](MPI_Request* r) { return MPI_Isend(buf, b.count(), b.type(), dest, tag, comm, r); },
      true);
}

namespace {

struct Message {
  MPI_Comm comm;
  MPI_Status status;
  std::vector<char> data;
};
std::mutex aside_mutex;
std::deque<Message> aside;

// Waits (under the timeout, polling) for the next message from anyone.
int ProbeAnyone(MPI_Comm comm, MPI_Message* message, MPI_Status* status) {
  if (Timeout() <= 0) return MPI_Mprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, message, status);
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(Timeout());
  for (int found = 0;;) {
    if (int rc = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &found, message, status)) return rc;
    if (found) return MPI_SUCCESS;
    if (Clock::now() > deadline) return kTimedOut;
    std::this_thread::yield();
  }
}

// A receive from MPI_ANY_SOURCE with MPI_ANY_TAG (see TakeAside).
int ReceiveFromAnyone(void* buf, const Block& b, MPI_Comm comm, MPI_Status* status) {
  while (true) {
    MPI_Message message;
    MPI_Status probed;
    if (int rc = ProbeAnyone(comm, &message, &probed)) return rc;
    if (!IsDerivativeTag(probed.MPI_TAG))
      return MPI_Mrecv(buf, b.count(), b.type(), &message, status);
    MPI_Count bytes = 0;
    if (int rc = MPI_Get_elements_x(&probed, MPI_BYTE, &bytes)) return rc;
    std::lock_guard<std::mutex> lock(aside_mutex);
    Message& kept =
        aside.emplace_back(Message{comm, {}, std::vector<char>(static_cast<size_t>(bytes))});
    Block whole(bytes, MPI_BYTE);
    if (whole.error()) return whole.error();
    if (int rc = MPI_Mrecv(kept.data.data(), whole.count(), whole.type(), &message, &kept.status)) {
      return rc;
    }
  }
}

bool FromAnyone(int source, int tag) { return source == MPI_ANY_SOURCE && tag == MPI_ANY_TAG; }

}  // namespace

bool TakeAside(int source, int tag, MPI_Comm comm, std::vector<char>* data, MPI_Status* status) {
  if (!IsDerivativeTag(tag)) return false;
  std::lock_guard<std::mutex> lock(aside_mutex);
  for (auto it = aside.begin(); it != aside.end(); ++it) {
    if (it->comm == comm && it->status.MPI_SOURCE == source && it->status.MPI_TAG == tag) {
      *data = std::move(it->data);
      *status = it->status;
      aside.erase(it);
      return true;
    }
  }
  return false;
}

int Recv(void* buf, int64_t count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
         MPI_Status* status) {
  Block b(count, type);
  if (b.error()) return b.error();
  const int rc =
      FromAnyone(source, tag)
          ? ReceiveFromAnyone(buf, b, comm, status)
          : Complete([&] { return MPI_Recv(buf, b.count(), b.type(), source, tag, comm, status); },
                     [&](MPI_Request* r) {
                       return MPI_Irecv(buf, b.count(), b.type(), source, tag, comm, r);
                     },
                     true, status);
  if (rc) return rc;
  std::lock_guard<std::mutex> lock(self_sends_mutex);
  return self_sends.empty() ? MPI_SUCCESS : ReapSelfSends();
}

int Sendrecv(const void* send, int64_t send_count, MPI_Datatype send_type, int dest, int send_tag,
             void* recv, int64_t recv_count, MPI_Datatype recv_type, int source, int recv_tag,
             MPI_Comm comm, MPI_Status* status) {
  Block s(send_count, send_type), r(recv_count, recv_type);
  if (s.error()) return s.error();
  if (r.error()) return r.error();
  // Open MPI 4.1 silently truncates a message to self that overruns the
  // receive posted for it (and corrupts memory when it is large); both sizes
  // are known here, so report the truncation instead of sending.
  int rank, send_size, recv_size;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  if (dest == rank && source == rank) {
    if (int rc = MPI_Type_size(send_type, &send_size)) return rc;
    if (int rc = MPI_Type_size(recv_type, &recv_size)) return rc;
    if (send_count * send_size > recv_count * recv_size) return MPI_ERR_TRUNCATE;
  }
  if (FromAnyone(source, recv_tag)) {
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (int rc = MPI_Isend(send, s.count(), s.type(), dest, send_tag, comm, &requests[1]))
      return rc;
    if (int rc = ReceiveFromAnyone(recv, r, comm, status)) {
      MPI_Request_free(&requests[1]);
      return rc;
    }
    return Timeout() <= 0 ? MPI_Wait(&requests[1], MPI_STATUS_IGNORE)
                          : Await(requests, true, MPI_STATUS_IGNORE);
  }
  return Complete(
      [&] {
        return MPI_Sendrecv(send, s.count(), s.type(), dest, send_tag, recv, r.count(), r.type(),
                            source, recv_tag, comm, status);
      },
      [&](MPI_Request* q) {
        const int rc = MPI_Irecv(recv, r.count(), r.type(), source, recv_tag, comm, &q[0]);
        return rc ? rc : MPI_Isend(send, s.count(), s.type(), dest, send_tag, comm, &q[1]);
      },
      true, status);
}

int Post(const std::vector<Transfer>& recvs, const std::vector<Transfer>& sends, MPI_Comm comm,
         std::vector<MPI_Request>* requests, int* failed) {
  *failed = -1;
  const size_t n_recv = recvs.size();
  requests->assign(n_recv + sends.size(), MPI_REQUEST_NULL);
  int rc = MPI_SUCCESS;
  // A Block's datatype may be freed once its message is posted (MPI lets
  // pending communication finish).
  for (size_t i = 0; i < requests->size() && rc == MPI_SUCCESS; ++i) {
    const Transfer& t = i < n_recv ? recvs[i] : sends[i - n_recv];
    MPI_Request* r = &(*requests)[i];
    const Block b(t.count, t.type);
    rc = b.error()    ? b.error()
         : i < n_recv ? MPI_Irecv(t.data, b.count(), b.type(), t.peer, t.tag, comm, r)
                      : MPI_Isend(t.data, b.count(), b.type(), t.peer, t.tag, comm, r);
    if (rc) *failed = static_cast<int>(i);
  }
  if (rc) {
    for (size_t i = 0; i < requests->size(); ++i) {
      MPI_Request& r = (*requests)[i];
      if (r == MPI_REQUEST_NULL) continue;
      if (i < n_recv) MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  }
  return rc;
}

int Finish(const std::vector<Transfer>& recvs, std::vector<MPI_Request>* requests, int* failed) {
  *failed = -1;
  const int n_recv = static_cast<int>(recvs.size());
  const int n = static_cast<int>(requests->size());
  std::vector<MPI_Status> statuses(requests->size());
  // Libraries set a status's error only for a request that failed.
  for (MPI_Status& s : statuses) s.MPI_ERROR = MPI_SUCCESS;
  int rc = Timeout() <= 0 ? MPI_Waitall(n, requests->data(), statuses.data())
                          : AwaitAll(n, requests->data(), statuses.data(), n_recv, true, failed);
  for (int i = 0; rc && rc != kTimedOut && i < n; ++i) {
    const int e = statuses[i].MPI_ERROR;
    if (e != MPI_SUCCESS && e != MPI_ERR_PENDING) {
      *failed = i;
      return e;
    }
  }
  if (rc) return rc;
  for (int i = 0; i < n_recv; ++i) {
    if (recvs[i].peer == MPI_PROC_NULL) continue;
    MPI_Count received = 0;
    int element = 0;
    if ((rc = MPI_Get_elements_x(&statuses[i], MPI_BYTE, &received))) return rc;
    if ((rc = MPI_Type_size(recvs[i].type, &element))) return rc;
    if (received != recvs[i].count * element) {
      *failed = i;
      return kWrongSize;
    }
  }
  return MPI_SUCCESS;
}

int NeighborExchange(const std::vector<Transfer>& recvs, const std::vector<Transfer>& sends,
                     MPI_Comm comm, int* failed) {
  std::vector<MPI_Request> requests;
  if (int rc = Post(recvs, sends, comm, &requests, failed)) return rc;
  return Finish(recvs, &requests, failed);
}

int Barrier(MPI_Comm comm) {
  return Complete([&] { return MPI_Barrier(comm); },
                  [&](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
}

int Bcast(void* buf, int64_t count, MPI_Datatype type, int root, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  return Complete(
      [&] { return MPI_Bcast(buf, b.count(), b.type(), root, comm); },
      [&](MPI_Request* r) { return MPI_Ibcast(buf, b.count(), b.type(), root, comm, r); });
}

int Gather(const void* in, void* out, int64_t count, MPI_Datatype type, int root, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  return Complete(
      [&] { return MPI_Gather(in, b.count(), b.type(), out, b.count(), b.type(), root, comm); },
      [&](MPI_Request* r) {
        return MPI_Igather(in, b.count(), b.type(), out, b.count(), b.type(), root, comm, r);
      });
}

int Scatter(const void* in, void* out, int64_t count, MPI_Datatype type, int root, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  return Complete(
      [&] { return MPI_Scatter(in, b.count(), b.type(), out, b.count(), b.type(), root, comm); },
      [&](MPI_Request* r) {
        return MPI_Iscatter(in, b.count(), b.type(), out, b.count(), b.type(), root, comm, r);
      });
}

int Allgather(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  return Complete(
      [&] { return MPI_Allgather(in, b.count(), b.type(), out, b.count(), b.type(), comm); },
      [&](MPI_Request* r) {
        return MPI_Iallgather(in, b.count(), b.type(), out, b.count(), b.type(), comm, r);
      });
}

int Alltoall(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Comm comm) {
  Block b(count, type);
  if (b.error()) return b.error();
  return Complete(
      [&] { return MPI_Alltoall(in, b.count(), b.type(), out, b.count(), b.type(), comm); },
      [&](MPI_Request* r) {
        return MPI_Ialltoall(in, b.count(), b.type(), out, b.count(), b.type(), comm, r);
      });
}

namespace {

// Where each rank's block of a buffer starts: the sum of the counts before it.
Counts Offsets(const Counts& counts) {
  Counts offsets(counts.size());
  int64_t offset = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    offsets[i] = offset;
    offset += counts[i];
  }
  return offsets;
}

// `count` elements for rank `peer` alone (or for every rank: peer < 0), each
// at offset 0: the one block a rank sends or receives in gatherv and friends.
Counts OnlyTo(int peer, int64_t count, int size) {
  Counts counts(static_cast<size_t>(size), peer < 0 ? count : 0);
  if (peer >= 0) counts[static_cast<size_t>(peer)] = count;
  return counts;
}

// Counts and displacements as the int arrays of the v-collectives, when every
// one fits under CountLimit().
struct IntLayout {
  std::vector<int> counts, displacements;
  bool fits = true;

  explicit IntLayout(const Counts& elements) {
    const Counts offsets = Offsets(elements);
    const int64_t limit = CountLimit();
    counts.reserve(elements.size());
    displacements.reserve(elements.size());
    for (size_t i = 0; i < elements.size(); ++i) {
      fits = fits && elements[i] <= limit && offsets[i] <= limit;
      counts.push_back(fits ? static_cast<int>(elements[i]) : 0);
      displacements.push_back(fits ? static_cast<int>(offsets[i]) : 0);
    }
  }
};

// One block per rank for MPI_Alltoallw, whose displacements are int bytes:
// `count` elements at a byte displacement where both fit, else one datatype
// that places the block at its 64-bit offset. Each rank chooses for itself:
// either way a block's type signature is its count of elements.
class Placed {
 public:
  Placed(const Counts& counts, const Counts& offsets, MPI_Datatype element) {
    MPI_Aint lb, extent;
    error_ = MPI_Type_get_extent(element, &lb, &extent);
    const int64_t limit = CountLimit();
    counts_.reserve(counts.size());
    displacements_.reserve(counts.size());
    types_.reserve(counts.size());
    for (size_t i = 0; i < counts.size() && !error_; ++i) {
      const int64_t bytes = offsets[i] * extent;
      if (counts[i] <= limit && offsets[i] <= limit && bytes <= INT_MAX) {
        counts_.push_back(static_cast<int>(counts[i]));
        displacements_.push_back(static_cast<int>(bytes));
        types_.push_back(element);
        continue;
      }
      Block block(counts[i], element);
      int length = block.count();
      MPI_Aint at = static_cast<MPI_Aint>(bytes);
      MPI_Datatype inner = block.type(), type = MPI_DATATYPE_NULL;
      error_ = block.error();
      if (!error_) error_ = MPI_Type_create_struct(1, &length, &at, &inner, &type);
      if (!error_) error_ = MPI_Type_commit(&type);
      if (!error_) owned_.push_back(type);
      counts_.push_back(1);
      displacements_.push_back(0);
      types_.push_back(type);
    }
  }
  ~Placed() {
    for (MPI_Datatype& t : owned_) MPI_Type_free(&t);
  }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;

  int error() const { return error_; }
  bool derived() const { return !owned_.empty(); }
  const int* counts() const { return counts_.data(); }
  const int* displacements() const { return displacements_.data(); }
  const MPI_Datatype* types() const { return types_.data(); }

 private:
  std::vector<int> counts_, displacements_;
  std::vector<MPI_Datatype> types_, owned_;
  int error_ = MPI_SUCCESS;
};

// Open MPI's nonblocking all-to-alls (libnbc) take a send buffer at the
// receive buffer's address for MPI_IN_PLACE, which sends from the receive
// buffer by the receive counts; XLA may place an empty buffer at another's
// address (found by a tester: a rank that receives nothing sent nothing, and
// its peer waited). An empty buffer moves nothing, at any address of its own.
void Separate(const void*& in, void*& out, const Counts& send_counts) {
  static char elsewhere;
  if (in != out) return;
  if (std::all_of(send_counts.begin(), send_counts.end(), [](int64_t n) { return n == 0; })) {
    in = &elsewhere;
  } else {
    out = &elsewhere;
  }
}

// Any v-collective as one MPI_Alltoallw: `send_counts[i]` elements at
// `send_offsets[i]` of `in` go to rank i, and so on for the receive.
int Exchange(const void* in, const Counts& send_counts, const Counts& send_offsets, void* out,
             const Counts& recv_counts, const Counts& recv_offsets, MPI_Datatype type,
             MPI_Comm comm) {
  Separate(in, out, send_counts);
  const Placed s(send_counts, send_offsets, type), r(recv_counts, recv_offsets, type);
  if (s.error()) return s.error();
  if (r.error()) return r.error();
  const auto blocking = [&] {
    return MPI_Alltoallw(in, s.counts(), s.displacements(), s.types(), out, r.counts(),
                         r.displacements(), r.types(), comm);
  };
  // Open MPI 4.1's MPI_Ialltoallw never completed here on blocks described by
  // derived datatypes (past the count limit), so the watchdog leaves such an
  // exchange to the blocking call, once every rank knows that one needs it.
  int derived = s.derived() || r.derived();
  if (Timeout() > 0) {
    if (int rc = Allreduce(&derived, &derived, 1, MPI_INT, MPI_LOR, comm)) return rc;
  }
  if (derived) return blocking();
  return Complete(blocking, [&](MPI_Request* q) {
    return MPI_Ialltoallw(in, s.counts(), s.displacements(), s.types(), out, r.counts(),
                          r.displacements(), r.types(), comm, q);
  });
}

int RankAndSize(MPI_Comm comm, int* rank, int* size) {
  if (int rc = MPI_Comm_rank(comm, rank)) return rc;
  return MPI_Comm_size(comm, size);
}

// Where allgatherv, gatherv and scatterv start: this rank's count, and the
// int layout of the counts, which every rank shares (and so decides alike).
struct Shared {
  int error = MPI_SUCCESS, rank = 0, size = 0;
  int64_t mine = 0;
  IntLayout all;

  Shared(const Counts& counts, MPI_Datatype type, MPI_Comm comm) : all(counts) {
    error = type == MPI_DATATYPE_NULL ? MPI_ERR_TYPE : RankAndSize(comm, &rank, &size);
    if (!error) mine = counts[static_cast<size_t>(rank)];
  }
  int n() const { return all.counts[static_cast<size_t>(rank)]; }
};

// Gatherv (gather) and Scatterv past the int limits, as one Exchange: the
// root's side is every rank's block at its offset, each other rank's side is
// its own block, to or from the root.
int RootedExchange(const void* in, void* out, const Counts& counts, const Shared& v, int root,
                   bool gather, MPI_Datatype type, MPI_Comm comm) {
  const Counts none(counts.size());
  const Counts own = OnlyTo(root, v.mine, v.size);
  const bool root_here = v.rank == root;
  const Counts& blocks = root_here ? counts : none;
  const Counts offsets = root_here ? Offsets(counts) : none;
  return gather ? Exchange(in, own, none, out, blocks, offsets, type, comm)
                : Exchange(in, blocks, offsets, out, own, none, type, comm);
}

}  // namespace

int Allgatherv(const void* in, void* out, const Counts& counts, MPI_Datatype type, MPI_Comm comm) {
  const Shared v(counts, type, comm);
  if (v.error) return v.error;
  if (!v.all.fits) {
    return Exchange(in, OnlyTo(-1, v.mine, v.size), Counts(counts.size()), out, counts,
                    Offsets(counts), type, comm);
  }
  return Complete(
      [&] {
        return MPI_Allgatherv(in, v.n(), type, out, v.all.counts.data(), v.all.displacements.data(),
                              type, comm);
      },
      [&](MPI_Request* r) {
        return MPI_Iallgatherv(in, v.n(), type, out, v.all.counts.data(),
                               v.all.displacements.data(), type, comm, r);
      });
}

int Gatherv(const void* in, void* out, const Counts& counts, MPI_Datatype type, int root,
            MPI_Comm comm) {
  const Shared v(counts, type, comm);
  if (v.error) return v.error;
  if (!v.all.fits) return RootedExchange(in, out, counts, v, root, true, type, comm);
  return Complete(
      [&] {
        return MPI_Gatherv(in, v.n(), type, out, v.all.counts.data(), v.all.displacements.data(),
                           type, root, comm);
      },
      [&](MPI_Request* r) {
        return MPI_Igatherv(in, v.n(), type, out, v.all.counts.data(), v.all.displacements.data(),
                            type, root, comm, r);
      });
}

int Scatterv(const void* in, void* out, const Counts& counts, MPI_Datatype type, int root,
             MPI_Comm comm) {
  const Shared v(counts, type, comm);
  if (v.error) return v.error;
  if (!v.all.fits) return RootedExchange(in, out, counts, v, root, false, type, comm);
  return Complete(
      [&] {
        return MPI_Scatterv(in, v.all.counts.data(), v.all.displacements.data(), type, out, v.n(),
                            type, root, comm);
      },
      [&](MPI_Request* r) {
        return MPI_Iscatterv(in, v.all.counts.data(), v.all.displacements.data(), type, out, v.n(),
                             type, root, comm, r);
      });
}

int Alltoallv(const void* in, const Counts& send_counts, void* out, const Counts& recv_counts,
              MPI_Datatype type, MPI_Comm comm, bool int_counts) {
  if (type == MPI_DATATYPE_NULL) return MPI_ERR_TYPE;
  if (!int_counts) {
    return Exchange(in, send_counts, Offsets(send_counts), out, recv_counts, Offsets(recv_counts),
                    type, comm);
  }
  const IntLayout s(send_counts), r(recv_counts);
  Separate(in, out, send_counts);
  return Complete(
      [&] {
        return MPI_Alltoallv(in, s.counts.data(), s.displacements.data(), type, out,
                             r.counts.data(), r.displacements.data(), type, comm);
      },
      [&](MPI_Request* q) {
        return MPI_Ialltoallv(in, s.counts.data(), s.displacements.data(), type, out,
                              r.counts.data(), r.displacements.data(), type, comm, q);
      });
}

int Allreduce(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op,
              MPI_Comm comm) {
  return Chunked(in, out, count, type, op, [&](const void* src, void* dst, int n) {
    return Complete([&] { return MPI_Allreduce(src, dst, n, type, op, comm); },
                    [&](MPI_Request* r) { return MPI_Iallreduce(src, dst, n, type, op, comm, r); });
  });
}

int Reduce(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op, int root,
           MPI_Comm comm) {
  int rank;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  std::vector<char> copy;
  if (ReduceCopiesInput(rank, root) && in == out && count > 0 && type != MPI_DATATYPE_NULL) {
    MPI_Aint lb, extent;
    if (int rc = MPI_Type_get_extent(type, &lb, &extent)) return rc;
    const char* bytes = static_cast<const char*>(in);
    copy.assign(bytes, bytes + count * extent);
    in = copy.data();
  }
  return Chunked(
      in, rank == root ? out : nullptr, count, type, op, [&](const void* src, void* dst, int n) {
        return Complete(
            [&] { return MPI_Reduce(src, dst, n, type, op, root, comm); },
            [&](MPI_Request* r) { return MPI_Ireduce(src, dst, n, type, op, root, comm, r); });
      });
}

int ReduceScatter(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm) {
  if (type == MPI_DATATYPE_NULL) return MPI_ERR_TYPE;
  if (op == MPI_OP_NULL) return MPI_ERR_OP;
  if (count <= CountLimit()) {
    const int n = static_cast<int>(count);
    return Complete(
        [&] { return MPI_Reduce_scatter_block(in, out, n, type, op, comm); },
        [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(in, out, n, type, op, comm, r); });
  }
  int rank, size;
  if (int rc = RankAndSize(comm, &rank, &size)) return rc;
  MPI_Aint lb, extent;
  if (int rc = MPI_Type_get_extent(type, &lb, &extent)) return rc;
  for (int root = 0; root < size; ++root) {
    const char* block = static_cast<const char*>(in) + root * count * extent;
    if (int rc = Reduce(block, out, count, type, op, root, comm)) return rc;
  }
  return MPI_SUCCESS;
}

int Scan(const void* in, void* out, int64_t count, MPI_Datatype type, MPI_Op op, bool exclusive,
         MPI_Comm comm) {
  return Chunked(in, out, count, type, op, [&](const void* src, void* dst, int n) {
    return Complete(
        [&] {
          return exclusive ? MPI_Exscan(src, dst, n, type, op, comm)
                           : MPI_Scan(src, dst, n, type, op, comm);
        },
        [&](MPI_Request* r) {
          return exclusive ? MPI_Iexscan(src, dst, n, type, op, comm, r)
                           : MPI_Iscan(src, dst, n, type, op, comm, r);
        });
  });
}

}  // namespace mpijax::mpi
