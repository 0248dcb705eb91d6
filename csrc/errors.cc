#include "errors.h"

#include <cstdio>
#include <string>
#include <utility>

#include "mpi_calls.h"
#include "tags.h"

namespace ffi = xla::ffi;

namespace mpijax {
namespace {

std::string Rank(int rank) {
  return rank == MPI_ANY_SOURCE ? "any rank" : "rank " + std::to_string(rank);
}

// Whom a call that timed out was waiting for.
std::string Awaited(const CallInfo& call, const Comm& comm) {
  if (!PointToPoint(call)) {
    std::string text = "the other ranks of its communicator (size " + std::to_string(comm.size);
    if (call.root != kUnset) text += ", root " + std::to_string(call.root);
    text += ") to call " + std::string(call.op);
    // Open MPI 4.1 leaves a nonblocking collective over arrays of different
    // sizes incomplete, with no error: then every rank did call it.
    if (call.bytes > 0)
      text += " (or for MPI to finish it: MPIJAX_CHECK=1 tells whether the ranks disagree)";
    return text;
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

// What a point-to-point call was doing: "receiving from rank 1 with tag 3",
// "sending to rank 2 with tag 0", or both.
std::string Messages(const CallInfo& call) {
  std::string text;
  if (call.source != kUnset) {
    text = "receiving from " + Rank(call.source) + " with tag " + TagName(call.recv_tag);
  }
  if (call.dest != kUnset) {
    text += (text.empty() ? "" : " and ") + std::string("sending to ") + Rank(call.dest) +
            " with tag " + TagName(call.send_tag);
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

// What usually causes an error of class `name`, where a user can act on it:
// a message too long for its receive comes from arrays of different sizes
// (or from another collective on some rank), and under vmap of a derivative
// from a receive buffer that vmap does not batch while the sender's array is
// batched (docs/autodiff.md, rule 2), a collective's off its root too.
std::string Hint(const CallInfo& call, const std::string& name) {
  if (name != "MPI_ERR_TRUNCATE") return "";
  if (!Collective(call)) {
    const std::string cotangent =
        IsDerivativeTag(call.recv_tag)
            ? ", or this is a cotangent going back to the sender of a message that was shorter "
              "than its receive buffer, transposed without having run (jax.linear_transpose, "
              "which cannot know the message's size; jax.grad, vjp and jacrev run the receive "
              "first and send back as many elements as it took)"
            : "";
    return ". The message is longer than the array receiving it: either the sender's array is "
           "larger (or of a wider dtype), or, under jax.vmap of a derivative, the sender's array "
           "is batched and this receive's buffer is not (a constant such as jnp.zeros(...); "
           "receive into one computed from the batched value, see docs/autodiff.md, rule 2)" +
           cotangent;
  }
  const std::string batched =
      call.root == kUnset ? ""
                          : " (under jax.vmap of a derivative, also where one rank's array is "
                            "batched and another's is not: a constant such as jnp.zeros_like(x) "
                            "off the root; pass one computed from the batched value, see "
                            "docs/autodiff.md, rule 2)";
  return ". The ranks' arrays differ in size" + batched +
         ", or the ranks called different collectives (MPIJAX_CHECK=1 names the difference)";
}

}  // namespace

std::string RankOf(const Comm& comm) {
  return "rank " + std::to_string(comm.rank) + " of " + std::to_string(comm.size);
}

ffi::Error Failure(const CallInfo& call, const Comm& comm, int code) {
  const std::string op = "mpijax." + std::string(call.op);
  const std::string failed = op + " failed on " + RankOf(comm) + ": ";
  if (code == mpi::kTimedOut) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", mpi::Timeout());
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      op + " on " + RankOf(comm) + " timed out after " + seconds +
                          " s (MPIJAX_TIMEOUT) waiting for " + Awaited(call, comm) +
                          ". The call was abandoned unfinished: end the program rather than use "
                          "MPI further.");
  }
  // Point-to-point calls name the message, narrowed to the one at fault
  // where a call makes several.
  const std::string about = PointToPoint(call) ? " (" + Messages(call) + ")" : "";
  if (code == mpi::kWrongSize) {
    return ffi::Error::Internal(failed + "a message shorter than its receive" + about +
                                "; each message must fill its receive exactly, byte for byte "
                                "(the same number of elements of the same dtype, or of a dtype "
                                "of the same width, whose bits are taken as they are)");
  }
  if (code == mpi::kPartElement) {
    const char* dtype = call.recv_dtype ? call.recv_dtype : call.dtype;
    return ffi::Error::Internal(
        failed + "the message ends inside an element of the " + dtype + " array receiving it" +
        about +
        ": the sender's array has another dtype, and MPI does not convert it (with x64 on, "
        "jnp.zeros(n) is float64); give the receive buffer the sender's dtype");
  }
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  // Libraries word their strings differently (Open MPI starts with the class
  // name, MPICH does not): lead with the standard class name either way.
  std::string message(text, length);
  const std::string name = ErrorClassName(code);
  if (message.rfind(name, 0) != 0) message = name + ": " + message;
  return ffi::Error::Internal(failed + message + " (MPI error code " + std::to_string(code) + ")" +
                              about + Hint(call, name));
}

ffi::Error Abandoned(const CallInfo& call, const Comm& comm, const std::string& abandoned) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "mpijax." + std::string(call.op) + " on " + RankOf(comm) + ": an earlier " +
                        abandoned +
                        " on this communicator timed out unfinished (MPIJAX_TIMEOUT), and MPI "
                        "cannot cancel a collective: it may still run, into memory that is no "
                        "longer its, so mpijax makes no more calls on this communicator. End the "
                        "program.");
}

}  // namespace mpijax
