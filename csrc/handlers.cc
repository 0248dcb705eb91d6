// Each handler reads its buffers and attributes, and hands one large-count-safe
// MPI call (mpi_calls.h) to Run, which resolves the communicator, agrees on
// the call with the other ranks in check mode, logs, and turns MPI error
// codes into ffi::Error. Operands and results carry the
// ordering token last; the handlers ignore it.
#include "handlers.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "log.h"
#include "memory.h"
#include "mpi_calls.h"
#include "reductions.h"
#include "registry.h"
#include "tags.h"
#include "xla/ffi/api/ffi.h"

#ifdef MPIJAX_CUDA
#include "cuda_memory.h"
#endif

namespace ffi = xla::ffi;

namespace mpijax {
namespace {

struct Element {
  MPI_Datatype type;
  const char* name;
};

Element ElementOf(ffi::DataType t) {
  switch (t) {
    case ffi::PRED:
      return {MPI_C_BOOL, "bool"};
    case ffi::S8:
      return {MPI_INT8_T, "int8"};
    case ffi::S16:
      return {MPI_INT16_T, "int16"};
    case ffi::S32:
      return {MPI_INT32_T, "int32"};
    case ffi::S64:
      return {MPI_INT64_T, "int64"};
    case ffi::U8:
      return {MPI_UINT8_T, "uint8"};
    case ffi::U16:
      return {MPI_UINT16_T, "uint16"};
    case ffi::U32:
      return {MPI_UINT32_T, "uint32"};
    case ffi::U64:
      return {MPI_UINT64_T, "uint64"};
    // No MPI type exists for 16-bit floats: they travel as 2-byte words and
    // reduce in user ops (OpOf).
    case ffi::F16:
      return {MPI_UINT16_T, "float16"};
    case ffi::BF16:
      return {MPI_UINT16_T, "bfloat16"};
    case ffi::F32:
      return {MPI_FLOAT, "float32"};
    case ffi::F64:
      return {MPI_DOUBLE, "float64"};
    case ffi::C64:
      return {MPI_C_FLOAT_COMPLEX, "complex64"};
    case ffi::C128:
      return {MPI_C_DOUBLE_COMPLEX, "complex128"};
    default:
      return {MPI_DATATYPE_NULL, "unsupported"};
  }
}

MPI_Datatype TypeOf(const ffi::AnyBuffer& x) { return ElementOf(x.element_type()).type; }

// The MPI_Op of a reduction code; MPI_OP_NULL (MPI_ERR_OP) for an unknown one.
MPI_Op OpOf(int64_t code, const ffi::AnyBuffer& x) {
  if (code >= kFirstUserOp) {
    // The user's operator sees the MPI type TypeOf(x): 16-bit floats as
    // MPI_UINT16_T words, since MPI has no type for them.
    MPI_Op op = MPI_OP_NULL;
    return LookupOp(code - kFirstUserOp, &op) ? op : MPI_OP_NULL;
  }
  if (code < 0) return MPI_OP_NULL;
  const auto r = static_cast<Reduction>(code);
  switch (x.element_type()) {
    case ffi::F16:
      return CustomOp(r, CustomElement::kHalf);
    case ffi::BF16:
      return CustomOp(r, CustomElement::kBfloat16);
    case ffi::S8:
    case ffi::U8:
      if (r == Reduction::kSum) return CustomOp(r, CustomElement::kWord8);
      return PredefinedOp(r);
    case ffi::S16:
    case ffi::U16:
      if (r == Reduction::kSum) return CustomOp(r, CustomElement::kWord16);
      return PredefinedOp(r);
    default:
      return PredefinedOp(r);
  }
}

Shape ShapeOf(const ffi::AnyBuffer& x) {
  Shape shape;
  const auto dims = x.dimensions();
  shape.ndim = static_cast<int>(dims.size());
  for (int i = 0; i < shape.ndim; ++i) {
    const int j = std::min(i, Shape::kMaxDims - 1);
    shape.dims[j] = i > j ? shape.dims[j] * dims[i] : dims[i];
  }
  return shape;
}

CallInfo Describe(const char* op, const ffi::AnyBuffer& x) {
  CallInfo info;
  info.op = op;
  info.count = static_cast<int64_t>(x.element_count());
  info.dtype = ElementOf(x.element_type()).name;
  info.bytes = static_cast<int64_t>(x.size_bytes());
  info.shape = ShapeOf(x);
  return info;
}

struct Comm {
  MPI_Comm handle;
  int rank;
  int size;
};

std::string Rank(int rank) {
  return rank == MPI_ANY_SOURCE ? "any rank" : "rank " + std::to_string(rank);
}

// Whom a call that timed out was waiting for.
std::string Awaited(const CallInfo& call, const Comm& comm) {
  if (!PointToPoint(call)) {
    std::string text = "the other ranks of its communicator (size " + std::to_string(comm.size);
    if (call.root != kUnset) text += ", root " + std::to_string(call.root);
    return text + ") to call " + call.op;
  }
  std::string text;
  if (call.source != kUnset) {
    text = "a message from " + Rank(call.source) + " with tag " + TagName(call.recv_tag);
  }
  if (call.dest != kUnset) {
    text += (text.empty() ? "" : " and for ") + Rank(call.dest) +
            " to receive its message with tag " + TagName(call.send_tag);
  }
  return text;
}

// The standard name of an error code's class: the part of an MPI error that
// does not depend on the library.
std::string ErrorClassName(int code) {
#define MPIJAX_CLASS(name) \
  { name, #name }
  static constexpr std::pair<int, const char*> kClasses[] = {
      MPIJAX_CLASS(MPI_ERR_BUFFER),   MPIJAX_CLASS(MPI_ERR_COUNT),
      MPIJAX_CLASS(MPI_ERR_TYPE),     MPIJAX_CLASS(MPI_ERR_TAG),
      MPIJAX_CLASS(MPI_ERR_COMM),     MPIJAX_CLASS(MPI_ERR_RANK),
      MPIJAX_CLASS(MPI_ERR_REQUEST),  MPIJAX_CLASS(MPI_ERR_ROOT),
      MPIJAX_CLASS(MPI_ERR_GROUP),    MPIJAX_CLASS(MPI_ERR_OP),
      MPIJAX_CLASS(MPI_ERR_ARG),      MPIJAX_CLASS(MPI_ERR_UNKNOWN),
      MPIJAX_CLASS(MPI_ERR_TRUNCATE), MPIJAX_CLASS(MPI_ERR_OTHER),
      MPIJAX_CLASS(MPI_ERR_INTERN),   MPIJAX_CLASS(MPI_ERR_IN_STATUS),
      MPIJAX_CLASS(MPI_ERR_PENDING),  MPIJAX_CLASS(MPI_ERR_KEYVAL),
      MPIJAX_CLASS(MPI_ERR_NO_MEM),   MPIJAX_CLASS(MPI_ERR_UNSUPPORTED_OPERATION),
  };
#undef MPIJAX_CLASS
  int error_class = code;
  if (MPI_Error_class(code, &error_class) != MPI_SUCCESS) error_class = code;
  for (const auto& [value, name] : kClasses) {
    if (value == error_class) return name;
  }
  return "MPI error class " + std::to_string(error_class);
}

ffi::Error Failure(const CallInfo& call, const Comm& comm, int code) {
  const std::string op = "mpijax." + std::string(call.op);
  const std::string rank = "rank " + std::to_string(comm.rank) + " of " + std::to_string(comm.size);
  if (code == mpi::kTimedOut) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", mpi::Timeout());
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      op + " on " + rank + " timed out after " + seconds +
                          " s (MPIJAX_TIMEOUT) waiting for " + Awaited(call, comm) +
                          ". The call was abandoned unfinished: end the program rather than use "
                          "MPI further.");
  }
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  // Libraries word their strings differently (Open MPI starts with the class
  // name, MPICH does not): lead with the standard class name either way.
  std::string message(text, length);
  const std::string name = ErrorClassName(code);
  if (message.rfind(name, 0) != 0) message = name + ": " + message;
  return ffi::Error::Internal(op + " failed on " + rank + ": " + message + " (MPI error code " +
                              std::to_string(code) + ")");
}

// Calls whose data may stay in device memory for a CUDA-aware MPI (memory.h).
constexpr auto kNoHostAccess = [](const Comm&) { return false; };

// `call(comm, memory)` takes its views from `memory`, makes the MPI call and
// returns its error code; it reads peers from `info`, which `route(memory)`
// may fill in first and check mode may narrow. `host_access(comm)` says
// whether the call needs its data in host memory (see memory.h).
template <class Memory, class HostAccess, class RouteStep, class Call>
ffi::Error Run(typename Memory::Context context, CallInfo& info, int64_t comm_id,
               HostAccess host_access, RouteStep route, Call&& call) {
  Comm comm{};
  if (!LookupComm(comm_id, &comm.handle)) {
    return ffi::Error::InvalidArgument("mpijax." + std::string(info.op) +
                                       ": unknown communicator id " + std::to_string(comm_id));
  }
  MPI_Comm_rank(comm.handle, &comm.rank);
  MPI_Comm_size(comm.handle, &comm.size);
  Memory memory(context, host_access(comm));
  route(memory);
  InFlight in_flight;
  const auto start = std::chrono::steady_clock::now();
  std::string mismatch;
  int code = CheckEnabled() ? Agree(info, comm.handle, &mismatch) : MPI_SUCCESS;
  // A collective that ranks disagree on must not run; point-to-point calls
  // run what still matches (check.h).
  if (code == MPI_SUCCESS && (mismatch.empty() || PointToPoint(info))) code = call(comm, memory);
  if (code == MPI_SUCCESS) memory.Finish();
  if (LogEnabled()) {
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    LogCall(info, comm.rank, elapsed.count(), code);
  }
  if (code != MPI_SUCCESS) return Failure(info, comm, code);
  if (const std::string error = memory.error(); !error.empty()) {
    return ffi::Error::Internal("mpijax." + std::string(info.op) + " on rank " +
                                std::to_string(comm.rank) + ": " + error);
  }
  if (!mismatch.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, mismatch);
  return ffi::Error::Success();
}

template <class Memory, class HostAccess, class Call>
ffi::Error Run(typename Memory::Context context, CallInfo& info, int64_t comm_id,
               HostAccess host_access, Call&& call) {
  return Run<Memory>(
      context, info, comm_id, host_access, [](Memory&) {}, call);
}

// Fills in a routed peer and its tag from `route` (see kRouted). Only
// derivatives are routed, so the tag becomes a derivative tag (tags.h). A
// message from MPI_PROC_NULL is answered to MPI_PROC_NULL, and so is every
// routed call after a memory error, when the route cannot be read.
template <class Memory>
void Route(Memory& m, const ffi::AnyBuffer& route, int* peer, int* tag) {
  if (*peer != kRouted) return;
  MPI_Status status{};
  m.Copy(&status, m.In(route), sizeof status);
  *peer = m.error().empty() ? status.MPI_SOURCE : MPI_PROC_NULL;
  *tag = DerivativeTag(*peer == MPI_PROC_NULL ? 0 : status.MPI_TAG);
}

// A derivative message that a receive from anyone set aside (mpi_calls.h),
// copied into `out`: the receive's MPI error code, or nothing if there is
// none.
template <class Memory>
std::optional<int> TakeAside(Memory& m, const CallInfo& info, MPI_Comm comm, void* out,
                             size_t bytes, MPI_Status* status) {
  std::vector<char> data;
  if (!mpi::TakeAside(info.source, info.recv_tag, comm, &data, status)) return std::nullopt;
  if (data.size() > bytes) return MPI_ERR_TRUNCATE;
  m.Copy(out, data.data(), data.size());
  return MPI_SUCCESS;
}

// A receive leaves unspecified what a shorter message did not fill (or all of
// the buffer for MPI_PROC_NULL); zero it so results are deterministic. The
// status goes to the envelope output (the route of the receive's
// derivatives, and how Python fills an MPI.Status after an eager call) and
// to the address of a status that a compiled program writes.
template <class Memory>
void FinishReceive(Memory& m, const MPI_Status& status, void* out, size_t bytes, void* envelope,
                   int64_t status_address) {
  int received = 0;
  if (MPI_Get_count(&status, MPI_BYTE, &received) == MPI_SUCCESS && received >= 0 &&
      static_cast<size_t>(received) < bytes) {
    m.Zero(static_cast<char*>(out) + received, bytes - static_cast<size_t>(received));
  }
  m.Copy(envelope, &status, sizeof status);
  if (status_address) *reinterpret_cast<MPI_Status*>(status_address) = status;
}

// Where this rank's output is x unchanged: the view of y, holding x. XLA
// aliases them for every op that returns its input, and then this is x's own
// view, which is not an output: a staged call copies nothing back.
template <class Memory>
void* Unchanged(Memory& m, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  void* in = m.In(x);
  if (y.untyped_data() == x.untyped_data()) return in;
  void* out = m.Out(y);
  m.Copy(out, in, x.size_bytes());
  return out;
}

// out = in + what `receive(buffer)` puts into a host buffer shaped like x
// (host views only).
template <class Receive>
int ReceiveAndAdd(const ffi::AnyBuffer& x, const void* in, void* out, Receive receive) {
  std::vector<char> received(x.size_bytes());
  if (int rc = receive(received.data())) return rc;
  if (in != out) std::memcpy(out, in, x.size_bytes());
  return mpi::Accumulate(received.data(), out, x.element_count(), TypeOf(x),
                         OpOf(static_cast<int64_t>(Reduction::kSum), x));
}

using Out = ffi::Result<ffi::AnyBuffer>;
using TokenOut = ffi::Result<ffi::Token>;

template <class Memory>
ffi::Error Allreduce(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                     int64_t comm, int64_t op) {
  CallInfo info = Describe("allreduce", x);
  info.reduction = static_cast<int>(op);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    return mpi::Allreduce(m.In(x), m.Out(*y), x.element_count(), TypeOf(x), OpOf(op, x), c.handle);
  });
}

