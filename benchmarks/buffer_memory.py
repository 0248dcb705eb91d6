"""How the memory behind a buffer changes the time of one large MPI call:
MPI_Bcast of 16 MiB between two ranks, from a NumPy array (NumPy asks the
kernel for transparent huge pages on arrays of 4 MiB and more) and from
plain anonymous memory in 4 KiB pages (what XLA's buffers and a C++
std::vector get). Same process, same communicator, alternating.
    mpirun -n 2 --bind-to core python benchmarks/buffer_memory.py"""

import mmap
import statistics
import time

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
N, ITERS, REPS = 1 << 22, 100, 5  # float32: 16 MiB


def plain_pages():
    memory = mmap.mmap(-1, N * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc, no madvise
    array = np.frombuffer(memory, np.float32)
    array[:] = 1
    return array


buffers = {"NumPy array": np.ones(N, np.float32), "plain 4 KiB pages": plain_pages()}
times = {name: [] for name in buffers}
for _ in range(REPS):
    for name, array in buffers.items():
        WORLD.Bcast(array, 0)  # warm-up
        WORLD.Barrier()
        start = time.perf_counter()
        for _ in range(ITERS):
            WORLD.Bcast(array, 0)
        times[name].append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX) / ITERS * 1e6)
if WORLD.Get_rank() == 0:
    for name, values in times.items():
        print(f"{name:18s} median {statistics.median(values):8.1f} us  (min {min(values):.1f}, max {max(values):.1f})")
