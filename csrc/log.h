// MPIJAX_DEBUG=1 (or MPI4JAX_DEBUG=1): one line per MPI call per rank on
// stderr, written from C++ so that no GIL is taken on XLA's threads.
#pragma once

#include <cstdint>

namespace mpijax {

bool LogEnabled();
void SetLogEnabled(bool enabled);

inline constexpr int kUnset = -1000000;  // a field that does not apply to the call

struct CallInfo {
  const char* op;
  int64_t count = 0;
  const char* dtype = "-";
  int64_t bytes = 0;
  int root = kUnset;
  int dest = kUnset;
  int source = kUnset;
  int send_tag = kUnset;
  int recv_tag = kUnset;
};

void LogCall(const CallInfo& call, int rank, double seconds, int error_code);

}  // namespace mpijax
