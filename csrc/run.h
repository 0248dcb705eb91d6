// What every handler does around its MPI call (Run), and the steps that
// several handlers share. Included by handlers.cc only: these are templates
// over the memory policy (memory.h).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "check.h"
#include "elements.h"
#include "errors.h"
#include "handlers.h"
#include "log.h"
#include "mpi_calls.h"
#include "reductions.h"
#include "registry.h"
#include "tags.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax {

// Calls whose data may stay in device memory for a CUDA-aware MPI (memory.h).
inline constexpr auto kNoHostAccess = [](const Comm&) { return false; };

// `call(comm, memory)` takes its views from `memory`, makes the MPI call and
// returns its error code; it reads peers from `info`, which `route(memory)`
// may fill in first and check mode may narrow. `host_access(comm)` says
// whether the call needs its data in host memory (see memory.h).
template <class Memory, class HostAccess, class RouteStep, class Call>
xla::ffi::Error Run(typename Memory::Context context, CallInfo& info, int64_t comm_id,
                    HostAccess host_access, RouteStep route, Call&& call) {
  Comm comm{};
  switch (LookupComm(comm_id, &comm.handle)) {
    case Found::kYes:
      break;
    case Found::kGone:
      return xla::ffi::Error::InvalidArgument(
          "mpijax." + std::string(info.op) + ": its communicator (id " + std::to_string(comm_id) +
          ") is gone: freed since the program was traced (a compiled program runs only while its "
          "communicator lives), or never made in this process");
    case Found::kOtherSize:
      MPI_Comm_size(comm.handle, &comm.size);
      return xla::ffi::Error::InvalidArgument(
          "mpijax." + std::string(info.op) + ": the program was made for a communicator of size " +
          std::to_string(comm_id >> kIndexBits) + ", and its id names one of size " +
          std::to_string(comm.size) +
          " here: the program comes from another job (jax.export), which named its "
          "communicators by the order in which it first used them; use the same communicators "
          "in the same order before calling it");
  }
  MPI_Comm_rank(comm.handle, &comm.rank);
  MPI_Comm_size(comm.handle, &comm.size);
  if (const std::string abandoned = AbandonedBy(comm_id); !abandoned.empty()) {
    return Abandoned(info, comm, abandoned);
  }
  if (info.counts && info.num_counts != comm.size) {
    return xla::ffi::Error::InvalidArgument(
        "mpijax." + std::string(info.op) + ": " + std::to_string(info.num_counts) +
        " counts for a communicator of " + std::to_string(comm.size) + " ranks");
  }
  // With the watchdog on, collectives run in their nonblocking forms, which
  // may be abandoned (memory.h).
  Memory memory(context, host_access(comm), Collective(info) && mpi::Timeout() > 0);
  route(memory);
  InFlight in_flight;
  const auto start = std::chrono::steady_clock::now();
  std::string mismatch;
  const CallInfo asked = info;  // for the log: check mode narrows the peers it refuses
  int code = CheckEnabled() && info.checked ? Agree(info, comm.handle, &mismatch) : MPI_SUCCESS;
  // A collective that ranks disagree on must not run; point-to-point calls
  // run what still matches (check.h).
  if (code == MPI_SUCCESS && (mismatch.empty() || PointToPoint(info))) code = call(comm, memory);
  if (code == MPI_SUCCESS) memory.Finish();
  if (LogEnabled()) {
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // The call fills in `info` as it runs (a wait its messages, a failure the
    // one at fault: Blame, in handlers.cc).
    LogCall(code || mismatch.empty() ? info : asked, comm.rank, elapsed.count(),
            code               ? "FAILED"
            : mismatch.empty() ? nullptr
                               : "REFUSED by check mode");
  }
  if (code == mpi::kTimedOut && Collective(info)) {
    memory.Abandon();
    AbandonComm(comm_id, info.op);
  }
  if (code != MPI_SUCCESS) return Failure(info, comm, code);
  if (const std::string error = memory.error(); !error.empty()) {
    return xla::ffi::Error::Internal("mpijax." + std::string(info.op) + " on " + RankOf(comm) +
                                     ": " + error);
  }
  if (!mismatch.empty()) return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition, mismatch);
  return xla::ffi::Error::Success();
}

template <class Memory, class HostAccess, class Call>
xla::ffi::Error Run(typename Memory::Context context, CallInfo& info, int64_t comm_id,
                    HostAccess host_access, Call&& call) {
  return Run<Memory>(
      context, info, comm_id, host_access, [](Memory&) {}, call);
}

// A call's route (handlers.h); after a memory error, when it cannot be read,
// the route of no message.
template <class Memory>
Envelope ReadRoute(Memory& m, const xla::ffi::AnyBuffer& route) {
  Envelope e{};
  m.Copy(&e, m.In(route), sizeof e);
  return m.error().empty() ? e : NoRoute();
}

