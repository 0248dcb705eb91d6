"""Sending memory written since its last send against resending an unchanged
buffer, at two ranks: what that costs on this machine, and which benchmark
comparisons it tilts. Three groups of loops, each timed --reps times, interleaved;
a time is the slowest rank's (for the JAX loops, the slowest rank's loop with
the operation minus the slowest rank's loop without it), rank 0 printing the
median in microseconds per operation and, in brackets, its ratio to the
first loop of its group:

- send: mpi4py rank 0 -> rank 1 of the same NumPy array each time (unchanged);
  of the array after rank 0 has rewritten it (rewritten); of the unchanged
  array after rank 0 has rewritten another array as large (other rewritten:
  the cost of the writing itself).
- exscan, in a loop that feeds the result back: mpijax (rank 0's result is
  the identity, zeros, which it writes); mpi4py in place, leaving rank 0's
  buffer as MPI leaves it, undefined and unchanged (what raw_mpi.cc did
  before it set the identity); the same, then rank 0 writes zeros.
- gatherv to root 0, varied.py's counts: mpijax with x written after the
  call (varied.py's loop writes one element of the result into x: off the
  root the result is x itself, the call reads x while the loop writes it in
  place, and XLA, which does not order the two, hands the call a copy of x,
  which MPI sends); mpijax with the off-root result fed back (no copy);
  mpi4py of the unchanged x; mpi4py of a fresh copy.
  Below the mpijax loops, the copies in their compiled loop bodies, by rank
  (loop_copies.py).

    mpirun -n 2 --bind-to core python benchmarks/fresh_buffers.py [--kib 64 1024]
    (add --mca btl_vader_single_copy_mechanism none for Open MPI's copy
    through shared memory instead of its single copy by the receiver)
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from loop_copies import copies
from mpi4py import MPI
from worker import RANK, SIZE, WORLD, _fed_back, _fed_one_element, iterations, loops, mpi_library, slowest

import mpijax


def timed(run, steps):
    WORLD.Barrier()
    start = time.perf_counter()
    run()
    return slowest(time.perf_counter() - start) / steps * 1e6


def jax_loop(body, x, steps):
    """A run of the loop with the operation minus one of the loop without it."""
    with_op, empty = loops(body, lambda f: f)
    jax.block_until_ready((with_op(x, steps), empty(x, steps)))

    def run():
        return timed(lambda: jax.block_until_ready(with_op(x, steps)), steps) - timed(
            lambda: jax.block_until_ready(empty(x, steps)), steps
        )

    run.copies = len(copies(with_op.lower(x, steps).compile().as_text()))
    return run


def numpy_loop(step, steps):
    def run():
        for i in range(steps):
            step(i)

    for i in range(min(steps, 20)):
        step(i)
    return lambda: timed(run, steps)


def cases(nbytes, comm):
    n = nbytes // 4
    steps = iterations(nbytes)
    a, other, b = np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)

    def send(rewrite=None):
        def step(i):
            if RANK == 0:
                if rewrite is not None:
                    rewrite.fill(1.0)
                comm.Send(a, 1)
            elif RANK == 1:
                comm.Recv(b, 0)

        return step

    def exscan(identity):
        def step(i):
            comm.Exscan(MPI.IN_PLACE, a, MPI.SUM)
            if identity and RANK == 0:
                a.fill(0.0)

        return step

    counts = [max(n * (r + 1) // SIZE, 1) for r in range(SIZE)]
    offsets = np.cumsum([0, *counts[:-1]]).tolist()
    x, y = np.ones(counts[RANK], np.float32), np.zeros(sum(counts), np.float32)

    def gatherv(fresh):
        def step(i):
            comm.Gatherv(x.copy() if fresh else x, [y, counts, offsets, MPI.FLOAT] if RANK == 0 else None, 0)
            x[i % x.size] = y[(i * 7) % y.size]  # as the C++ reference feeds one element back

        return step

    gv = lambda v: mpijax.gatherv(v, counts, 0, comm=comm)  # noqa: E731
    mine = jnp.ones(counts[RANK], jnp.float32)
    return {
        "send": {
            "unchanged": numpy_loop(send(), steps),
            "rewritten": numpy_loop(send(a), steps),
            "other rewritten": numpy_loop(send(other), steps),
        },
        "exscan": {
            "mpijax": jax_loop(_fed_back(lambda v: mpijax.exscan(v, MPI.SUM, comm=comm)), jnp.ones(n), steps),
            "mpi4py, rank 0 unchanged": numpy_loop(exscan(False), steps),
            "mpi4py, rank 0 zeroed": numpy_loop(exscan(True), steps),
        },
        "gatherv": {
            "mpijax, x used after": jax_loop(_fed_one_element(gv), mine, steps),
            "mpijax, fed back": jax_loop(_fed_one_element(gv) if RANK == 0 else _fed_back(gv), mine, steps),
            "mpi4py, unchanged x": numpy_loop(gatherv(False), steps),
            "mpi4py, fresh copy": numpy_loop(gatherv(True), steps),
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    comm = WORLD.Dup()
    if RANK == 0:
        print(f"{mpi_library()}; {SIZE} ranks; median us per operation over {args.reps} repetitions", flush=True)
    for kib in args.kib:
        for group, runs in cases(kib << 10, comm).items():
            times = {name: [] for name in runs}
            for _ in range(args.reps):  # interleaved, so that each meets the machine's phases alike
                for name, run in runs.items():
                    times[name].append(run())
            medians = {name: statistics.median(t) for name, t in times.items()}
            first = next(iter(medians.values()))
            cells = [f"{name} {t:8.1f} ({t / first:4.2f})" for name, t in medians.items()]
            found = WORLD.gather({name: run.copies for name, run in runs.items() if hasattr(run, "copies")})
            if RANK == 0:
                print(f"  {group:8s} {kib:5d} KiB: " + " | ".join(cells), flush=True)
                for name in found[0]:
                    print(f"      copies in the loop body of {name}, by rank: {[f[name] for f in found]}", flush=True)


if __name__ == "__main__":
    main()
