// One handler per op, each followed by its MPIJAX_OP: the FFI target, the
// binding of its operands (the ordering token last), results and attributes.
// A handler reads its buffers and attributes and hands one large-count-safe
// MPI call (mpi_calls.h) to Run (run.h), which resolves the communicator,
// agrees on the call with the other ranks in check mode, logs, and turns MPI
// error codes into ffi::Error. One handler body serves every platform: the
// memory policy (memory.h) it is instantiated with decides where MPI sees
// the data.
#include "handlers.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "memory.h"
#include "pending.h"
#include "run.h"
#include "xla/ffi/api/ffi.h"

#if defined(MPIJAX_CUDA) || defined(MPIJAX_CUDA_STAND_IN)
#include "cuda_memory.h"
#endif

namespace ffi = xla::ffi;

namespace mpijax {
namespace {

// Platforms: what XLA hands a handler first (the binding's prefix), and the
// memory policy made of it.
struct Cpu {
#ifdef MPIJAX_CUDA_STAND_IN
  // A test build (CMakeLists.txt): every op's staged path runs on the host.
  using Memory = CudaMemory;
#else
  using Memory = HostMemory;
#endif
  static auto Bind() { return ffi::Ffi::Bind(); }
  template <class Op>
  static auto Entry() {
    return [](auto... args) { return Op::template Call<Memory>(Memory::Context{}, args...); };
  }
};

#ifdef MPIJAX_CUDA
struct Cuda {
  using Memory = CudaMemory;
  static auto Bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
  template <class Op>
  static auto Entry() {
    return [](cudaStream_t stream, auto... args) {
      return Op::template Call<Memory>(stream, args...);
    };
  }
};
#endif

// The XLA_FFI_Handler of `Op` on `Platform`.
template <class Platform, class Op>
XLA_FFI_Error* Handle(XLA_FFI_CallFrame* frame) {
  static auto* handler = Op::template Bind<Platform>().To(Platform::template Entry<Op>()).release();
  return handler->Call(frame);
}

HandlerTable& Table() {
  static HandlerTable table;
  return table;
}

template <class Op>
bool Register(const char* target) {
  Table()["cpu"].emplace_back(target, Handle<Cpu, Op>);
#ifdef MPIJAX_CUDA
  Table()["CUDA"].emplace_back(target, Handle<Cuda, Op>);
#endif
  return true;
}

// Declares op `Name`: its FFI target "mpijax_<target>", its binding on
// platform P (the expression after the target), and its handler, the
// function template `Name<Memory>`. Registered once, at load time.
#define MPIJAX_OP(Name, target, ...)       \
  struct Name##Op {                        \
    template <class P>                     \
    static auto Bind() {                   \
      return __VA_ARGS__;                  \
    }                                      \
    template <class Memory, class... Args> \
    static ffi::Error Call(Args... args) { \
      return Name<Memory>(args...);        \
    }                                      \
  };                                       \
  [[maybe_unused]] const bool k##Name##Registered = Register<Name##Op>("mpijax_" target)

using Out = ffi::Result<ffi::AnyBuffer>;
using TokenOut = ffi::Result<ffi::Token>;
// Rows (along the leading axis) per rank of a v-variant; empty for the plain
// collective, where every rank has the same block.
using Counts = ffi::Span<const int64_t>;

// The binding of an op with one array in and one out.
template <class P>
auto Unary() {
  return P::Bind()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Token>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Attr<int64_t>("comm");
}

// A receive's binding after its data operands: the route and the token in,
// the received array, its envelope and the token out.
template <class Binding>
auto Receiving(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Token>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Attr<int64_t>("comm");
}

// A v-variant's call: named "<name>v", its rows per rank in `info` for check
// mode, which compares them across ranks.
CallInfo DescribeVaried(const char* name, const char* v_name, const ffi::AnyBuffer& x,
                        Counts counts, Counts recv_counts = {}) {
  CallInfo info = Describe(counts.size() == 0 ? name : v_name, x);
  if (counts.size() != 0) {
    info.counts = counts.begin();
    info.recv_counts = recv_counts.size() == 0 ? nullptr : recv_counts.begin();
    info.num_counts = static_cast<int64_t>(counts.size());
  }
  return info;
}

// The element counts of rows per rank.
template <class Rows>
mpi::Counts Elements(const Rows& rows, int64_t row) {
  mpi::Counts elements;
  elements.reserve(rows.size());
  for (int64_t n : rows) elements.push_back(n * row);
  return elements;
}

template <class Memory>
ffi::Error Allreduce(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                     int64_t comm, int64_t op) {
  CallInfo info = Describe("allreduce", x);
  info.reduction = static_cast<int>(op);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    return mpi::Allreduce(m.In(x), m.Out(*y), x.element_count(), TypeOf(x), OpOf(op, x), c.handle);
  });
}

MPIJAX_OP(Allreduce, "allreduce", Unary<P>().template Attr<int64_t>("op"));

// Off the root the output is empty: Python returns x there, as mpi4jax does.
template <class Memory>
ffi::Error Reduce(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                  int64_t comm, int64_t op, int64_t root) {
  CallInfo info = Describe("reduce", x);
  info.root = static_cast<int>(root);
  info.reduction = static_cast<int>(op);
  const auto copies = [&](const Comm& c) { return mpi::ReduceCopiesInput(c.rank, info.root); };
  return Run<Memory>(ctx, info, comm, copies, [&](const Comm& c, Memory& m) {
    void* out = c.rank == info.root ? m.Out(*y) : nullptr;
    return mpi::Reduce(m.In(x), out, x.element_count(), TypeOf(x), OpOf(op, x), info.root,
                       c.handle);
  });
}

MPIJAX_OP(Reduce, "reduce", Unary<P>().template Attr<int64_t>("op").template Attr<int64_t>("root"));

