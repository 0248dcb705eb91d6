"""reduce_scatter, exscan and the v-variants against the C++ reference and
against what users write without them: a padded allgather, gather, scatter or
alltoall (every rank's rows padded to the largest count, then sliced; for
ragged_alltoall, whose counts are known only at run time, an alltoall of the
counts and the padded alltoall, left padded),
allreduce then slice for reduce_scatter, and scan minus x for exscan, each in
mpijax and in mpi4jax. Two ranks, 8 B, 64 KiB and 16 MiB, the method of
run.py and worker.py (interleaved servers, jitted loops minus empty loops,
median of the pooled repetitions).

Uneven counts, as raw_mpi.cc: with n float32 elements for `bytes`, rank r has
counts[r] = n (r + 1) / size rows (at least 1), and alltoallv sends
counts[(r + j) % size] rows from rank r to rank j. reduce_scatter reduces a
block of n for each rank, exscan n elements.

    python benchmarks/varied.py    # writes docs/benchmarks/varied.json, prints the table
"""

import argparse
import json
import pathlib
import statistics
import sys

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

HERE = pathlib.Path(__file__).resolve().parent
OPS = ["reduce_scatter", "exscan", "allgatherv", "gatherv", "scatterv", "alltoallv", "ragged_alltoall"]
IMPLS = ["raw", "mpijax", "mpijax padded", "mpi4jax padded"]


def layout(nbytes, rank, size):
    n = max(nbytes // 4, 1)
    counts = [max(n * (r + 1) // size, 1) for r in range(size)]
    sends = [counts[(rank + j) % size] for j in range(size)]
    recvs = [counts[(j + rank) % size] for j in range(size)]
    return n, counts, sends, recvs


def padded(x, rows):
    return jnp.pad(x, (0, rows - x.shape[0]))


def joined(stacked, counts):
    """The first counts[r] rows of each stacked block, concatenated."""
    return jnp.concatenate([stacked[r, :c] for r, c in enumerate(counts)])


def split(x, counts):
    return [x[a : a + c] for a, c in zip(np.cumsum([0, *counts[:-1]]), counts, strict=True)]


def bodies(impl, nbytes, comm):
    from worker import RANK, SIZE, _fed_back, _fed_one_element

    _, counts, sends, recvs = layout(nbytes, RANK, SIZE)
    most = max(counts)
    if impl == "mpijax":
        import mpijax as lib

        return {
            "reduce_scatter": _fed_one_element(lambda x: lib.reduce_scatter(x, MPI.SUM, comm=comm)),
            "exscan": _fed_back(lambda x: lib.exscan(x, MPI.SUM, comm=comm)),
            "allgatherv": _fed_one_element(lambda x: lib.allgatherv(x, counts, comm=comm)),
            "gatherv": _fed_one_element(lambda x: lib.gatherv(x, counts, 0, comm=comm)),
            "scatterv": _fed_one_element(lambda x: lib.scatterv(x, counts, 0, comm=comm)),
            "alltoallv": _fed_one_element(lambda x: lib.alltoallv(x, sends, recvs, comm=comm)),
            "ragged_alltoall": _fed_one_element(
                lambda x: lib.ragged_alltoall(x, jnp.asarray(sends), rows=sum(recvs), comm=comm)[0]
            ),
        }
    if impl == "mpijax padded":
        import mpijax as lib
    else:
        import mpi4jax as lib

    def gatherv(x):
        stacked = lib.gather(padded(x, most), 0, comm=comm)
        return joined(stacked, counts) if RANK == 0 else stacked

    def scatterv(x):
        blocks = jnp.stack([padded(b, most) for b in split(x, counts)]) if RANK == 0 else padded(x, most)
        return lib.scatter(blocks, 0, comm=comm)[: counts[RANK]]

    def alltoallv(x):
        blocks = jnp.stack([padded(b, most) for b in split(x, sends)])
        return joined(lib.alltoall(blocks, comm=comm), recvs)

    def ragged_alltoall(x):
        """Counts known only at run time: they go first, and the rows stay
        padded (no static slice can take them out)."""
        lib.alltoall(jnp.asarray(sends, jnp.int32).reshape(SIZE, 1), comm=comm)
        return lib.alltoall(jnp.stack([padded(b, most) for b in split(x, sends)]), comm=comm)

    return {
        "reduce_scatter": _fed_one_element(lambda x: lib.allreduce(x, op=MPI.SUM, comm=comm)[RANK]),
        "exscan": _fed_back(lambda x: lib.scan(x, op=MPI.SUM, comm=comm) - x),
        "allgatherv": _fed_one_element(lambda x: joined(lib.allgather(padded(x, most), comm=comm), counts)),
        "gatherv": _fed_one_element(gatherv),
        "scatterv": _fed_one_element(scatterv),
        "alltoallv": _fed_one_element(alltoallv),
        "ragged_alltoall": _fed_one_element(ragged_alltoall),
    }


def serve(impl, reps):
    """One implementation under mpirun, answering run.py's interleaved cases."""
    from worker import RANK, SIZE, WORLD, served, time_jax_loops

    comm = WORLD.Dup()

    def make_input(op, nbytes):
        n, counts, sends, _ = layout(nbytes, RANK, SIZE)
        rows = {
            "reduce_scatter": (SIZE, n),
            "exscan": (n,),
            "scatterv": (sum(counts) if RANK == 0 else counts[RANK],),
            "alltoallv": (sum(sends),),
            "ragged_alltoall": (sum(sends),),
        }.get(op, (counts[RANK],))
        return jnp.ones(rows, jnp.float32)

    for case in served():  # each size has its own counts, so its own loop bodies
        time_jax_loops(impl, bodies(impl, case[1], comm), lambda f: f, make_input, [case], reps)


def table(results):
    """Median microseconds per operation and the ratio to the C++ reference."""
    from run import MARKS

    medians = {(r["server"], r["op"], r["bytes"]): statistics.median(r["times"]) for r in results}
    lines = ["| op | size | " + " | ".join(IMPLS) + " |", "| --- | --- |" + " --- |" * len(IMPLS)]
    for op in OPS:
        for nbytes, mark in MARKS.items():
            raw = medians.get(("raw", op, nbytes))
            cells = []
            for impl in IMPLS:
                t = medians.get((impl, op, nbytes))
                ratio = f" ({t / raw:.2f}×)" if t is not None and raw and impl != "raw" else ""
                cells.append("—" if t is None else f"{t:.2f}{ratio}")
            lines.append(f"| {op} | {mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("serve", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS, help="rerun these; the others' results are kept")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.serve:
        serve(args.impl, args.reps)
        return
    from run import MARKS, build, interleaved, mpirun

    commands = {"raw": [str(build("raw_mpi")), str(args.reps), "serve"]}
    for impl in IMPLS[1:]:
        commands[impl] = [sys.executable, str(HERE / "varied.py"), "serve", "--impl", impl, "--reps", str(args.reps)]
    servers = {name: mpirun(2, *command, serve=True) for name, command in commands.items()}
    results = []
    failed = interleaved(servers, list(MARKS), args.rounds, results, ops=args.ops)
    out = HERE.parent / "docs" / "benchmarks" / "varied.json"
    if out.exists():
        results += [r for r in json.loads(out.read_text())["results"] if r["op"] not in args.ops]
    out.write_text(json.dumps(dict(results=results, failed=failed), indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
