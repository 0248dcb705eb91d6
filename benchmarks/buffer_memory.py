"""How the memory behind a buffer changes the time of one large MPI call:
MPI_Bcast of 16 MiB between two ranks, from a NumPy array (NumPy asks the
kernel for transparent huge pages on arrays of 4 MiB and more) and from
plain anonymous memory in 4 KiB pages. Same process, same communicator,
alternating. Also prints how much of each buffer, and of a 16 MiB JAX array
(an XLA buffer), sits on huge pages (/proc/self/smaps).
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


def huge_kib(address, nbytes=N * 4):
    """AnonHugePages of the mappings that hold [address, address + nbytes), in KiB."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start < address + nbytes and address < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


buffers = {"NumPy array": np.ones(N, np.float32), "plain 4 KiB pages": plain_pages()}
if WORLD.Get_rank() == 0:
    import jax.numpy as jnp

    xla = jnp.ones(N, jnp.float32).block_until_ready()
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print(f"transparent huge pages: {f.read().strip()}")
    addresses = {name: array.ctypes.data for name, array in buffers.items()}
    for name, address in (addresses | {"JAX array": xla.unsafe_buffer_pointer()}).items():
        print(f"{name:18s} {huge_kib(address):6d} KiB of its 16384 KiB on huge pages")
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