// Rank r gets the reduction of every rank's slice r.
template <class Memory>
ffi::Error ReduceScatter(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y,
                         TokenOut, int64_t comm, int64_t op) {
  CallInfo info = Describe("reduce_scatter", x);
  info.reduction = static_cast<int>(op);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    return mpi::ReduceScatter(m.In(x), m.Out(*y), y->element_count(), TypeOf(x), OpOf(op, x),
                              c.handle);
  });
}

MPIJAX_OP(ReduceScatter, "reduce_scatter", Unary<P>().template Attr<int64_t>("op"));

// reverse: over the ranks in reverse order (suffix scans, the transpose of a
// scan). exclusive: MPI_Exscan, which defines nothing on the first rank: the
// handler writes `identity` (one element's bytes) there, in place, so that a
// loop feeding the result back copies nothing.
template <class Memory>
ffi::Error Scan(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                int64_t comm, int64_t op, int64_t reverse, int64_t exclusive,
                ffi::Span<const uint8_t> identity) {
  static constexpr const char* kNames[2][2] = {{"scan", "exscan"},
                                               {"scan(reverse)", "exscan(reverse)"}};
  CallInfo info = Describe(kNames[reverse != 0][exclusive != 0], x);
  info.reduction = static_cast<int>(op);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    MPI_Comm target = c.handle;
    if (reverse) {
      if (int rc = ReversedComm(c.handle, &target)) return rc;
    }
    void* out = m.Out(*y);
    const int rc =
        mpi::Scan(m.In(x), out, x.element_count(), TypeOf(x), OpOf(op, x), exclusive != 0, target);
    if (rc == MPI_SUCCESS && exclusive && c.rank == (reverse ? c.size - 1 : 0)) {
      Fill(m, out, identity, y->size_bytes());
    }
    return rc;
  });
}

MPIJAX_OP(Scan, "scan",
          Unary<P>()
              .template Attr<int64_t>("op")
              .template Attr<int64_t>("reverse")
              .template Attr<int64_t>("exclusive")
              .template Attr<ffi::Span<const uint8_t>>("identity"));

// The root sends x, and its output is empty: Python returns x there. The
// others receive in place (aliased), over theirs.
template <class Memory>
ffi::Error Bcast(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                 int64_t comm, int64_t root) {
  CallInfo info = Describe("bcast", x);
  info.root = static_cast<int>(root);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    void* buf = c.rank == info.root ? m.In(x) : m.Out(*y);
    return mpi::Bcast(buf, x.element_count(), TypeOf(x), info.root, c.handle);
  });
}

MPIJAX_OP(Bcast, "bcast", Unary<P>().template Attr<int64_t>("root"));

// Off the root the output is empty: Python returns x there, as mpi4jax does.
template <class Memory>
ffi::Error Gather(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                  int64_t comm, int64_t root, Counts counts) {
  CallInfo info = DescribeVaried("gather", "gatherv", x, counts);
  info.root = static_cast<int>(root);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    void* in = m.In(x);
    void* out = c.rank == info.root ? m.Out(*y) : nullptr;
    if (counts.size() != 0) {
      return mpi::Gatherv(in, out, Elements(counts, RowOf(x)), TypeOf(x), info.root, c.handle);
    }
    return mpi::Gather(in, out, x.element_count(), TypeOf(x), info.root, c.handle);
  });
}

MPIJAX_OP(Gather, "gather",
          Unary<P>().template Attr<int64_t>("root").template Attr<Counts>("counts"));

// Off the root x only gives the shape of what is received.
template <class Memory>
ffi::Error Scatter(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                   int64_t comm, int64_t root, Counts counts) {
  CallInfo info = DescribeVaried("scatter", "scatterv", *y, counts);
  info.root = static_cast<int>(root);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    // MPI reads nothing from x off the root.
    const void* in = c.rank == info.root ? m.In(x) : nullptr;
    void* out = m.Out(*y);
    if (counts.size() != 0) {
      return mpi::Scatterv(in, out, Elements(counts, RowOf(*y)), TypeOf(x), info.root, c.handle);
    }
    return mpi::Scatter(in, out, y->element_count(), TypeOf(x), info.root, c.handle);
  });
}

MPIJAX_OP(Scatter, "scatter",
          Unary<P>().template Attr<int64_t>("root").template Attr<Counts>("counts"));

template <class Memory>
ffi::Error Allgather(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                     int64_t comm, Counts counts) {
  CallInfo info = DescribeVaried("allgather", "allgatherv", x, counts);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    if (counts.size() != 0) {
      return mpi::Allgatherv(m.In(x), m.Out(*y), Elements(counts, RowOf(x)), TypeOf(x), c.handle);
    }
    return mpi::Allgather(m.In(x), m.Out(*y), x.element_count(), TypeOf(x), c.handle);
  });
}

MPIJAX_OP(Allgather, "allgather", Unary<P>().template Attr<Counts>("counts"));

template <class Memory>
ffi::Error Alltoall(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                    int64_t comm, Counts send_counts, Counts recv_counts) {
  CallInfo info = DescribeVaried("alltoall", "alltoallv", x, send_counts, recv_counts);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    if (send_counts.size() != 0) {
      const int64_t row = RowOf(x);
      return mpi::Alltoallv(m.In(x), Elements(send_counts, row), m.Out(*y),
                            Elements(recv_counts, row), TypeOf(x), c.handle);
    }
    return mpi::Alltoall(m.In(x), m.Out(*y), x.element_count() / c.size, TypeOf(x), c.handle);
  });
}

MPIJAX_OP(Alltoall, "alltoall",
          Unary<P>().template Attr<Counts>("send_counts").template Attr<Counts>("recv_counts"));

// Their sum, negative ones counted as 0, saturating (a peer's counts can be
// anything).
int64_t Total(const mpi::Counts& counts) {
  int64_t total = 0;
  for (int64_t v : counts) {
    total = v > 0 && v > INT64_MAX - total ? INT64_MAX : total + std::max<int64_t>(v, 0);
  }
  return total;
}

