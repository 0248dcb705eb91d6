// OSU-style timings of the benchmarked operations, straight from MPI: the C++
// reference that the JAX bindings are compared with. It is not a lower bound:
// mpi4py on NumPy arrays beats it at some sizes (NumPy's buffers sit on huge
// pages, this program's std::vector on 4 KiB pages). For each operation and size:
// one warm-up repetition, then `reps` repetitions of `iters(size)` calls
// between barriers; a repetition's time is the slowest rank's. Prints one JSON
// line per case on rank 0: each repetition's microseconds per operation
// (run.py summarises them).
//
// The data flows as in the JAX loops of worker.py, since that costs time of
// its own: a buffer that one rank has just written is slower for the other to
// read than one it only reads (several times slower on the benchmark machine
// at 64 KiB). So results feed the next call: reductions in place, the
// ping-pong echoes what it received, sendrecv alternates two buffers,
// sendrecv_inplace receives into the buffer it sends (MPI_Sendrecv_replace),
// and allgather/alltoall write one element of the result back into the input.
// MPI runs at MPI_THREAD_MULTIPLE, the level mpi4py (and so every Python
// binding) asks for.
//   raw_mpi REPS SIZE [SIZE...]   every operation at these sizes (bytes)
//   raw_mpi REPS serve            the cases named on standard input, one
//                                 "OP BYTES" line each (worker.py --serve)
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

const char* const kOps[] = {"allreduce",        "bcast",   "allgather", "alltoall", "sendrecv",
                            "sendrecv_inplace", "pingpong"};

int Iterations(long bytes) { return static_cast<int>(std::clamp(268435456L / bytes, 40L, 10000L)); }