// Fills in a routed peer and its tag from `route` (see kRouted). Only
// derivatives are routed, so the tag becomes a derivative tag (tags.h). A
// message from MPI_PROC_NULL is answered to MPI_PROC_NULL, and so is every
// routed call after a memory error.
template <class Memory>
void Route(Memory& m, const xla::ffi::AnyBuffer& route, int* peer, int* tag) {
  if (*peer != kRouted) return;
  const MPI_Status status = ReadRoute(m, route).status;
  *peer = status.MPI_SOURCE;
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

// The bytes a receive took, from its status; nothing where MPI cannot say.
inline std::optional<size_t> ReceivedBytes(const MPI_Status& status) {
  MPI_Count received = 0;
  if (MPI_Get_elements_x(&status, MPI_BYTE, &received) != MPI_SUCCESS || received < 0) {
    return std::nullopt;
  }
  return static_cast<size_t>(received);
}

// Copies `parts` runs of `size` bytes, run i from `from + i * from_step` to
// `to + i * to_step`.
template <class Memory>
void CopyParts(Memory& m, char* to, size_t to_step, const char* from, size_t from_step, size_t size,
               size_t parts) {
  for (size_t i = 0; i < parts; ++i) m.Copy(to + i * to_step, from + i * from_step, size);
}

// A receive leaves unspecified what a shorter message did not fill (or all of
// the buffer for MPI_PROC_NULL); zero it so results are deterministic. Under
// vmap a message is `parts` equal parts, one per batch element, as is its
// buffer: each part of a shorter one goes to the front of its own place, as
// each element's own receive would have put it (where the parts are whole;
// else the message is one part). The envelope (the route of the receive's
// derivatives, and how Python fills an MPI.Status after an eager call) gets
// the status and the bytes of each part; the address of a status that a
// compiled program writes gets the status. `out` is `y`'s memory (m.Out).
// Returns an MPI error code:
// kPartElement for a message of another dtype that leaves an element of the
// buffer half written (MPI carries no types; one that fills whole elements
// passes unseen, as documented).
template <class Memory>
int FinishReceive(Memory& m, const MPI_Status& status, void* out, const xla::ffi::AnyBuffer& y,
                  int64_t parts, void* envelope, int64_t status_address) {
  const std::optional<size_t> got = ReceivedBytes(status);
  const size_t element_bytes = xla::ffi::ByteWidth(y.element_type());
  if (got && element_bytes > 1 && *got % element_bytes != 0) return mpi::kPartElement;
  const size_t bytes = y.size_bytes();
  const auto batch = static_cast<size_t>(std::max<int64_t>(parts, 1));
  const bool whole = got && *got % batch == 0 && bytes % batch == 0;
  const size_t n = whole ? batch : 1;
  if (got && *got < bytes) {
    char* to = static_cast<char*>(out);
    if (n > 1) {
      std::vector<char> message(*got);
      m.Copy(message.data(), out, *got);
      CopyParts(m, to, bytes / n, message.data(), *got / n, *got / n, n);
    }
    for (size_t i = 0; i < n; ++i) m.Zero(to + i * (bytes / n) + *got / n, (bytes - *got) / n);
  }
  Envelope e;
  std::memset(&e, 0, sizeof e);
  e.status = status;
  e.part_bytes = whole ? static_cast<int64_t>(*got / n) : -1;
  m.Copy(envelope, &e, sizeof e);
  if (status_address) *reinterpret_cast<MPI_Status*>(status_address) = status;
  return MPI_SUCCESS;
}

// A transposed receive (`answers`: its data's parts; 0 for any other send)
// sends back a cotangent as long as the message that the receive took, not
// as its buffer, since the sender's transposed send receives into an array
// of the size it sent: the front of each part, as long as the message's
// parts (the route's Envelope), where FinishReceive put them. A route that
// does not know (-1: Python's unrouted(), a receive transposed without having
// run) answers with the whole buffer. The bytes to send; `info`, which check
// mode and the log read, is narrowed to them.
template <class Memory>
size_t Answered(Memory& m, const xla::ffi::AnyBuffer& route, int64_t answers, CallInfo& info) {
  const auto bytes = static_cast<size_t>(info.bytes);
  if (answers <= 0 || info.count == 0) return bytes;
  const auto n = static_cast<size_t>(answers);
  const int64_t part = ReadRoute(m, route).part_bytes;
  const size_t width = bytes / static_cast<size_t>(info.count);
  if (part < 0 || bytes % n != 0 || static_cast<size_t>(part) >= bytes / n ||
      static_cast<size_t>(part) % width != 0) {
    return bytes;
  }
  const size_t answer = static_cast<size_t>(part) * n;
  info.count = static_cast<int64_t>(answer / width);
  info.bytes = static_cast<int64_t>(answer);
  info.shape = Shape{1, {info.count}};
  return answer;
}

// The view of `data` (`bytes` long) that sends its `answer` bytes (Answered):
// the parts' fronts packed into `packed` where there are several.
template <class Memory>
const void* Answer(Memory& m, const void* data, size_t bytes, size_t answer, int64_t answers,
                   std::vector<char>* packed) {
  if (answer == bytes || answers <= 1) return data;
  const auto n = static_cast<size_t>(answers);
  packed->resize(answer);
  CopyParts(m, packed->data(), answer / n, static_cast<const char*>(data), bytes / n, answer / n,
            n);
  return packed->data();
}

}  // namespace mpijax