// Rows of x to every rank by counts known only when the call runs (an int32
// or int64 operand, one per rank): the first counts[0] rows to rank 0, the
// next counts[1] to rank 1, and so on; the rows received land packed in rank
// order at the front of y, zeroed past them, and `exchanged` (of counts'
// type) says how many came from each rank. `reverse`, the transpose, sends
// back along the same counts (y's packed rows by `exchanged`, received into
// x's places by `counts`). Axes of counts before its last are a batch (vmap):
// one exchange per element, in order. Once the counts are exchanged, the
// ranks agree (one allreduce) on whether any rank's counts do not fit its
// rows, sent or received, and if so move no rows and all raise: every rank
// then leaves the program at the same call, as one that loops over the call
// needs. They agree too on whether MPI_Alltoallv's ints fit every rank's
// counts and offsets: each rank's larger buffer, times the ranks, bounds them.
template <class Memory>
ffi::Error RaggedAlltoall(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::AnyBuffer counts,
                          ffi::Token, Out y, Out exchanged, TokenOut, int64_t comm,
                          int64_t reverse) {
  CallInfo info = Describe("ragged_alltoall", x);
  const auto cd = counts.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  const size_t k = cd.size() - 1;  // batch axes
  info.ragged_axis = static_cast<int>(k);
  const bool wide = counts.element_type() == ffi::DataType::S64;
  int64_t batch = 1;
  bool valid = (wide || counts.element_type() == ffi::DataType::S32) &&
               exchanged->element_type() == counts.element_type() && cd.size() > 0 &&
               xd.size() > k && yd.size() == xd.size();
  for (size_t a = 0; valid && a < xd.size(); ++a) {
    valid = a == k || xd[a] == yd[a];
    if (a < k) {
      valid = valid && xd[a] == cd[a];
      batch *= cd[a];
    }
  }
  if (!valid) {
    return ffi::Error::InvalidArgument(
        "mpijax.ragged_alltoall: the operands do not fit the counts");
  }
  const int64_t x_rows = xd[k], y_rows = yd[k];
  int64_t row = 1;  // elements
  for (size_t a = k + 1; a < xd.size(); ++a) row *= xd[a];
  const int64_t row_bytes = row * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  // Forward, this rank's counts are what it sends from x and the exchanged
  // ones what it receives into y; reversed, the other way round.
  const int64_t mine_limit = reverse ? y_rows : x_rows, theirs_limit = reverse ? x_rows : y_rows;
  const int64_t largest = std::max(x_rows, y_rows) * row;
  std::string problem;
  const ffi::Error error =
      Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
        const auto n = static_cast<size_t>(c.size);
        if (cd[k] != c.size) {
          problem = "counts has " + std::to_string(cd[k]) + " entries for a communicator of " +
                    std::to_string(c.size) + " ranks";
          return MPI_SUCCESS;
        }
        const size_t total = n * static_cast<size_t>(batch), width = wide ? 8 : 4;
        std::vector<char> raw(total * width);
        m.Copy(raw.data(), m.In(counts), raw.size());
        mpi::Counts all(total), received(total);
        for (size_t i = 0; i < total; ++i) {
          int32_t narrow;
          std::memcpy(wide ? static_cast<void*>(&all[i]) : &narrow, &raw[i * width], width);
          if (!wide) all[i] = narrow;
        }
        for (int64_t b = 0; b < batch; ++b) {
          const mpi::Counts mine(all.begin() + b * c.size, all.begin() + (b + 1) * c.size);
          mpi::Counts theirs(n);
          if (int rc = mpi::Alltoall(mine.data(), theirs.data(), 1, MPI_INT64_T, c.handle))
            return rc;
          // A rank's own counts are at fault first: a peer's then mean
          // nothing (negative ones are counted as none).
          const bool bad_mine =
              Total(mine) > mine_limit ||
              std::any_of(mine.begin(), mine.end(), [](int64_t v) { return v < 0; });
          const bool bad_theirs = Total(theirs) > theirs_limit;
          // The first rank whose own counts do not fit, the first that would
          // take more rows than it holds (or none: the size), and whether
          // MPI_Alltoallv's ints fit everywhere (the least of 1s and 0s).
          int64_t agreed[3] = {bad_mine ? c.rank : c.size, bad_theirs ? c.rank : c.size,
                               largest <= mpi::CountLimit() / c.size};
          if (int rc = mpi::Allreduce(agreed, agreed, 3, MPI_INT64_T, MPI_MIN, c.handle)) return rc;
          const std::string element = batch > 1 ? " (batch element " + std::to_string(b) + ")" : "";
          if (bad_mine) {
            std::string list;
            for (int64_t v : mine) list += (list.empty() ? "" : ", ") + std::to_string(v);
            problem = "counts [" + list + "]" + element + " do not fit the " +
                      std::to_string(mine_limit) + " rows they " +
                      (reverse ? "receive into" : "send from") +
                      " (expected counts >= 0 summing to at most that)";
          } else if (agreed[0] < c.size) {
            problem = "the send_counts of rank " + std::to_string(agreed[0]) + element +
                      " do not fit its rows (its error says how), so no rows moved";
          } else if (bad_theirs) {
            problem = "the counts of rank(s) sending here" + element + " add up to " +
                      std::to_string(Total(theirs)) + " rows, more than the " +
                      std::to_string(theirs_limit) +
                      (reverse ? " rows of x" : " rows of the result (rows=)");
          } else if (agreed[1] < c.size) {
            problem = "rank " + std::to_string(agreed[1]) + element +
                      " would take more rows than it holds (its error says how), so no rows moved";
          }
          if (!problem.empty()) return MPI_SUCCESS;
          const mpi::Counts& send = reverse ? theirs : mine;
          const mpi::Counts& recv = reverse ? mine : theirs;
          char* to = static_cast<char*>(m.Out(*y)) + b * y_rows * row_bytes;
          if (int rc = mpi::Alltoallv(static_cast<char*>(m.In(x)) + b * x_rows * row_bytes,
                                      Elements(send, row), to, Elements(recv, row), TypeOf(x),
                                      c.handle, agreed[2] != 0)) {
            return rc;
          }
          const int64_t got = Total(recv);
          m.Zero(to + got * row_bytes, static_cast<size_t>((y_rows - got) * row_bytes));
          std::copy(theirs.begin(), theirs.end(), received.begin() + b * c.size);
        }
        for (size_t i = 0; i < total; ++i) {
          const int32_t narrow = static_cast<int32_t>(received[i]);
          std::memcpy(&raw[i * width], wide ? static_cast<void*>(&received[i]) : &narrow, width);
        }
        m.Copy(m.Out(*exchanged), raw.data(), raw.size());
        return MPI_SUCCESS;
      });
  if (!problem.empty()) {
    return ffi::Error::InvalidArgument(
        "mpijax.ragged_alltoall" + std::string(reverse ? " (transposed)" : "") + ": " + problem);
  }
  return error;
}

