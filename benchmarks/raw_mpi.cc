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
// halo.py's cases, "halo_AxB_K" (Halo below), move K messages of SIZE bytes
// each and take max(iterations / K, 10) calls, as its JAX loops do.
//   raw_mpi REPS SIZE [SIZE...]   every operation at these sizes (bytes)
//   raw_mpi REPS serve            the cases named on standard input, one
//                                 "OP BYTES" line each (worker.py --serve)
//   raw_mpi REPS serve chained    the same, halo cases as K MPI_Sendrecv
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

// Halo cases as one MPI_Sendrecv per message rather than all at once: what
// chaining sendrecv costs in MPI itself, without JAX.
bool chained_halo = false;

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
    // MPI leaves rank 0's result undefined: a program sets it, here to the
    // identity that mpijax gives, so that rank 0 sends memory it has just
    // written, as mpijax's loop does (fresh_buffers.py: that costs more).
    *call = [&, n, rank] {
      MPI_Exscan(MPI_IN_PLACE, x.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      if (rank == 0) std::fill_n(x.begin(), n, 0.0f);
    };
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
  } else if (op == "ragged_alltoall") {
    // alltoallv's rows, with the counts learnt when the call runs: they
    // travel first (MPI_Alltoall), and the receive offsets follow from them.
    *call = [&, size, feed_back] {
      static std::vector<int> got, got_offsets;
      got.assign(static_cast<size_t>(size), 0);
      got_offsets.assign(got.size(), 0);
      MPI_Alltoall(sends.data(), 1, MPI_INT, got.data(), 1, MPI_INT, MPI_COMM_WORLD);
      for (int r = 1; r < size; ++r) got_offsets[r] = got_offsets[r - 1] + got[r - 1];
      MPI_Alltoallv(x.data(), sends.data(), send_offsets.data(), MPI_FLOAT, y.data(), got.data(),
                    got_offsets.data(), MPI_FLOAT, MPI_COMM_WORLD);
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

// The halo exchange of halo.py: "halo_AxB_K" names a periodic A x B
// Cartesian communicator (MPI_Cart_create, no reordering) and K messages of n
// floats. Message i goes in direction offsets[i] to the rank at coords +
// offset and comes from coords - offset, under tag i; the offsets follow
// mpijax.cart_neighbors (itertools.product((-1, 0, 1), repeat=2) order):
// K = 2 the two faces along the decomposed axis (the first of size > 1),
// K = 4 the four faces, K = 8 every offset, corners included. All receives,
// then all sends, then one MPI_Waitall (or, chained_halo, one MPI_Sendrecv
// per message, in order); the received strips are sent next time (the
// buffers swap), as the results of halo.py's loops are fed back.
bool Halo(const std::string& op, int n, int* fewer, std::function<void()>* call) {
  int dims[2], k;
  char end;
  if (std::sscanf(op.c_str(), "halo_%dx%d_%d%c", &dims[0], &dims[1], &k, &end) != 3) return false;
  // The previous halo case's communicator and buffers; one case at a time.
  static MPI_Comm cart = MPI_COMM_NULL;
  static std::vector<std::vector<float>> sent, received;
  static std::vector<int> sources, dests;
  static std::vector<MPI_Request> requests;
  if (cart != MPI_COMM_NULL) MPI_Comm_free(&cart);
  const int periods[2] = {1, 1};
  MPI_Cart_create(MPI_COMM_WORLD, 2, dims, periods, 0, &cart);
  int rank, coords[2];
  MPI_Comm_rank(cart, &rank);
  MPI_Cart_coords(cart, rank, 2, coords);
  const int decomposed = dims[0] > 1 ? 0 : 1;
  const auto neighbour = [&](int d0, int d1) {
    const int at[2] = {((coords[0] + d0) % dims[0] + dims[0]) % dims[0],
                       ((coords[1] + d1) % dims[1] + dims[1]) % dims[1]};
    int r;
    MPI_Cart_rank(cart, at, &r);
    return r;
  };
  sources.clear();
  dests.clear();
  for (int d0 = -1; d0 <= 1; ++d0) {
    for (int d1 = -1; d1 <= 1; ++d1) {
      const bool face = (d0 == 0) != (d1 == 0);
      const bool along = (decomposed == 0 ? d0 : d1) != 0;
      if ((d0 == 0 && d1 == 0) || (k < 8 && !face) || (k == 2 && !along)) continue;
      dests.push_back(neighbour(d0, d1));
      sources.push_back(neighbour(-d0, -d1));
    }
  }
  if (static_cast<int>(dests.size()) != k) {
    if (rank == 0) std::fprintf(stderr, "raw_mpi: %s: K must be 2, 4 or 8\n", op.c_str());
    return false;
  }
  sent.assign(static_cast<size_t>(k), std::vector<float>(static_cast<size_t>(n), 1.0f));
  received.assign(static_cast<size_t>(k), std::vector<float>(static_cast<size_t>(n), 0.0f));
  requests.assign(static_cast<size_t>(2 * k), MPI_REQUEST_NULL);
  *fewer = k;
  *call = [k, n] {
    if (chained_halo) {
      for (int i = 0; i < k; ++i) {
        MPI_Sendrecv(sent[i].data(), n, MPI_FLOAT, dests[i], i, received[i].data(), n, MPI_FLOAT,
                     sources[i], i, cart, MPI_STATUS_IGNORE);
      }
      sent.swap(received);
      return;
    }
    for (int i = 0; i < k; ++i) {
      MPI_Irecv(received[i].data(), n, MPI_FLOAT, sources[i], i, cart, &requests[i]);
    }
    for (int i = 0; i < k; ++i) {
      MPI_Isend(sent[i].data(), n, MPI_FLOAT, dests[i], i, cart, &requests[k + i]);
    }
    MPI_Waitall(2 * k, requests.data(), MPI_STATUSES_IGNORE);
    sent.swap(received);
  };
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
  int fewer = 1;  // calls that move several messages each: fewer of them
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
  } else if (!Varied(op, n, rank, size, x, y, feed_back, &call) && !Halo(op, n, &fewer, &call)) {
    if (rank == 0) std::fprintf(stderr, "raw_mpi: unknown operation %s\n", op.c_str());
    return;
  }
  const int iters = std::max(Iterations(bytes) / fewer, 10);
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
    const bool chained = chained_halo && op.rfind("halo_", 0) == 0;
    std::printf("{\"impl\": \"raw MPI (C++)%s\", \"op\": \"%s\", \"bytes\": %ld, \"times\": [",
                chained ? ", chained MPI_Sendrecv" : "", op.c_str(), bytes);
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
  chained_halo = argc > 3 && std::string(argv[3]) == "chained";
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