// reduce_scatter and exscan on n floats a rank (reduce_scatter: a block of n
// for each rank), and the v-variants (varied.py) with uneven counts: rank r
// has counts[r] = n (r + 1) / size floats (at least 1), the largest block n;
// alltoallv sends counts[(r + j) % size] floats from rank r to rank j.
bool Varied(const std::string& op, int n, int rank, int size, std::vector<float>& x,
            std::vector<float>& y, const std::function<void()>& feed_back,
            std::function<void()>* call) {
  static std::vector<int> counts, offsets, sends, send_offsets, recvs, recv_offsets;
  const auto layout = [size](const std::vector<int>& c, std::vector<int>* at) {
    at->assign(static_cast<size_t>(size), 0);
    for (int r = 1; r < size; ++r) (*at)[r] = (*at)[r - 1] + c[r - 1];
  };
  counts.assign(static_cast<size_t>(size), 0);
  sends.assign(counts.size(), 0);
  recvs.assign(counts.size(), 0);
  for (int r = 0; r < size; ++r) counts[r] = std::max(static_cast<int>(1L * n * (r + 1) / size), 1);
  for (int j = 0; j < size; ++j) {
    sends[j] = counts[(rank + j) % size];
    recvs[j] = counts[(j + rank) % size];
  }
  layout(counts, &offsets);
  layout(sends, &send_offsets);
  layout(recvs, &recv_offsets);
  const int mine = counts[rank];
  if (op == "reduce_scatter") {
    *call = [&, n, feed_back] {
      MPI_Reduce_scatter_block(x.data(), y.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "exscan") {
    *call = [&, n] { MPI_Exscan(MPI_IN_PLACE, x.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
  } else if (op == "allgatherv") {
    *call = [&, mine, feed_back] {
      MPI_Allgatherv(x.data(), mine, MPI_FLOAT, y.data(), counts.data(), offsets.data(), MPI_FLOAT,
                     MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "gatherv") {
    *call = [&, mine, feed_back] {
      MPI_Gatherv(x.data(), mine, MPI_FLOAT, y.data(), counts.data(), offsets.data(), MPI_FLOAT, 0,
                  MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "scatterv") {
    *call = [&, mine, feed_back] {
      MPI_Scatterv(x.data(), counts.data(), offsets.data(), MPI_FLOAT, y.data(), mine, MPI_FLOAT, 0,
                   MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "alltoallv") {
    *call = [&, feed_back] {
      MPI_Alltoallv(x.data(), sends.data(), send_offsets.data(), MPI_FLOAT, y.data(), recvs.data(),
                    recv_offsets.data(), MPI_FLOAT, MPI_COMM_WORLD);
      feed_back();
    };
  } else {
    return false;
  }
  return true;
}

// Times `op` on messages of `bytes` and prints its line on rank 0.
void TimeCase(const std::string& op, long bytes, int reps) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const int n = static_cast<int>(bytes / 4);  // float32 elements
  std::vector<float> x(static_cast<size_t>(n) * size, 1.0f), y(x.size(), 0.0f);
  long step = 0;
  // One element of the result back into the input, at a moving index.
  const auto feed_back = [&] {
    ++step;
    x[step % x.size()] = y[(step * 7) % y.size()];
  };
  std::function<void()> call;  // one operation, or two for sendrecv and pingpong
  double per_call = 1;
  if (op == "allreduce") {
    call = [&] { MPI_Allreduce(MPI_IN_PLACE, x.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
  } else if (op == "bcast") {
    call = [&] { MPI_Bcast(x.data(), n, MPI_FLOAT, 0, MPI_COMM_WORLD); };
  } else if (op == "allgather") {
    call = [&] {
      MPI_Allgather(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "alltoall") {
    call = [&] {
      MPI_Alltoall(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
      feed_back();
    };
  } else if (op == "sendrecv") {
    per_call = 2;
    call = [&] {
      MPI_Sendrecv(x.data(), n, MPI_FLOAT, next, 0, y.data(), n, MPI_FLOAT, prev, 0, MPI_COMM_WORLD,
                   MPI_STATUS_IGNORE);
      MPI_Sendrecv(y.data(), n, MPI_FLOAT, next, 0, x.data(), n, MPI_FLOAT, prev, 0, MPI_COMM_WORLD,
                   MPI_STATUS_IGNORE);
    };
  } else if (op == "sendrecv_inplace") {
    call = [&] {
      MPI_Sendrecv_replace(x.data(), n, MPI_FLOAT, next, 0, prev, 0, MPI_COMM_WORLD,
                           MPI_STATUS_IGNORE);
    };
  } else if (op == "pingpong") {
    per_call = 2;
    call = [&] {
      if (rank == 0) {
        MPI_Send(x.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(x.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (rank == 1) {
        MPI_Recv(x.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(x.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
      }
    };
  } else if (!Varied(op, n, rank, size, x, y, feed_back, &call)) {
    if (rank == 0) std::fprintf(stderr, "raw_mpi: unknown operation %s\n", op.c_str());
    return;
  }
  const int iters = Iterations(bytes);
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) call();
    double mine = (MPI_Wtime() - start) / (iters * per_call), slowest;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (r > 0) times.push_back(slowest * 1e6);  // repetition 0 warms up
  }
  if (rank == 0) {
    std::printf("{\"impl\": \"raw MPI (C++)\", \"op\": \"%s\", \"bytes\": %ld, \"times\": [",
                op.c_str(), bytes);
    for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.4f", i ? ", " : "", times[i]);
    std::printf("]}\n");
    std::fflush(stdout);
  }
}

// The next "OP BYTES" line of rank 0's standard input on every rank ("" at
// its end). The other ranks wait asleep, not spinning in MPI, so that an idle
// server leaves the cores to the one measuring.
std::string NextCase() {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  char line[256] = {};
  if (rank == 0) {
    std::string text;
    if (std::getline(std::cin, text)) std::strncpy(line, text.c_str(), sizeof line - 1);
    for (int r = 1; r < size; ++r) MPI_Send(line, sizeof line, MPI_CHAR, r, 7, MPI_COMM_WORLD);
    return line;
  }
  MPI_Request request;
  MPI_Irecv(line, sizeof line, MPI_CHAR, 0, 7, MPI_COMM_WORLD, &request);
  for (int done = 0; MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done;) {
    const timespec pause{0, 500000};
    nanosleep(&pause, nullptr);
  }
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int reps = std::atoi(argv[1]);
  if (argc > 2 && std::string(argv[2]) == "serve") {
    for (std::string line = NextCase(); !line.empty(); line = NextCase()) {
      char op[64];
      long bytes;
      if (std::sscanf(line.c_str(), "%63s %ld", op, &bytes) == 2) TimeCase(op, bytes, reps);
    }
  } else {
    for (int a = 2; a < argc; ++a) {
      for (const char* op : kOps) TimeCase(op, std::atol(argv[a]), reps);
    }
  }
  MPI_Finalize();
  return 0;
}