MPIJAX_OP(RaggedAlltoall, "ragged_alltoall",
          P::Bind()
              .template Arg<ffi::AnyBuffer>()
              .template Arg<ffi::AnyBuffer>()
              .template Arg<ffi::Token>()
              .template Ret<ffi::AnyBuffer>()
              .template Ret<ffi::AnyBuffer>()
              .template Ret<ffi::Token>()
              .template Attr<int64_t>("comm")
              .template Attr<int64_t>("reverse"));

template <class Memory>
ffi::Error Barrier(typename Memory::Context ctx, ffi::Token, TokenOut, int64_t comm) {
  CallInfo info;
  info.op = "barrier";
  return Run<Memory>(ctx, info, comm, kNoHostAccess,
                     [&](const Comm& c, Memory&) { return mpi::Barrier(c.handle); });
}

MPIJAX_OP(
    Barrier, "barrier",
    P::Bind().template Arg<ffi::Token>().template Ret<ffi::Token>().template Attr<int64_t>("comm"));

// A send to oneself is copied on the host (mpi_calls.h), and a routed send
// may turn out to be one. A transposed receive's send answers its message
// (`answers`, Answered).
template <class Memory>
ffi::Error Send(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::AnyBuffer route, ffi::Token,
                TokenOut, int64_t comm, int64_t dest, int64_t tag, int64_t answers) {
  CallInfo info = Describe("send", x);
  info.dest = static_cast<int>(dest);
  info.send_tag = static_cast<int>(tag);
  size_t answer = 0;
  const auto to_self = [&](const Comm& c) { return info.dest == c.rank || info.dest == kRouted; };
  return Run<Memory>(
      ctx, info, comm, to_self,
      [&](Memory& m) {
        Route(m, route, &info.dest, &info.send_tag);
        answer = Answered(m, route, answers, info);
      },
      [&](const Comm& c, Memory& m) {
        std::vector<char> packed;
        const void* data = Answer(m, m.In(x), x.size_bytes(), answer, answers, &packed);
        return mpi::Send(data, info.count, TypeOf(x), info.dest, info.send_tag, c.handle);
      });
}

MPIJAX_OP(Send, "send",
          P::Bind()
              .template Arg<ffi::AnyBuffer>()
              .template Arg<ffi::AnyBuffer>()
              .template Arg<ffi::Token>()
              .template Ret<ffi::Token>()
              .template Attr<int64_t>("comm")
              .template Attr<int64_t>("dest")
              .template Attr<int64_t>("tag")
              .template Attr<int64_t>("answers"));

template <class Memory>
ffi::Error Recv(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::AnyBuffer route, ffi::Token,
                Out y, Out envelope, TokenOut, int64_t comm, int64_t source, int64_t tag,
                int64_t status, int64_t parts) {
  CallInfo info = Describe("recv", x);
  info.source = static_cast<int>(source);
  info.recv_tag = static_cast<int>(tag);
  return Run<Memory>(
      ctx, info, comm, kNoHostAccess,
      [&](Memory& m) { Route(m, route, &info.source, &info.recv_tag); },
      [&](const Comm& c, Memory& m) {
        void* out = m.Out(*y);
        void* env = m.Out(*envelope);
        MPI_Status st;
        const std::optional<int> taken = TakeAside(m, info, c.handle, out, y->size_bytes(), &st);
        const int code = taken ? *taken
                               : mpi::Recv(out, y->element_count(), TypeOf(x), info.source,
                                           info.recv_tag, c.handle, &st);
        return code != MPI_SUCCESS ? code : FinishReceive(m, st, out, *y, parts, env, status);
      });
}

MPIJAX_OP(Recv, "recv",
          Receiving(P::Bind().template Arg<ffi::AnyBuffer>())
              .template Attr<int64_t>("source")
              .template Attr<int64_t>("tag")
              .template Attr<int64_t>("status")
              .template Attr<int64_t>("parts"));