// Off the root the output is x itself (aliased), as mpi4jax returns it.
template <class Memory>
ffi::Error Reduce(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                  int64_t comm, int64_t op, int64_t root) {
  CallInfo info = Describe("reduce", x);
  info.root = static_cast<int>(root);
  info.reduction = static_cast<int>(op);
  const auto copies = [&](const Comm& c) { return mpi::ReduceCopiesInput(c.rank, info.root); };
  return Run<Memory>(ctx, info, comm, copies, [&](const Comm& c, Memory& m) {
    void* in = m.In(x);
    void* out = c.rank == info.root ? m.Out(*y) : Unchanged(m, x, *y);
    return mpi::Reduce(in, out, x.element_count(), TypeOf(x), OpOf(op, x), info.root, c.handle);
  });
}

// reverse: over the ranks in reverse order (suffix scans, the transpose of a
// scan). exclusive: MPI_Exscan (Python fills the first rank's result).
template <class Memory>
ffi::Error Scan(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                int64_t comm, int64_t op, int64_t reverse, int64_t exclusive) {
  static constexpr const char* kNames[2][2] = {{"scan", "exscan"},
                                               {"scan(reverse)", "exscan(reverse)"}};
  CallInfo info = Describe(kNames[reverse != 0][exclusive != 0], x);
  info.reduction = static_cast<int>(op);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    MPI_Comm target = c.handle;
    if (reverse) {
      if (int rc = ReversedComm(c.handle, &target)) return rc;
    }
    return mpi::Scan(m.In(x), m.Out(*y), x.element_count(), TypeOf(x), OpOf(op, x), exclusive != 0,
                     target);
  });
}

