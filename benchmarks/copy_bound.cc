// The bound of mpijax's staged GPU path: what one operation costs at least
// when its data goes from the device to pinned host memory and back, on one
// stream, as the staged handlers copy it (MPI itself not counted). Prints one
// JSON line per size, like raw_mpi: the microseconds of one round trip in
// each repetition of iters(size).
//   copy_bound REPS SIZE [SIZE...]   (sizes in bytes)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void Check(cudaError_t status) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "copy_bound: %s\n", cudaGetErrorString(status));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::atoi(argv[1]);
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int a = 2; a < argc; ++a) {
    const size_t bytes = std::strtoull(argv[a], nullptr, 10);
    const int iters = static_cast<int>(std::clamp<size_t>((size_t{1} << 28) / bytes, 40, 10000));
    void *device, *host;
    Check(cudaMalloc(&device, bytes));
    Check(cudaHostAlloc(&host, bytes, cudaHostAllocPortable));
    std::vector<double> times;
    for (int r = 0; r <= reps; ++r) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) {
        Check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
        Check(cudaStreamSynchronize(stream));  // the handler waits before MPI reads
        Check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
      }
      Check(cudaStreamSynchronize(stream));
      const std::chrono::duration<double, std::micro> elapsed =
          std::chrono::steady_clock::now() - start;
      if (r > 0) times.push_back(elapsed.count() / iters);  // repetition 0 warms up
    }
    std::printf(
        "{\"impl\": \"device-host-device copy (C++)\", \"op\": \"copy\", \"bytes\": %zu, "
        "\"times\": [",
        bytes);
    for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.4f", i ? ", " : "", times[i]);
    std::printf("]}\n");
    std::fflush(stdout);
    Check(cudaFree(device));
    Check(cudaFreeHost(host));
  }
  return 0;
}
