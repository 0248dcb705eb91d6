"""How much of XLA:CPU's buffers sits on transparent huge pages: JAX arrays of
1 to 64 MiB, made by jnp.ones and by a computation (and NumPy's np.ones of the
same size, for comparison), as the environment this
process started with leaves them, and how long a computation into a new
buffer of that size takes (page faults included). Run it plain, under
GLIBC_TUNABLES=glibc.malloc.hugetlb=1, and under MPI launchers that pass the
variable on (no MPI call is made). --too-late sets the variable from Python
before importing JAX, which glibc, having read its tunables at start-up,
ignores. Reads /proc/self/pagemap and /proc/kpageflags: needs root.
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/xla_pages.py"""

import os
import statistics
import sys
import time

import numpy as np

if "--too-late" in sys.argv:
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
import jax.numpy as jnp  # noqa: E402

PAGE, THP = 4096, 1 << 22  # KPF_THP, linux/kernel-page-flags.h


def huge_share(address, nbytes):
    """The share of the buffer's 4 KiB pages that are part of a huge page."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as kpageflags:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), np.uint64)
        huge = 0
        for pfn in entries[entries >> np.uint64(63) == 1] & np.uint64((1 << 55) - 1):
            kpageflags.seek(int(pfn) * 8)
            huge += int.from_bytes(kpageflags.read(8), "little") & THP != 0
    return huge / len(entries)


def new_buffer_us(x, calls=20):
    """Median time of `x * 2`, which XLA writes into a buffer it allocates for it."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        (x * 2).block_until_ready()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main():
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-"))
    lines = [f"rank {rank}: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}"]
    for mib in (1, 4, 16, 64):
        ones = jnp.ones(mib << 18, jnp.float32)
        computed = (ones * 2).block_until_ready()
        numpy = np.ones(mib << 18, np.float32)
        shares = [huge_share(a.unsafe_buffer_pointer(), mib << 20) for a in (ones, computed)]
        shares.append(huge_share(numpy.ctypes.data, mib << 20))
        lines.append(f"  {mib:2d} MiB: jnp.ones {100 * shares[0]:3.0f} %, computed {100 * shares[1]:3.0f} %, "
                     f"np.ones {100 * shares[2]:3.0f} % huge; "
                     f"computing it into a new buffer takes {new_buffer_us(ones):.0f} us")  # fmt: skip
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
