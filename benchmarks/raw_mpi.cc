// OSU-style timings of the benchmarked operations, straight from MPI: the
// limit that the JAX bindings are compared with. For each operation and size:
// one warm-up repetition, then `reps` repetitions of `iters(size)` calls
// between barriers; a repetition's time is the slowest rank's. Prints one JSON
// line per case on rank 0: microseconds per operation, min/median/max over
// repetitions.
//
// The data flows as in the JAX loops of worker.py, since that costs time of
// its own: a buffer that one rank has just written is slower for the other to
// read than one it only reads (several times slower on the benchmark machine
// at 64 KiB). So results feed the next call: reductions in place, the
// ping-pong echoes what it received, sendrecv alternates two buffers, and
// allgather/alltoall write one element of the result back into the input.
// MPI runs at MPI_THREAD_MULTIPLE, the level mpi4py (and so every Python
// binding) asks for.
//   raw_mpi REPS SIZE [SIZE...]   (sizes in bytes)
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

int Iterations(long bytes) { return static_cast<int>(std::clamp(268435456L / bytes, 40L, 10000L)); }

struct Case {
  const char* op;
  std::function<void()> call;  // one operation (a round trip for pingpong: counted as two)
  double per_call;             // operations per call
};

}  // namespace

int main(int argc, char** argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int reps = std::atoi(argv[1]);
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (int a = 2; a < argc; ++a) {
    const long bytes = std::atol(argv[a]);
    const int n = static_cast<int>(bytes / 4);  // float32 elements
    std::vector<float> x(static_cast<size_t>(n) * size, 1.0f), y(x.size(), 0.0f);
    long step = 0;
    // One element of the result back into the input, at a moving index.
    const auto feed_back = [&] {
      ++step;
      x[step % x.size()] = y[(step * 7) % y.size()];
    };
    const Case cases[] = {
        {"allreduce",
         [&] { MPI_Allreduce(MPI_IN_PLACE, x.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }, 1},
        {"bcast", [&] { MPI_Bcast(x.data(), n, MPI_FLOAT, 0, MPI_COMM_WORLD); }, 1},
        {"allgather",
         [&] {
           MPI_Allgather(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
           feed_back();
         },
         1},
        {"alltoall",
         [&] {
           MPI_Alltoall(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
           feed_back();
         },
         1},
        {"sendrecv",
         [&] {
           MPI_Sendrecv(x.data(), n, MPI_FLOAT, next, 0, y.data(), n, MPI_FLOAT, prev, 0,
                        MPI_COMM_WORLD, MPI_STATUS_IGNORE);
           MPI_Sendrecv(y.data(), n, MPI_FLOAT, next, 0, x.data(), n, MPI_FLOAT, prev, 0,
                        MPI_COMM_WORLD, MPI_STATUS_IGNORE);
         },
         2},
        {"pingpong",
         [&] {
           if (rank == 0) {
             MPI_Send(x.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
             MPI_Recv(x.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
           } else if (rank == 1) {
             MPI_Recv(x.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
             MPI_Send(x.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
           }
         },
         2},
    };
    const int iters = Iterations(bytes);
    for (const Case& c : cases) {
      std::vector<double> times;
      for (int r = 0; r <= reps; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double start = MPI_Wtime();
        for (int i = 0; i < iters; ++i) c.call();
        double mine = (MPI_Wtime() - start) / (iters * c.per_call), slowest;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (r > 0) times.push_back(slowest * 1e6);  // repetition 0 warms up
      }
      std::sort(times.begin(), times.end());
      if (rank == 0) {
        std::printf(
            "{\"impl\": \"raw MPI (C++)\", \"op\": \"%s\", \"bytes\": %ld, \"min\": %.4f, "
            "\"median\": %.4f, \"max\": %.4f}\n",
            c.op, bytes, times.front(), times[times.size() / 2], times.back());
        std::fflush(stdout);
      }
    }
  }
  MPI_Finalize();
  return 0;
}