template <class Memory>
ffi::Error Sendrecv(typename Memory::Context ctx, ffi::AnyBuffer send, ffi::AnyBuffer recv,
                    ffi::AnyBuffer route, ffi::Token, Out y, Out envelope, TokenOut, int64_t comm,
                    int64_t source, int64_t dest, int64_t sendtag, int64_t recvtag, int64_t status,
                    int64_t parts, int64_t answers) {
  CallInfo info = Describe("sendrecv", send);
  info.source = static_cast<int>(source);
  info.dest = static_cast<int>(dest);
  info.send_tag = static_cast<int>(sendtag);
  info.recv_tag = static_cast<int>(recvtag);
  info.recv_dtype = ElementOf(recv.element_type()).name;
  info.recv_shape = ShapeOf(recv);
  // The output may alias recv; MPI forbids it to overlap send, and an
  // overlapping send is copied on the host (XLA copies an operand passed
  // twice, and sendrecv(x, x) does not alias, but this does not rely on it).
  const bool overlap = send.size_bytes() > 0 && send.untyped_data() == y->untyped_data();
  size_t answer = 0;
  return Run<Memory>(
      ctx, info, comm, [&](const Comm&) { return overlap; },
      [&](Memory& m) {
        Route(m, route, &info.source, &info.recv_tag);
        Route(m, route, &info.dest, &info.send_tag);
        answer = Answered(m, route, answers, info);
      },
      [&](const Comm& c, Memory& m) {
        const void* source_data = m.In(send);
        void* out = m.Out(*y);
        void* env = m.Out(*envelope);
        std::vector<char> copy;
        if (overlap) {
          const char* bytes = static_cast<const char*>(source_data);
          copy.assign(bytes, bytes + send.size_bytes());
          source_data = copy.data();
        }
        std::vector<char> packed;
        source_data = Answer(m, source_data, send.size_bytes(), answer, answers, &packed);
        MPI_Status st;
        const std::optional<int> taken = TakeAside(m, info, c.handle, out, y->size_bytes(), &st);
        const int code = !taken
                             ? mpi::Sendrecv(source_data, info.count, TypeOf(send), info.dest,
                                             info.send_tag, out, y->element_count(), TypeOf(recv),
                                             info.source, info.recv_tag, c.handle, &st)
                         : *taken ? *taken
                                  : mpi::Send(source_data, info.count, TypeOf(send), info.dest,
                                              info.send_tag, c.handle);
        return code != MPI_SUCCESS ? code : FinishReceive(m, st, out, *y, parts, env, status);
      });
}

MPIJAX_OP(Sendrecv, "sendrecv",
          Receiving(P::Bind().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>())
              .template Attr<int64_t>("source")
              .template Attr<int64_t>("dest")
              .template Attr<int64_t>("sendtag")
              .template Attr<int64_t>("recvtag")
              .template Attr<int64_t>("status")
              .template Attr<int64_t>("parts")
              .template Attr<int64_t>("answers"));

using Ints = ffi::Span<const int64_t>;

void Peers(CallInfo& info, Ints to, Ints from) {
  info.to = to.begin();
  info.num_to = static_cast<int64_t>(to.size());
  info.from = from.begin();
  info.num_from = static_cast<int64_t>(from.size());
}

// Narrows `info` to the message at fault: `failed` indexes the receives, then
// the sends (mpi::NeighborExchange, mpi::Finish); -1 blames none.
void Blame(CallInfo& info, const std::vector<mpi::Transfer>& recvs,
           const std::vector<mpi::Transfer>& sends, int failed) {
  info.source = info.recv_tag = info.dest = info.send_tag = kUnset;
  if (failed < 0) return;
  const size_t i = static_cast<size_t>(failed);
  const mpi::Transfer& t = i < recvs.size() ? recvs[i] : sends[i - recvs.size()];
  (i < recvs.size() ? info.source : info.dest) = t.peer;
  (i < recvs.size() ? info.recv_tag : info.send_tag) = t.tag;
}

// Every message of `recvs` and `sends` at once (mpi::NeighborExchange), a
// receive from MPI_PROC_NULL leaving its buffer as it is. A derivative message
// that a receive from anyone set aside is taken from there (mpi_calls.h). On
// an error `info` names the message at fault.
template <class Memory>
int Exchange(Memory& m, CallInfo& info, MPI_Comm comm, std::vector<mpi::Transfer>& recvs,
             const std::vector<mpi::Transfer>& sends) {
  for (mpi::Transfer& r : recvs) {
    if (r.peer == MPI_PROC_NULL) continue;
    int size = 0;
    MPI_Type_size(r.type, &size);
    const size_t bytes = static_cast<size_t>(r.count) * static_cast<size_t>(size);
    info.source = r.peer;
    info.recv_tag = r.tag;
    MPI_Status st;
    const std::optional<int> taken = TakeAside(m, info, comm, r.data, bytes, &st);
    if (!taken) continue;
    MPI_Count received = 0;
    if (*taken || MPI_Get_elements_x(&st, MPI_BYTE, &received) ||
        received != static_cast<MPI_Count>(bytes)) {
      return *taken ? *taken : mpi::kWrongSize;
    }
    r.peer = MPI_PROC_NULL;
    r.count = 0;
  }
  int failed = -1;
  const int code = mpi::NeighborExchange(recvs, sends, comm, &failed);
  Blame(info, recvs, sends, failed);
  return code;
}

// The binding of a call that takes any number of messages: sends (and more)
// in, results (and more) out, each list ending with the token; the messages'
// peers and tags.
template <class P>
auto Exchanging() {
  return P::Bind()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<int64_t>("comm")
      .template Attr<Ints>("sources")
      .template Attr<Ints>("recvtags")
      .template Attr<Ints>("dests")
      .template Attr<Ints>("sendtags");
}

