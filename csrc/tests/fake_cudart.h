// A stand-in for the CUDA runtime, so that the CUDA memory policy's logic is
// tested on machines without a GPU: "device" memory is host memory, copies
// happen at once, and the calls that matter are counted. A test can make the
// next pinned allocation fail.
#pragma once

#include <cuda_runtime_api.h>

namespace fake_cudart {

struct Counts {
  int pinned_allocs = 0;
  int pinned_frees = 0;
  int to_host = 0;    // device-to-host copies
  int to_device = 0;  // host-to-device copies
  int stream_syncs = 0;
  int event_waits = 0;
};

Counts& counts();
void Reset();  // zeroes the counts
void FailNextPinnedAlloc();

}  // namespace fake_cudart
