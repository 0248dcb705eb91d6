// MPIJAX_DEBUG=1 (or MPI4JAX_DEBUG=1, read at import): one line per MPI call
// per rank on stderr, written from C++ so that no GIL is taken on XLA's threads.
#pragma once

#include "call.h"

namespace mpijax {

bool LogEnabled();
void SetLogEnabled(bool enabled);

// `outcome`: null for a call that ran, else what happened instead
// ("FAILED", "REFUSED by check mode").
void LogCall(const CallInfo& call, int rank, double seconds, const char* outcome);

// Counts of handler calls, always on (two atomic updates a call): the token
// chain must keep at most one MPI call in flight per process, and
// max_in_flight shows whether it did. device_pointer_calls counts the calls
// that handed MPI device memory (CUDA-aware mode), which shows that the mode
// took effect rather than staging.
struct CallStats {
  int64_t calls = 0;
  int64_t in_flight = 0;
  int64_t max_in_flight = 0;
  int64_t device_pointer_calls = 0;
};
CallStats Stats();
void ResetStats();  // zeroes calls, max_in_flight and device_pointer_calls
void CountDevicePointerCall();

// Marks one handler call in flight for its lifetime.
class InFlight {
 public:
  InFlight();
  ~InFlight();
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
};

}  // namespace mpijax