// In place (aliased): the root sends x and returns it. accumulate: the others
// add what they receive to their x (the adjoint of reduce); else they
// receive over it.
template <class Memory>
ffi::Error Bcast(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                 int64_t comm, int64_t root, int64_t accumulate) {
  CallInfo info = Describe("bcast", x);
  info.root = static_cast<int>(root);
  const auto adds = [&](const Comm& c) { return accumulate && c.rank != info.root; };
  return Run<Memory>(ctx, info, comm, adds, [&](const Comm& c, Memory& m) {
    const int64_t n = x.element_count();
    const auto bcast = [&](void* buf) {
      return mpi::Bcast(buf, n, TypeOf(x), info.root, c.handle);
    };
    if (c.rank == info.root) return bcast(Unchanged(m, x, *y));
    if (!accumulate) return bcast(m.Out(*y));
    void* in = m.In(x);
    return ReceiveAndAdd(x, in, m.Out(*y), bcast);
  });
}

// Off the root the output is x itself (aliased), as mpi4jax returns it, or
// zeros with identity=0 (the adjoint of scatter).
template <class Memory>
ffi::Error Gather(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                  int64_t comm, int64_t root, int64_t identity) {
  CallInfo info = Describe("gather", x);
  info.root = static_cast<int>(root);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    const bool off_root = c.rank != info.root;
    void* in = m.In(x);
    void* out = off_root && identity ? Unchanged(m, x, *y) : m.Out(*y);
    if (off_root && !identity) m.Zero(out, y->size_bytes());
    return mpi::Gather(in, out, x.element_count(), TypeOf(x), info.root, c.handle);
  });
}