// Result i comes from sources[i] under recvtags[i] (zeros from
// MPI_PROC_NULL), and send i goes to dests[i] under sendtags[i]; all posted
// at once.
template <class Memory>
ffi::Error NeighborExchange(typename Memory::Context ctx, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, int64_t comm, Ints sources, Ints recvtags,
                            Ints dests, Ints sendtags) {
  CallInfo info;
  info.op = "neighbor_exchange";
  info.checked = false;
  Peers(info, dests, sources);
  const size_t n_send = dests.size(), n_recv = sources.size();
  if (args.size() != n_send + 1 || rets.size() != n_recv + 1 || sendtags.size() != n_send ||
      recvtags.size() != n_recv) {
    return ffi::Error::InvalidArgument("mpijax.neighbor_exchange: " + std::to_string(n_send) +
                                       " destinations and " + std::to_string(n_recv) +
                                       " sources do not match the operands");
  }
  std::vector<ffi::AnyBuffer> send;
  std::vector<ffi::Result<ffi::AnyBuffer>> recv;
  for (size_t i = 0; i < n_send; ++i) {
    send.push_back(*args.get<ffi::AnyBuffer>(i));
    info.count += static_cast<int64_t>(send.back().element_count());
    info.bytes += static_cast<int64_t>(send.back().size_bytes());
  }
  for (size_t i = 0; i < n_recv; ++i) recv.push_back(*rets.get<ffi::AnyBuffer>(i));
  if (!send.empty()) info.dtype = ElementOf(send[0].element_type()).name;
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    std::vector<mpi::Transfer> sends, recvs;
    for (size_t i = 0; i < n_send; ++i) {
      sends.push_back({m.In(send[i]), static_cast<int64_t>(send[i].element_count()),
                       TypeOf(send[i]), static_cast<int>(dests[i]), static_cast<int>(sendtags[i])});
    }
    for (size_t i = 0; i < n_recv; ++i) {
      ffi::AnyBuffer& y = *recv[i];
      recvs.push_back({m.Out(y), static_cast<int64_t>(y.element_count()), TypeOf(y),
                       static_cast<int>(sources[i]), static_cast<int>(recvtags[i])});
      if (sources[i] == MPI_PROC_NULL) m.Zero(recvs.back().data, y.size_bytes());
    }
    return Exchange(m, info, c.handle, recvs, sends);
  });
}

MPIJAX_OP(NeighborExchange, "neighbor_exchange", Exchanging<P>());

// A box of an array: along each of its leading axes a first index and an
// extent, its trailing axes whole. CopyBox copies it to (pack) or from a
// contiguous buffer, one contiguous run per index of the leading axes but the
// last.
struct Box {
  const int64_t* start;
  const int64_t* extent;
  size_t axes;
};

void CopyBox(char* array, ffi::AnyBuffer::Dimensions dims, size_t item, const Box& box,
             char* packed, bool pack) {
  std::vector<size_t> stride(box.axes);
  size_t inner = item;
  for (size_t a = dims.size(); a-- > 0;) {
    if (a < box.axes) stride[a] = inner;
    inner *= static_cast<size_t>(dims[a]);
  }
  for (size_t a = 0; a < box.axes; ++a) {
    if (box.extent[a] == 0) return;
  }
  const size_t last = box.axes - 1;
  const size_t run = static_cast<size_t>(box.extent[last]) * stride[last];
  std::vector<int64_t> at(box.axes, 0);
  for (bool more = true; more; packed += run) {
    size_t offset = 0;
    for (size_t a = 0; a < box.axes; ++a) {
      offset += static_cast<size_t>(box.start[a] + at[a]) * stride[a];
    }
    std::memcpy(pack ? packed : array + offset, pack ? array + offset : packed, run);
    more = false;  // the next index of the leading axes but the last, if any
    for (size_t a = last; a-- > 0 && !more;) {
      more = ++at[a] < box.extent[a];
      if (!more) at[a] = 0;
    }
  }
}

// Fills ghost cells in place (halo_exchange): message i sends the box of
// field field[i] at send_starts[i] to dests[i] and receives the box at
// recv_starts[i] from sources[i], both of extent extents[i] and under
// tags[i]. A round (rounds[i], ascending) starts when the one before has
// finished, so its boxes carry the ghost cells earlier rounds filled (the
// corners). A box from MPI_PROC_NULL leaves the ghost cells as they are; one
// from this rank itself is copied without MPI. Boxes are given over the
// leading `axes` axes of the fields (3 numbers per axis and message, flat).
template <class Memory>
ffi::Error Halo(typename Memory::Context ctx, ffi::RemainingArgs args, ffi::RemainingRets rets,
                int64_t comm, int64_t axes, Ints field, Ints rounds, Ints sources, Ints dests,
                Ints tags, Ints send_starts, Ints recv_starts, Ints extents) {
  CallInfo info;
  info.op = "halo_exchange";
  info.checked = false;
  Peers(info, dests, sources);
  const size_t n = field.size(), n_fields = args.size() - 1, k = static_cast<size_t>(axes);
  bool valid = rets.size() == args.size() && axes > 0 && rounds.size() == n &&
               sources.size() == n && dests.size() == n && tags.size() == n &&
               send_starts.size() == n * k && recv_starts.size() == n * k &&
               extents.size() == n * k;
  std::vector<ffi::AnyBuffer> in;
  std::vector<ffi::Result<ffi::AnyBuffer>> out;
  for (size_t f = 0; valid && f < n_fields; ++f) {
    in.push_back(*args.get<ffi::AnyBuffer>(f));
    out.push_back(*rets.get<ffi::AnyBuffer>(f));
  }
  for (size_t i = 0; valid && i < n; ++i) {
    valid = field[i] >= 0 && static_cast<size_t>(field[i]) < n_fields &&
            in[field[i]].dimensions().size() >= k && (i == 0 || rounds[i] >= rounds[i - 1]);
    for (size_t a = 0; valid && a < k; ++a) {
      const int64_t dim = in[field[i]].dimensions()[a], e = extents[i * k + a];
      valid = e >= 0 && send_starts[i * k + a] >= 0 && send_starts[i * k + a] + e <= dim &&
              recv_starts[i * k + a] >= 0 && recv_starts[i * k + a] + e <= dim;
    }
  }
  if (!valid) {
    return ffi::Error::InvalidArgument("mpijax.halo_exchange: the boxes do not fit the fields");
  }
  if (n_fields) info.dtype = ElementOf(in[0].element_type()).name;
  return Run<Memory>(
      ctx, info, comm, [](const Comm&) { return true; },
      [&](const Comm& c, Memory& m) {
        std::vector<char*> data;  // each field's output, holding its input
        for (size_t f = 0; f < n_fields; ++f) {
          void* from = m.In(in[f]);
          data.push_back(static_cast<char*>(m.Out(*out[f])));
          if (data.back() != from) m.Copy(data.back(), from, in[f].size_bytes());
        }
        auto item = [&](size_t i) { return ffi::ByteWidth(in[field[i]].element_type()); };
        auto box = [&](Ints starts, size_t i) { return Box{&starts[i * k], &extents[i * k], k}; };
        auto bytes = [&](size_t i) {
          size_t b = item(i);
          const auto dims = in[field[i]].dimensions();
          for (size_t a = 0; a < dims.size(); ++a) {
            b *= static_cast<size_t>(a < k ? extents[i * k + a] : dims[a]);
          }
          return b;
        };
        // One buffer, kept from call to call: a box's packed send, then its receive.
        thread_local std::vector<char> packed;
        for (size_t first = 0, end; first < n; first = end) {
          end = first;
          size_t total = 0;
          while (end < n && rounds[end] == rounds[first]) total += 2 * bytes(end++);
          if (packed.size() < total) packed.resize(total);
          std::vector<mpi::Transfer> sends, recvs;
          std::vector<std::pair<size_t, char*>> unpack;
          char* at = packed.data();
          for (size_t i = first; i < end; ++i) {
            const size_t b = bytes(i);
            char *send = at, *recv = at + b;
            at += 2 * b;
            info.count += static_cast<int64_t>(b / item(i));
            info.bytes += static_cast<int64_t>(b);
            const bool self = sources[i] == c.rank && dests[i] == c.rank;
            if (dests[i] != MPI_PROC_NULL) {
              CopyBox(data[field[i]], in[field[i]].dimensions(), item(i), box(send_starts, i), send,
                      true);
              if (!self) {
                sends.push_back({send, static_cast<int64_t>(b), MPI_BYTE,
                                 static_cast<int>(dests[i]), static_cast<int>(tags[i])});
              }
            }
            if (sources[i] == MPI_PROC_NULL) continue;
            if (self) {
              unpack.emplace_back(i, send);
            } else {
              recvs.push_back({recv, static_cast<int64_t>(b), MPI_BYTE,
                               static_cast<int>(sources[i]), static_cast<int>(tags[i])});
              unpack.emplace_back(i, recv);
            }
          }
          if (int rc = Exchange(m, info, c.handle, recvs, sends)) return rc;
          for (const auto& [i, from] : unpack) {
            CopyBox(data[field[i]], in[field[i]].dimensions(), item(i), box(recv_starts, i), from,
                    false);
          }
        }
        return MPI_SUCCESS;
      });
}

