"""What advising an XLA buffer that is already in use could do for it (the
alternative to GLIBC_TUNABLES=glibc.malloc.hugetlb=1 that mpijax could do on
its own, inside its handlers): MPI_Bcast between two ranks from and into a
JAX array's buffer (faulted in by XLA on 4 KiB pages), then after
madvise(MADV_HUGEPAGE) on its 2 MiB-aligned part, after waiting for
khugepaged, and after madvise(MADV_COLLAPSE) (Linux >= 6.1), which makes the
huge pages at once by copying. Prints each step's cost, the share of the
buffer on huge pages (/proc/kpageflags: needs root) and the bcast times.
Start it without GLIBC_TUNABLES.
    mpirun -n 2 --bind-to core python benchmarks/advise_probe.py"""

import ctypes
import statistics
import time

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI
from xla_pages import huge_share

WORLD = MPI.COMM_WORLD
MADV_HUGEPAGE, MADV_COLLAPSE, HUGE = 14, 25, 2 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def advise(address, nbytes, advice):
    """madvise on the whole huge pages inside [address, address + nbytes); µs it took."""
    start = -(-address // HUGE) * HUGE
    end = (address + nbytes) // HUGE * HUGE
    began = time.perf_counter()
    if libc.madvise(start, end - start, advice):
        raise OSError(ctypes.get_errno(), "madvise")
    return (time.perf_counter() - began) * 1e6


def bcast_us(view, iters, reps=5):
    """Median over reps of the slowest rank's µs per MPI_Bcast."""
    times = []
    for _ in range(reps):
        WORLD.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            WORLD.Bcast(view, 0)
        times.append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX) / iters * 1e6)
    return statistics.median(times)


def report(text):
    texts = WORLD.gather(text)
    if WORLD.Get_rank() == 0:
        print("  " + " | ".join(texts), flush=True)


for mib in (16, 64):
    x = jnp.ones(mib << 18, jnp.float32).block_until_ready()
    address, nbytes = x.unsafe_buffer_pointer(), mib << 20
    view = np.ctypeslib.as_array((ctypes.c_float * (nbytes // 4)).from_address(address))  # writable, for Bcast
    iters = max(256 // mib, 4)
    bcast_us(view, 1, 1)  # warm-up
    if WORLD.Get_rank() == 0:
        print(f"{mib} MiB XLA buffer, rank 0 | rank 1", flush=True)
    report(f"as XLA left it: {100 * huge_share(address, nbytes):.0f} % huge, bcast {bcast_us(view, iters):.0f} us")
    took = advise(address, nbytes, MADV_HUGEPAGE)
    again = statistics.median(advise(address, nbytes, MADV_HUGEPAGE) for _ in range(1000))
    report(f"MADV_HUGEPAGE {took:.1f} us (again: {again:.1f} us): {100 * huge_share(address, nbytes):.0f} % huge, "
           f"bcast {bcast_us(view, iters):.0f} us")  # fmt: skip
    time.sleep(20)
    report(f"20 s later: {100 * huge_share(address, nbytes):.0f} % huge, bcast {bcast_us(view, iters):.0f} us")
    copy = np.empty_like(view)
    began = time.perf_counter()
    np.copyto(copy, view)
    copied = (time.perf_counter() - began) * 1e6
    took = advise(address, nbytes, MADV_COLLAPSE)
    report(f"MADV_COLLAPSE {took:.0f} us (a copy of the buffer: {copied:.0f} us): "
           f"{100 * huge_share(address, nbytes):.0f} % huge, bcast {bcast_us(view, iters):.0f} us")  # fmt: skip
    del view, x