// Off the root x only gives the shape, or with accumulate the others add
// what they receive to their x (the adjoint of gather).
template <class Memory>
ffi::Error Scatter(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                   int64_t comm, int64_t root, int64_t accumulate) {
  CallInfo info = Describe("scatter", *y);
  info.root = static_cast<int>(root);
  const auto adds = [&](const Comm& c) { return accumulate && c.rank != info.root; };
  return Run<Memory>(ctx, info, comm, adds, [&](const Comm& c, Memory& m) {
    const int64_t n = y->element_count();
    const bool root_here = c.rank == info.root;
    // Off the root MPI reads nothing from x, which only needs a view to add.
    const void* in = root_here || accumulate ? m.In(x) : nullptr;
    const auto scatter = [&](void* buf) {
      return mpi::Scatter(in, buf, n, TypeOf(x), info.root, c.handle);
    };
    if (root_here || !accumulate) return scatter(m.Out(*y));
    return ReceiveAndAdd(x, in, m.Out(*y), scatter);
  });
}

template <class Memory>
ffi::Error Allgather(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                     int64_t comm) {
  CallInfo info = Describe("allgather", x);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    return mpi::Allgather(m.In(x), m.Out(*y), x.element_count(), TypeOf(x), c.handle);
  });
}

template <class Memory>
ffi::Error Alltoall(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::Token, Out y, TokenOut,
                    int64_t comm) {
  CallInfo info = Describe("alltoall", x);
  return Run<Memory>(ctx, info, comm, kNoHostAccess, [&](const Comm& c, Memory& m) {
    return mpi::Alltoall(m.In(x), m.Out(*y), x.element_count() / c.size, TypeOf(x), c.handle);
  });
}

