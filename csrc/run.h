// What every handler does around its MPI call (Run), and the steps that
// several handlers share. Included by handlers.cc only: these are templates
// over the memory policy (memory.h).
#pragma once

#include <mpi.h>

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
  // With the watchdog on, collectives run in their nonblocking forms, whose
  // device buffers Open MPI's CUDA support does not take (it covers blocking
  // collectives only, and libnbc reduces on the host): staged then.
  Memory memory(context, host_access(comm) || (Collective(info) && mpi::Timeout() > 0));
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
  if (code == mpi::kTimedOut && Collective(info)) AbandonComm(comm_id, info.op);
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

// Fills in a routed peer and its tag from `route` (see kRouted). Only
// derivatives are routed, so the tag becomes a derivative tag (tags.h). A
// message from MPI_PROC_NULL is answered to MPI_PROC_NULL, and so is every
// routed call after a memory error, when the route cannot be read.
template <class Memory>
void Route(Memory& m, const xla::ffi::AnyBuffer& route, int* peer, int* tag) {
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
// the buffer for MPI_PROC_NULL); zero it so results are deterministic. Under
// vmap a message is `parts` equal parts, one per batch element, as is its
// buffer: each part of a shorter one goes to the front of its own place, as
// each element's own receive would have put it. The status goes to the
// envelope output (the route of the receive's derivatives, and how Python
// fills an MPI.Status after an eager call) and to the address of a status
// that a compiled program writes.
template <class Memory>
void FinishReceive(Memory& m, const MPI_Status& status, void* out, size_t bytes, int64_t parts,
                   void* envelope, int64_t status_address) {
  int received = 0;
  if (MPI_Get_count(&status, MPI_BYTE, &received) == MPI_SUCCESS && received >= 0 &&
      static_cast<size_t>(received) < bytes) {
    const size_t got = static_cast<size_t>(received);
    const size_t n = parts > 1 && got % parts == 0 && bytes % parts == 0 ? parts : 1;
    std::vector<char> message(n > 1 ? got : 0);
    if (n > 1) m.Copy(message.data(), out, got);
    char* to = static_cast<char*>(out);
    for (size_t i = n; i-- > 0;) {
      if (n > 1) m.Copy(to + i * (bytes / n), message.data() + i * (got / n), got / n);
      m.Zero(to + i * (bytes / n) + got / n, (bytes - got) / n);
    }
  }
  m.Copy(envelope, &status, sizeof status);
  if (status_address) *reinterpret_cast<MPI_Status*>(status_address) = status;
}

}  // namespace mpijax
