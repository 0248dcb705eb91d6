"""Does computation overlap a halo exchange? A 2-D five-point stencil step
at 2 ranks (the field split in rows over a periodic 1-D Cartesian
communicator, one ghost row per side), timed four ways in jitted loops:

  compute   the step with local copies of the rows in place of the exchange;
  exchange  the halo exchange alone (one neighbor_exchange of two rows);
  blocking  neighbor_exchange, then the step;
  overlap   ineighbor_exchange; the interior rows (which need no ghost)
            between started() and wait(after=); then the two boundary rows.

saved = blocking - overlap, and its share of the exchange's own time (1:
the whole exchange hidden; 0: nothing; negative: the nonblocking step cost
more). `compute` shows what the step costs without MPI; it is not subtracted
from the others, because XLA handles the local copies of the rows that
replace the exchange there differently (it measured slower than `blocking`
at the larger sizes).

Each figure is the median over repetitions of (loop of K steps - loop of 1
step) / (K - 1), ranks started together by a barrier; XLA on one thread per
rank (--xla_cpu_multi_thread_eigen=false). Run under mpirun -n 2:

    mpirun -n 2 python benchmarks/overlap.py   # prints the table; --json FILE writes it
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from mpi4py import MPI  # noqa: E402
from worker import mpi_library  # noqa: E402

import mpijax  # noqa: E402

WORLD = MPI.COMM_WORLD
CART = WORLD.Create_cart([WORLD.size], periods=[True])
UP, DOWN = CART.Shift(0, 1)  # the ranks above and below: rows go both ways


def update(u, rows):
    """The stencil's new values of `rows` (a slice of u's rows, ghosts
    excluded), from u."""
    a, b = rows.start, rows.stop
    centre = u[a:b, 1:-1]
    lap = u[a - 1 : b - 1, 1:-1] + u[a + 1 : b + 1, 1:-1] + u[a:b, :-2] + u[a:b, 2:] - 4 * centre
    return centre + 0.1 * lap


def exchange(u):
    top, bottom = mpijax.neighbor_exchange([u[1], u[-2]], [DOWN, UP], [UP, DOWN], comm=CART)
    return u.at[-1].set(top).at[0].set(bottom)


def assemble(u, interior, top_row, bottom_row):
    return u.at[2:-2, 1:-1].set(interior).at[1:2, 1:-1].set(top_row).at[-2:-1, 1:-1].set(bottom_row)


def edges(u):
    return update(u, slice(1, 2)), update(u, slice(u.shape[0] - 2, u.shape[0] - 1))


def finish(u, inner, rows):
    """The stencil step from the ghost rows `rows` (top, bottom): the
    interior from `inner` (u, tied by a select that XLA cannot evaluate), the
    ghost rows set, then the edges. Every variant computes it this way: XLA
    updates u in place faster when the interior is read from such a separate
    value (16.6 against 8.5 ms at 2048 x 2048 here), so timing another form
    would not compare like with like."""
    interior = update(inner, slice(2, u.shape[0] - 2))
    return interior, lambda: _assembled(u, interior, rows())


def _assembled(u, interior, rows):
    top, bottom = rows
    u = u.at[-1].set(top).at[0].set(bottom)
    return assemble(u, interior, *edges(u))


def tied(u):
    return jnp.where(u[0, 0] > -jnp.inf, u, jnp.zeros_like(u))


def compute(u):
    """The step with the exchange replaced by local copies of the rows."""
    _, step = finish(u, tied(u), lambda: (u[1], u[-2]))
    return step()


def blocking(u):
    rows = mpijax.neighbor_exchange([u[1], u[-2]], [DOWN, UP], [UP, DOWN], comm=CART)
    _, step = finish(u, tied(u), lambda: rows)
    return step()


def overlap(u):
    request = mpijax.ineighbor_exchange([u[1], u[-2]], [DOWN, UP], [UP, DOWN], comm=CART)
    interior, step = finish(u, mpijax.started(request, u), lambda: mpijax.wait(request, after=interior))
    return step()


STEPS = {"compute": compute, "exchange": exchange, "blocking": blocking, "overlap": overlap}


def steps(kind, n):
    step = STEPS[kind]
    return jax.jit(lambda u: lax.fori_loop(0, n, lambda _, u: step(u), u))


def once(f, u):
    WORLD.Barrier()
    start = time.perf_counter()
    jax.block_until_ready(f(u))
    return WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)


def measure(rows, cols, k, repeats):
    """µs per step of each kind: the kinds take turns in every repetition,
    so that drift (the other rank, caches, the clock) touches all alike."""
    u = jnp.ones((rows + 2, cols), jnp.float32) * (1 + WORLD.rank)
    loops = {kind: (steps(kind, k), steps(kind, 1)) for kind in STEPS}
    for many, one in loops.values():
        jax.block_until_ready((many(u), one(u)))
    samples = {kind: [] for kind in STEPS}
    for _ in range(repeats):
        for kind, (many, one) in loops.items():
            samples[kind].append((once(many, u) - once(one, u)) / (k - 1) * 1e6)
    return {kind: statistics.median(times) for kind, times in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    sizes = [(256, 256), (2048, 2048), (256, 65536), (16, 1 << 18), (8, 1 << 20)]  # rows x columns per rank
    results = []
    for rows, cols in sizes:
        k = max(10, min(400, int(4e7 / (rows * cols))))  # loops of 0.1 s or more
        row = {"rows": rows, "cols": cols, "row_bytes": cols * 4, **measure(rows, cols, k, args.repeats)}
        row["saved"] = row["blocking"] - row["overlap"]
        row["saved_share"] = row["saved"] / row["exchange"]
        results.append(row)
    if WORLD.rank == 0:
        print(f"# {mpi_library()}; 2 ranks; µs per step (median)")
        header = ("rows x cols", "row", "compute", "exchange", "blocking", "overlap", "saved", "share")
        print("{:>14} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>6}".format(*header))
        for r in results:
            print(
                f"{r['rows']:>6} x {r['cols']:<6} {r['row_bytes'] // 1024:>5} KiB {r['compute']:9.1f} "
                f"{r['exchange']:9.1f} {r['blocking']:9.1f} {r['overlap']:9.1f} "
                f"{r['saved']:8.1f} {r['saved_share']:6.2f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
