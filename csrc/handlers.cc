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
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "log.h"
#include "mpi_calls.h"
#include "reductions.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

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

MPI_Op OpOf(int64_t code, const ffi::AnyBuffer& x) {
  if (code < 0 || code >= kNumReductions) return MPI_OP_NULL;
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
  CallInfo info{op, static_cast<int64_t>(x.element_count()), ElementOf(x.element_type()).name,
                static_cast<int64_t>(x.size_bytes())};
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
    text = "a message from " + Rank(call.source) + " with tag " +
           (call.recv_tag == MPI_ANY_TAG ? "ANY_TAG" : std::to_string(call.recv_tag));
  }
  if (call.dest != kUnset) {
    text += (text.empty() ? "" : " and for ") + Rank(call.dest) +
            " to receive its message with tag " + std::to_string(call.send_tag);
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

// `call(comm)` makes the MPI call and returns its error code; it reads peers
// from `info`, which check mode may narrow.
template <class Call>
ffi::Error Run(CallInfo& info, int64_t comm_id, Call&& call) {
  Comm comm{};
  if (!LookupComm(comm_id, &comm.handle)) {
    return ffi::Error::InvalidArgument("mpijax." + std::string(info.op) +
                                       ": unknown communicator id " + std::to_string(comm_id));
  }
  MPI_Comm_rank(comm.handle, &comm.rank);
  MPI_Comm_size(comm.handle, &comm.size);
  InFlight in_flight;
  const auto start = std::chrono::steady_clock::now();
  std::string mismatch;
  int code = CheckEnabled() ? Agree(info, comm.handle, &mismatch) : MPI_SUCCESS;
  // A collective that ranks disagree on must not run; point-to-point calls
  // run what still matches (check.h).
  if (code == MPI_SUCCESS && (mismatch.empty() || PointToPoint(info))) code = call(comm);
  if (LogEnabled()) {
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    LogCall(info, comm.rank, elapsed.count(), code);
  }
  if (code != MPI_SUCCESS) return Failure(info, comm, code);
  if (!mismatch.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, mismatch);
  return ffi::Error::Success();
}

// A receive leaves unspecified what a shorter message did not fill (or all of
// the buffer for MPI_PROC_NULL); zero it so results are deterministic, and
// copy the status out when Python asked for it.
void FinishReceive(const MPI_Status& status, ffi::AnyBuffer& out, int64_t status_address) {
  int received = 0;
  if (MPI_Get_count(&status, MPI_BYTE, &received) == MPI_SUCCESS && received >= 0 &&
      static_cast<size_t>(received) < out.size_bytes()) {
    std::memset(static_cast<char*>(out.untyped_data()) + received, 0,
                out.size_bytes() - static_cast<size_t>(received));
  }
  if (status_address) *reinterpret_cast<MPI_Status*>(status_address) = status;
}

// Makes `out` hold `in`: a no-op where XLA aliased them, as it does for
// every op that returns its input.
void CopyIfDistinct(const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (in.untyped_data() != out.untyped_data()) {
    std::memcpy(out.untyped_data(), in.untyped_data(), out.size_bytes());
  }
}

// out = in + what `receive(buffer)` puts into a buffer shaped like in.
template <class Receive>
int ReceiveAndAdd(const ffi::AnyBuffer& in, ffi::AnyBuffer& out, Receive receive) {
  std::vector<char> received(in.size_bytes());
  if (int rc = receive(received.data())) return rc;
  CopyIfDistinct(in, out);
  return mpi::Accumulate(received.data(), out.untyped_data(), in.element_count(), TypeOf(in),
                         OpOf(static_cast<int64_t>(Reduction::kSum), in));
}

using Out = ffi::Result<ffi::AnyBuffer>;
using TokenOut = ffi::Result<ffi::Token>;

ffi::Error Allreduce(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t op) {
  CallInfo info = Describe("allreduce", x);
  info.reduction = static_cast<int>(op);
  return Run(info, comm, [&](const Comm& c) {
    return mpi::Allreduce(x.untyped_data(), y->untyped_data(), x.element_count(), TypeOf(x),
                          OpOf(op, x), c.handle);
  });
}

// Off the root the output is x itself (aliased), as mpi4jax returns it.
ffi::Error Reduce(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t op,
                  int64_t root) {
  CallInfo info = Describe("reduce", x);
  info.root = static_cast<int>(root);
  info.reduction = static_cast<int>(op);
  return Run(info, comm, [&](const Comm& c) {
    if (c.rank != info.root) CopyIfDistinct(x, *y);
    return mpi::Reduce(x.untyped_data(), y->untyped_data(), x.element_count(), TypeOf(x),
                       OpOf(op, x), info.root, c.handle);
  });
}

// reverse: over the ranks in reverse order (suffix scans, the transpose of a
// scan). exclusive: MPI_Exscan (Python fills the first rank's result).
ffi::Error Scan(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t op,
                int64_t reverse, int64_t exclusive) {
  static constexpr const char* kNames[2][2] = {{"scan", "exscan"},
                                               {"scan(reverse)", "exscan(reverse)"}};
  CallInfo info = Describe(kNames[reverse != 0][exclusive != 0], x);
  info.reduction = static_cast<int>(op);
  return Run(info, comm, [&](const Comm& c) {
    MPI_Comm target = c.handle;
    if (reverse) {
      if (int rc = ReversedComm(c.handle, &target)) return rc;
    }
    return mpi::Scan(x.untyped_data(), y->untyped_data(), x.element_count(), TypeOf(x), OpOf(op, x),
                     exclusive != 0, target);
  });
}

// In place (aliased): the root sends x and returns it. accumulate: the others
// add what they receive to their x (the adjoint of reduce); else they
// receive over it.
ffi::Error Bcast(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t root,
                 int64_t accumulate) {
  CallInfo info = Describe("bcast", x);
  info.root = static_cast<int>(root);
  return Run(info, comm, [&](const Comm& c) {
    const int64_t n = x.element_count();
    if (c.rank == info.root) {
      CopyIfDistinct(x, *y);
      return mpi::Bcast(y->untyped_data(), n, TypeOf(x), info.root, c.handle);
    }
    if (!accumulate) return mpi::Bcast(y->untyped_data(), n, TypeOf(x), info.root, c.handle);
    return ReceiveAndAdd(
        x, *y, [&](void* buf) { return mpi::Bcast(buf, n, TypeOf(x), info.root, c.handle); });
  });
}

// Off the root the output is x itself (aliased), as mpi4jax returns it, or
// zeros with identity=0 (the adjoint of scatter).
ffi::Error Gather(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t root,
                  int64_t identity) {
  CallInfo info = Describe("gather", x);
  info.root = static_cast<int>(root);
  return Run(info, comm, [&](const Comm& c) {
    if (c.rank != info.root) {
      if (identity) {
        CopyIfDistinct(x, *y);
      } else {
        std::memset(y->untyped_data(), 0, y->size_bytes());
      }
    }
    return mpi::Gather(x.untyped_data(), y->untyped_data(), x.element_count(), TypeOf(x), info.root,
                       c.handle);
  });
}

// Off the root x only gives the shape, or with accumulate the others add
// what they receive to their x (the adjoint of gather).
ffi::Error Scatter(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t root,
                   int64_t accumulate) {
  CallInfo info = Describe("scatter", *y);
  info.root = static_cast<int>(root);
  return Run(info, comm, [&](const Comm& c) {
    const int64_t n = y->element_count();
    auto scatter = [&](void* buf) {
      return mpi::Scatter(x.untyped_data(), buf, n, TypeOf(x), info.root, c.handle);
    };
    if (c.rank == info.root || !accumulate) return scatter(y->untyped_data());
    return ReceiveAndAdd(x, *y, scatter);
  });
}

ffi::Error Allgather(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm) {
  CallInfo info = Describe("allgather", x);
  return Run(info, comm, [&](const Comm& c) {
    return mpi::Allgather(x.untyped_data(), y->untyped_data(), x.element_count(), TypeOf(x),
                          c.handle);
  });
}

ffi::Error Alltoall(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm) {
  CallInfo info = Describe("alltoall", x);
  return Run(info, comm, [&](const Comm& c) {
    return mpi::Alltoall(x.untyped_data(), y->untyped_data(), x.element_count() / c.size, TypeOf(x),
                         c.handle);
  });
}

ffi::Error Barrier(ffi::Token, TokenOut, int64_t comm) {
  CallInfo info{"barrier"};
  return Run(info, comm, [&](const Comm& c) { return mpi::Barrier(c.handle); });
}

ffi::Error Send(ffi::AnyBuffer x, ffi::Token, TokenOut, int64_t comm, int64_t dest, int64_t tag) {
  CallInfo info = Describe("send", x);
  info.dest = static_cast<int>(dest);
  info.send_tag = static_cast<int>(tag);
  return Run(info, comm, [&](const Comm& c) {
    return mpi::Send(x.untyped_data(), x.element_count(), TypeOf(x), info.dest, info.send_tag,
                     c.handle);
  });
}

ffi::Error Recv(ffi::AnyBuffer x, ffi::Token, Out y, TokenOut, int64_t comm, int64_t source,
                int64_t tag, int64_t status) {
  CallInfo info = Describe("recv", x);
  info.source = static_cast<int>(source);
  info.recv_tag = static_cast<int>(tag);
  return Run(info, comm, [&](const Comm& c) {
    MPI_Status st;
    const int code = mpi::Recv(y->untyped_data(), y->element_count(), TypeOf(x), info.source,
                               info.recv_tag, c.handle, &st);
    if (code == MPI_SUCCESS) FinishReceive(st, *y, status);
    return code;
  });
}

ffi::Error Sendrecv(ffi::AnyBuffer send, ffi::AnyBuffer recv, ffi::Token, Out y, TokenOut,
                    int64_t comm, int64_t source, int64_t dest, int64_t sendtag, int64_t recvtag,
                    int64_t status) {
  CallInfo info = Describe("sendrecv", send);
  info.source = static_cast<int>(source);
  info.dest = static_cast<int>(dest);
  info.send_tag = static_cast<int>(sendtag);
  info.recv_tag = static_cast<int>(recvtag);
  info.recv_dtype = ElementOf(recv.element_type()).name;
  info.recv_shape = ShapeOf(recv);
  return Run(info, comm, [&](const Comm& c) {
    // The output aliases recv; MPI forbids it to overlap send (XLA copies an
    // operand passed twice, but this does not rely on it).
    std::vector<char> copy;
    const void* source_data = send.untyped_data();
    if (send.size_bytes() > 0 && source_data == y->untyped_data()) {
      copy.assign(static_cast<const char*>(source_data),
                  static_cast<const char*>(source_data) + send.size_bytes());
      source_data = copy.data();
    }
    MPI_Status st;
    const int code = mpi::Sendrecv(source_data, send.element_count(), TypeOf(send), info.dest,
                                   info.send_tag, y->untyped_data(), y->element_count(),
                                   TypeOf(recv), info.source, info.recv_tag, c.handle, &st);
    if (code == MPI_SUCCESS) FinishReceive(st, *y, status);
    return code;
  });
}

// Binding prefixes: (x, token) -> (y, token) and (x, token) -> token, attributes after.
auto Unary() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Token>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
      .Attr<int64_t>("comm");
}