template <class Memory>
ffi::Error Barrier(typename Memory::Context ctx, ffi::Token, TokenOut, int64_t comm) {
  CallInfo info;
  info.op = "barrier";
  return Run<Memory>(ctx, info, comm, kNoHostAccess,
                     [&](const Comm& c, Memory&) { return mpi::Barrier(c.handle); });
}

// A send to oneself is copied on the host (mpi_calls.h), and a routed send
// may turn out to be one.
template <class Memory>
ffi::Error Send(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::AnyBuffer route, ffi::Token,
                TokenOut, int64_t comm, int64_t dest, int64_t tag) {
  CallInfo info = Describe("send", x);
  info.dest = static_cast<int>(dest);
  info.send_tag = static_cast<int>(tag);
  const auto to_self = [&](const Comm& c) { return info.dest == c.rank || info.dest == kRouted; };
  return Run<Memory>(
      ctx, info, comm, to_self, [&](Memory& m) { Route(m, route, &info.dest, &info.send_tag); },
      [&](const Comm& c, Memory& m) {
        return mpi::Send(m.In(x), x.element_count(), TypeOf(x), info.dest, info.send_tag, c.handle);
      });
}

template <class Memory>
ffi::Error Recv(typename Memory::Context ctx, ffi::AnyBuffer x, ffi::AnyBuffer route, ffi::Token,
                Out y, Out envelope, TokenOut, int64_t comm, int64_t source, int64_t tag,
                int64_t status) {
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
        if (code == MPI_SUCCESS) FinishReceive(m, st, out, y->size_bytes(), env, status);
        return code;
      });
}

template <class Memory>
ffi::Error Sendrecv(typename Memory::Context ctx, ffi::AnyBuffer send, ffi::AnyBuffer recv,
                    ffi::AnyBuffer route, ffi::Token, Out y, Out envelope, TokenOut, int64_t comm,
                    int64_t source, int64_t dest, int64_t sendtag, int64_t recvtag,
                    int64_t status) {
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
  return Run<Memory>(
      ctx, info, comm, [&](const Comm&) { return overlap; },
      [&](Memory& m) {
        Route(m, route, &info.source, &info.recv_tag);
        Route(m, route, &info.dest, &info.send_tag);
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
        MPI_Status st;
        const std::optional<int> taken = TakeAside(m, info, c.handle, out, y->size_bytes(), &st);
        const int code =
            !taken   ? mpi::Sendrecv(source_data, send.element_count(), TypeOf(send), info.dest,
                                     info.send_tag, out, y->element_count(), TypeOf(recv),
                                     info.source, info.recv_tag, c.handle, &st)
            : *taken ? *taken
                     : mpi::Send(source_data, send.element_count(), TypeOf(send), info.dest,
                                 info.send_tag, c.handle);
        if (code == MPI_SUCCESS) FinishReceive(m, st, out, y->size_bytes(), env, status);
        return code;
      });
}

