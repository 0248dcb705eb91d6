"""Page faults per MPI call: how much memory an operation maps afresh on each
call, inside one of worker.py's jitted loops. A rank counts its minor page
faults (getrusage) over the loop with the operation and over the same loop
without it; the difference per operation is what the call itself faulted in
(MPI's temporary buffers; the loop's own buffers are the same in both).
Prints rank 0's median over 3 repetitions. A fault maps a 4 KiB page, or a
2 MiB one where the memory is on transparent huge pages. A buffer that one
loop allocates and the other does not, once per run of the loop, shows as its
pages divided by the calls (sendrecv_inplace's result, for instance).
    mpirun -n 2 --bind-to core python benchmarks/mpi_faults.py [--mib 1 4 16 64]
    mpirun -n 2 --bind-to core -x GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/mpi_faults.py
"""

import argparse
import os
import resource
import statistics

import jax
import jax.numpy as jnp
from worker import WORLD, iterations, loops, mpi_bodies, mpi_library, shape_of

import mpijax


def faults(loop, x, steps):
    WORLD.Barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(loop(x, steps))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ops", nargs="+", default=["allreduce", "bcast", "sendrecv", "sendrecv_inplace"])
    args = parser.parse_args()
    bodies = mpi_bodies(mpijax, WORLD.Dup())
    if WORLD.rank == 0:
        print(f"{mpi_library()}; {WORLD.size} ranks; "
              f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}", flush=True)  # fmt: skip
    for mib in args.mib:
        for op in args.ops:
            with_op, empty = loops(bodies[op], lambda f: f)
            per_step = bodies[op][2]
            steps = max(iterations(mib << 20) // per_step, 1)
            x = jnp.ones(shape_of(op, mib << 20), jnp.float32)
            for loop in (with_op, empty):  # compile and warm up
                faults(loop, x, steps)
            extra = statistics.median(faults(with_op, x, steps) - faults(empty, x, steps) for _ in range(3))
            if WORLD.rank == 0:
                print(f"  {op:16s} {mib:3d} MiB: {extra / (steps * per_step):8.1f} page faults per call", flush=True)


if __name__ == "__main__":
    main()
