"""Staged mode on a GPU before and after 18b99de, which dropped the
synchronisation of XLA's stream at the start of each staged call (the copies
of the inputs, queued on that stream, follow its kernels anyway), like for
like: one mpijax build is "before" (BEFORE_PYTHON's), the other "now" (this
Python's). Each is a worker server (worker.py mpijax --serve, 2 ranks, its
arrays on JAX's default device) asked for one case at a time in an order that
rotates from case to case (run.py's interleaved rotation), so that both meet
the same machine; 4 KiB and 1 MiB, over calls with one input (allreduce,
sendrecv), one on the root only (bcast) and none on the receiving side
(pingpong). Prints the medians and their ratio, and writes results.json.

    python benchmarks/staged_waits.py BEFORE_PYTHON [--output DIR]

scripts/gpu_check.sh's step `waits` builds "before" and runs this."""

import argparse
import json
import pathlib
import sys

from run import HERE, human, interleaved, mpirun

OPS = ["allreduce", "sendrecv", "bcast", "pingpong"]
SIZES = [4096, 2**20]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a Python whose mpijax is the build before 18b99de")
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("build/staged-waits"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    worker = [str(HERE / "worker.py"), "mpijax", "--reps", str(args.reps), "--serve"]
    pythons = {"now": sys.executable, "before": args.before}
    servers = {name: mpirun(2, python, *worker, serve=True) for name, python in pythons.items()}
    results = []
    failed = interleaved(servers, SIZES, args.rounds, results, OPS)
    medians = {(r["server"], r["op"], r["bytes"]): r["median"] for r in results}
    print(f"\n{'op':10s} {'size':>7s} {'before (us)':>12s} {'now (us)':>10s} {'now/before':>11s}")
    for nbytes in SIZES:
        for op in OPS:
            before, now = medians.get(("before", op, nbytes)), medians.get(("now", op, nbytes))
            if before and now:
                print(f"{op:10s} {human(nbytes):>7s} {before:12.2f} {now:10.2f} {now / before:11.2f}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({"failed": failed, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