MPIJAX_OP(Halo, "halo_exchange",
          P::Bind()
              .RemainingArgs()
              .RemainingRets()
              .template Attr<int64_t>("comm")
              .template Attr<int64_t>("axes")
              .template Attr<Ints>("field")
              .template Attr<Ints>("rounds")
              .template Attr<Ints>("sources")
              .template Attr<Ints>("dests")
              .template Attr<Ints>("tags")
              .template Attr<Ints>("send_starts")
              .template Attr<Ints>("recv_starts")
              .template Attr<Ints>("extents"));

// Starts the messages of a neighbor_exchange (isend and irecv are its cases
// of one message) and returns at once with the id of their Pending (a float32
// scalar, pending.h). The operands are the sends, then an empty array per receive
// (which only gives vmap something to batch), then, if `guarded`, the id of
// the request whose wait this start reverses, then the token. `derivative`
// marks the id (kDifferentiated); a guarded start whose guard is not marked
// posts nothing and returns 0: that request was started outside the
// differentiation, on its peers too, and has no derivative messages.
template <class Memory>
ffi::Error Start(typename Memory::Context ctx, ffi::RemainingArgs args, ffi::RemainingRets rets,
                 int64_t comm, Ints sources, Ints recvtags, Ints dests, Ints sendtags,
                 Ints recv_bytes, int64_t derivative, int64_t guarded) {
  CallInfo info;
  info.op = "start";
  info.checked = false;
  Peers(info, dests, sources);
  const size_t n_send = dests.size(), n_recv = sources.size();
  if (args.size() != n_send + n_recv + (guarded ? 2 : 1) || rets.size() != 2 ||
      recv_bytes.size() != n_recv) {
    return ffi::Error::InvalidArgument("mpijax.start: the lists do not match the operands");
  }
  std::vector<ffi::AnyBuffer> send;
  for (size_t i = 0; i < n_send; ++i) {
    send.push_back(*args.get<ffi::AnyBuffer>(i));
    info.count += static_cast<int64_t>(send.back().element_count());
    info.bytes += static_cast<int64_t>(send.back().size_bytes());
  }
  if (!send.empty()) info.dtype = ElementOf(send[0].element_type()).name;
  ffi::Result<ffi::AnyBuffer> id = *rets.get<ffi::AnyBuffer>(0);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    if (guarded) {
      float guard = 0;
      m.Copy(&guard, m.In(*args.get<ffi::AnyBuffer>(n_send + n_recv)), sizeof guard);
      if (!(static_cast<int32_t>(guard) & kDifferentiated)) {
        const float none = 0;
        m.Copy(m.Out(*id), &none, sizeof none);
        return MPI_SUCCESS;
      }
    }
    Pending p;
    p.comm = c.handle;
    for (size_t i = 0; i < n_send; ++i) {
      std::vector<char>& copy = p.buffers.emplace_back(send[i].size_bytes());
      m.Copy(copy.data(), m.In(send[i]), copy.size());
      p.sends.push_back({copy.data(), static_cast<int64_t>(copy.size()), MPI_BYTE,
                         static_cast<int>(dests[i]), static_cast<int>(sendtags[i])});
    }
    for (size_t i = 0; i < n_recv; ++i) {
      std::vector<char>& place = p.buffers.emplace_back(static_cast<size_t>(recv_bytes[i]));
      p.recvs.push_back({place.data(), recv_bytes[i], MPI_BYTE, static_cast<int>(sources[i]),
                         static_cast<int>(recvtags[i])});
    }
    int failed = -1;
    if (int rc = mpi::Post(p.recvs, p.sends, c.handle, &p.requests, &failed)) {
      Blame(info, p.recvs, p.sends, failed);
      return rc;
    }
    const auto kept = static_cast<float>(Keep(std::move(p)) | (derivative ? kDifferentiated : 0));
    m.Copy(m.Out(*id), &kept, sizeof kept);
    return MPI_SUCCESS;
  });
}