XLA_FFI_DEFINE_HANDLER(kAllreduce, Allreduce, Unary().Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER(kReduce, Reduce, Unary().Attr<int64_t>("op").Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER(
    kScan, Scan, Unary().Attr<int64_t>("op").Attr<int64_t>("reverse").Attr<int64_t>("exclusive"));
XLA_FFI_DEFINE_HANDLER(kBcast, Bcast, Unary().Attr<int64_t>("root").Attr<int64_t>("accumulate"));
XLA_FFI_DEFINE_HANDLER(kGather, Gather, Unary().Attr<int64_t>("root").Attr<int64_t>("identity"));
XLA_FFI_DEFINE_HANDLER(kScatter, Scatter,
                       Unary().Attr<int64_t>("root").Attr<int64_t>("accumulate"));
XLA_FFI_DEFINE_HANDLER(kAllgather, Allgather, Unary());
XLA_FFI_DEFINE_HANDLER(kAlltoall, Alltoall, Unary());
XLA_FFI_DEFINE_HANDLER(kBarrier, Barrier,
                       ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>().Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER(kSend, Send,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Token>()
                           .Ret<ffi::Token>()
                           .Attr<int64_t>("comm")
                           .Attr<int64_t>("dest")
                           .Attr<int64_t>("tag"));
XLA_FFI_DEFINE_HANDLER(
    kRecv, Recv, Unary().Attr<int64_t>("source").Attr<int64_t>("tag").Attr<int64_t>("status"));
XLA_FFI_DEFINE_HANDLER(kSendrecv, Sendrecv,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Token>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::Token>()
                           .Attr<int64_t>("comm")
                           .Attr<int64_t>("source")
                           .Attr<int64_t>("dest")
                           .Attr<int64_t>("sendtag")
                           .Attr<int64_t>("recvtag")
                           .Attr<int64_t>("status"));

}  // namespace

std::vector<std::pair<const char*, XLA_FFI_Handler*>> CpuHandlers() {
  return {{"mpijax_allreduce", kAllreduce}, {"mpijax_reduce", kReduce},
          {"mpijax_scan", kScan},           {"mpijax_bcast", kBcast},
          {"mpijax_gather", kGather},       {"mpijax_scatter", kScatter},
          {"mpijax_allgather", kAllgather}, {"mpijax_alltoall", kAlltoall},
          {"mpijax_barrier", kBarrier},     {"mpijax_send", kSend},
          {"mpijax_recv", kRecv},           {"mpijax_sendrecv", kSendrecv}};
}

}  // namespace mpijax
