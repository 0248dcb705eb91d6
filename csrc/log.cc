#include "log.h"

#include <mpi.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "reductions.h"

namespace mpijax {
namespace {

std::atomic<bool> enabled{false};  // set at import from MPIJAX_DEBUG (runtime.py)
std::atomic<int64_t> calls{0}, in_flight{0}, max_in_flight{0}, device_pointer_calls{0};

// MPI's special values by name: their numbers differ between MPI libraries.
std::string Peer(int64_t rank) {
  return rank == MPI_PROC_NULL ? "null" : rank == MPI_ANY_SOURCE ? "any" : std::to_string(rank);
}

void Append(std::string& line, const char* key, int value, bool tag = false) {
  if (value == kUnset) return;
  line += " | ";
  line += key;
  line += ' ';
  line += tag ? (value == MPI_ANY_TAG ? "any" : std::to_string(value)) : Peer(value);
}

void Append(std::string& line, const char* key, const int64_t* ranks, int64_t n) {
  if (n == 0) return;
  line += " | ";
  line += key;
  for (int64_t i = 0; i < n; ++i) line += ' ' + Peer(ranks[i]);
}

}  // namespace

bool LogEnabled() { return enabled.load(std::memory_order_relaxed); }
void SetLogEnabled(bool on) { enabled.store(on, std::memory_order_relaxed); }

void LogCall(const CallInfo& call, int rank, double seconds, const char* outcome) {
  std::string line = "mpijax r" + std::to_string(rank) + " | " + call.op;
  Append(line, "root", call.root);
  if (call.reduction != kUnset) line += " | op " + ReductionLabel(call.reduction);
  Append(line, "dest", call.dest);
  Append(line, "source", call.source);
  Append(line, "sendtag", call.send_tag, true);
  Append(line, "recvtag", call.recv_tag, true);
  Append(line, "to", call.to, call.num_to);
  Append(line, "from", call.from, call.num_from);
  char tail[128];
  std::snprintf(tail, sizeof tail, " | %lld x %s | %lld B | %.2f us%s%s\n",
                static_cast<long long>(call.count), call.dtype, static_cast<long long>(call.bytes),
                seconds * 1e6, outcome ? " | " : "", outcome ? outcome : "");
  line += tail;
  // One write per line, so lines from different threads never interleave.
  std::fputs(line.c_str(), stderr);
}

CallStats Stats() {
  return {calls.load(), in_flight.load(), max_in_flight.load(), device_pointer_calls.load()};
}

void ResetStats() {
  calls = 0;
  max_in_flight = in_flight.load();
  device_pointer_calls = 0;
}

void CountDevicePointerCall() { device_pointer_calls.fetch_add(1, std::memory_order_relaxed); }

InFlight::InFlight() {
  calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = in_flight.fetch_add(1) + 1;
  int64_t seen = max_in_flight.load();
  while (now > seen && !max_in_flight.compare_exchange_weak(seen, now)) {
  }
}

InFlight::~InFlight() { in_flight.fetch_sub(1); }

}  // namespace mpijax