// Bindings: after platform P's prefix, the operands (the ordering token
// last) and results, then the attributes.
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

// One op: its binding and its handler template.
#define MPIJAX_OP(Name, ...)               \
  struct Name##Op {                        \
    template <class P>                     \
    static auto Bind() {                   \
      return __VA_ARGS__;                  \
    }                                      \
    template <class Memory, class... Args> \
    static ffi::Error Call(Args... args) { \
      return Name<Memory>(args...);        \
    }                                      \
  }

MPIJAX_OP(Allreduce, Unary<P>().template Attr<int64_t>("op"));
MPIJAX_OP(Reduce, Unary<P>().template Attr<int64_t>("op").template Attr<int64_t>("root"));
MPIJAX_OP(Scan, Unary<P>()
                    .template Attr<int64_t>("op")
                    .template Attr<int64_t>("reverse")
                    .template Attr<int64_t>("exclusive"));
MPIJAX_OP(Bcast, Unary<P>().template Attr<int64_t>("root").template Attr<int64_t>("accumulate"));
MPIJAX_OP(Gather, Unary<P>().template Attr<int64_t>("root").template Attr<int64_t>("identity"));
MPIJAX_OP(Scatter, Unary<P>().template Attr<int64_t>("root").template Attr<int64_t>("accumulate"));
MPIJAX_OP(Allgather, Unary<P>());
MPIJAX_OP(Alltoall, Unary<P>());
MPIJAX_OP(
    Barrier,
    P::Bind().template Arg<ffi::Token>().template Ret<ffi::Token>().template Attr<int64_t>("comm"));
MPIJAX_OP(Send, P::Bind()
                    .template Arg<ffi::AnyBuffer>()
                    .template Arg<ffi::AnyBuffer>()
                    .template Arg<ffi::Token>()
                    .template Ret<ffi::Token>()
                    .template Attr<int64_t>("comm")
                    .template Attr<int64_t>("dest")
                    .template Attr<int64_t>("tag"));
MPIJAX_OP(Recv, Receiving(P::Bind().template Arg<ffi::AnyBuffer>())
                    .template Attr<int64_t>("source")
                    .template Attr<int64_t>("tag")
                    .template Attr<int64_t>("status"));
MPIJAX_OP(Sendrecv,
          Receiving(P::Bind().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>())
              .template Attr<int64_t>("source")
              .template Attr<int64_t>("dest")
              .template Attr<int64_t>("sendtag")
              .template Attr<int64_t>("recvtag")
              .template Attr<int64_t>("status"));
#undef MPIJAX_OP

// Platforms: what XLA hands a handler first (the binding's prefix), and the
// memory policy made of it.
struct Cpu {
  using Memory = HostMemory;
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

template <class Platform>
std::vector<std::pair<const char*, XLA_FFI_Handler*>> Handlers() {
  return {{"mpijax_allreduce", Handle<Platform, AllreduceOp>},
          {"mpijax_reduce", Handle<Platform, ReduceOp>},
          {"mpijax_scan", Handle<Platform, ScanOp>},
          {"mpijax_bcast", Handle<Platform, BcastOp>},
          {"mpijax_gather", Handle<Platform, GatherOp>},
          {"mpijax_scatter", Handle<Platform, ScatterOp>},
          {"mpijax_allgather", Handle<Platform, AllgatherOp>},
          {"mpijax_alltoall", Handle<Platform, AlltoallOp>},
          {"mpijax_barrier", Handle<Platform, BarrierOp>},
          {"mpijax_send", Handle<Platform, SendOp>},
          {"mpijax_recv", Handle<Platform, RecvOp>},
          {"mpijax_sendrecv", Handle<Platform, SendrecvOp>}};
}

}  // namespace

std::map<std::string, std::vector<std::pair<const char*, XLA_FFI_Handler*>>> HandlersByPlatform() {
  return {
      {"cpu", Handlers<Cpu>()},
#ifdef MPIJAX_CUDA
      {"CUDA", Handlers<Cuda>()},
#endif
  };
}

}  // namespace mpijax