MPIJAX_OP(Start, "start",
          Exchanging<P>()
              .template Attr<Ints>("recv_bytes")
              .template Attr<int64_t>("derivative")
              .template Attr<int64_t>("guarded"));

// Completes the Pending of each of the first `requests` operands (ids), in
// order, and returns what their receives received, in order: counts[k] results
// for request k, zeros for a message from MPI_PROC_NULL and for request 0
// (none). The operands after the ids (then the token) are not read: they only
// make XLA compute them before the wait. batch[k]: the size of the batch that
// vmap gave request k's results; a request started outside some of those vmaps
// received one element's messages (or a smaller batch's), which every element
// gets.
template <class Memory>
ffi::Error Wait(typename Memory::Context ctx, ffi::RemainingArgs args, ffi::RemainingRets rets,
                int64_t comm, int64_t requests, Ints counts, Ints batch) {
  CallInfo info;
  info.op = "wait";
  info.checked = false;
  std::vector<ffi::AnyBuffer> ids;
  for (int64_t i = 0; i < requests && static_cast<size_t>(i) + 1 < args.size(); ++i) {
    ids.push_back(*args.get<ffi::AnyBuffer>(static_cast<size_t>(i)));
  }
  std::vector<ffi::Result<ffi::AnyBuffer>> outs;
  for (size_t i = 0; i + 1 < rets.size(); ++i) outs.push_back(*rets.get<ffi::AnyBuffer>(i));
  int64_t results = 0;
  for (int64_t count : counts) results += count;
  if (ids.size() != counts.size() || batch.size() != counts.size() ||
      static_cast<int64_t>(outs.size()) != results) {
    return ffi::Error::InvalidArgument("mpijax.wait: the counts do not match the operands");
  }
  std::string missing;
  std::vector<int64_t> from;  // the log's list of peers
  // After a failure the requests that follow are still completed (none is
  // left pending), their results not written; the first failure is raised.
  const ffi::Error error = Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm&, Memory& m) {
    int first = MPI_SUCCESS;
    size_t next = 0;
    for (size_t k = 0; k < ids.size(); ++k) {
      float id = 0;
      m.Copy(&id, m.In(ids[k]), sizeof id);
      std::optional<Pending> p;
      if (id != 0) {
        const bool valid = id > 0 && id < static_cast<float>(kIdLimit) && id == std::floor(id);
        if (valid) p = Take(static_cast<int32_t>(id));
        const bool failed_before = first != MPI_SUCCESS || !missing.empty();
        if (!p) {
          std::ostringstream name;
          name << id;
          if (failed_before) continue;
          missing = id == kMixedBatch
                        ? "under jax.vmap the batch's elements hold different requests: one "
                          "carried through a lax.while_loop whose elements stop at different "
                          "steps, or through a lax.cond on a batched predicate, keeps each "
                          "element's own; wait for a request in the step that started it"
                        : "request " + name.str() + " is not pending (waited for already?)";
          continue;
        }
        int failed = -1;
        if (const int rc = mpi::Finish(p->recvs, &p->requests, &failed)) {
          if (!failed_before) {
            Blame(info, p->recvs, p->sends, failed);
            first = rc;
          }
          continue;
        }
        if (failed_before) continue;
        if (static_cast<int64_t>(p->recvs.size()) != counts[k]) {
          missing = "the results do not match the pending receives";
          continue;
        }
        for (const mpi::Transfer& r : p->recvs) {
          from.push_back(r.peer);
          if (r.peer != MPI_PROC_NULL) info.bytes += r.count;
        }
        info.count = info.bytes;  // received as bytes (MPI_BYTE)
        info.dtype = "byte";
        info.from = from.data();
        info.num_from = static_cast<int64_t>(from.size());
      }
      if (first != MPI_SUCCESS || !missing.empty()) continue;
      for (int64_t i = 0; i < counts[k]; ++i, ++next) {
        void* out = m.Out(*outs[next]);
        const size_t bytes = outs[next]->size_bytes();
        const mpi::Transfer* r = p ? &p->recvs[static_cast<size_t>(i)] : nullptr;
        const size_t received = r ? static_cast<size_t>(r->count) : 0;
        const size_t copies = received ? bytes / received : 1;
        if (r && (received * copies != bytes || batch[k] % static_cast<int64_t>(copies) != 0)) {
          missing = "the results do not match the pending receives";
          break;
        }
        if (r && r->peer != MPI_PROC_NULL) {
          for (size_t j = 0; j < copies; ++j) {
            m.Copy(static_cast<char*>(out) + j * received, r->data, received);
          }
        } else {
          m.Zero(out, bytes);
        }
      }
    }
    return first;
  });
  if (!missing.empty()) {
    return ffi::Error::Internal("mpijax.wait: " + missing);
  }
  return error;
}

MPIJAX_OP(Wait, "wait",
          P::Bind()
              .RemainingArgs()
              .RemainingRets()
              .template Attr<int64_t>("comm")
              .template Attr<int64_t>("requests")
              .template Attr<Ints>("counts")
              .template Attr<Ints>("batch"));

#undef MPIJAX_OP

}  // namespace

const HandlerTable& HandlersByPlatform() { return Table(); }

}  // namespace mpijax
