"""The halo exchange of a 2-D field: one mpijax.neighbor_exchange of all the
strips against the C++ reference (raw_mpi.cc: every MPI_Irecv, then every
MPI_Isend, then one MPI_Waitall) and against what users write without it, one
sendrecv per direction, chained, in mpijax and in mpi4jax (and in C++, one
MPI_Sendrecv per direction: what chaining costs in MPI itself). Two ranks on a
periodic Cartesian communicator (Create_cart, no reordering), decomposed 1 x 2
and 2 x 1; messages of 1 KiB to 4 MiB of float32 each; the method of run.py
and worker.py (interleaved servers, jitted loops minus empty loops, median of
the pooled repetitions).

Which neighbours, for K messages: the offsets of mpijax.cart_neighbors
(itertools.product((-1, 0, 1), repeat=2) order, (0, 0) left out); K = 2 the
two faces along the decomposed axis (the first of size > 1), K = 4 the four
faces, K = 8 every offset, corners included. Message i goes in direction
offsets[i] and comes from the opposite side, under tag i. At two ranks the
neighbours along the axis of size 1 are the rank itself: those messages go
to oneself, as in any periodic code.

One operation is the exchange of all K messages; a case runs
max(iterations(size) / K, 10) of them (worker.iterations), so that a case
takes about as long whatever its K. The loops alternate two sets of strips,
each exchange sending what the last one received, as worker.py's sendrecv
does: XLA can then write every result in place (no copy in the loop), and
raw_mpi.cc swaps its buffers alike.

The machine is shared: a case starts only once no other MPI job, test suite
or build has run for QUIET seconds (see Watch), and the table marks with *
the measurements beside which one started all the same.

    python benchmarks/halo.py    # writes docs/benchmarks/halo.json and halo.log, prints the table
"""

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
DECOMPOSITIONS = [(1, 2), (2, 1)]
NEIGHBOURS = [2, 4, 8]
SIZES = {1024: "1 KiB", 16384: "16 KiB", 262144: "256 KiB", 4194304: "4 MiB"}
OPS = [f"halo_{a}x{b}_{k}" for a, b in DECOMPOSITIONS for k in NEIGHBOURS]
IMPLS = ["raw", "raw chained", "mpijax", "mpijax chained", "mpi4jax chained"]
# The ratio each column shows: to the C++ reference, or to neighbor_exchange.
BASE = {"raw chained": "raw", "mpijax": "raw", "mpijax chained": "mpijax", "mpi4jax chained": "mpijax"}


def parse(op):
    """(dims, K) of a case, halo_AxB_K."""
    dims, k = op.removeprefix("halo_").split("_")
    return tuple(int(n) for n in dims.split("x")), int(k)


def messages(cart, k):
    """(sources, dests) of the K messages on `cart`, in the order above."""
    import mpijax

    dims = cart.Get_topo()[0]
    decomposed = next(axis for axis, n in enumerate(dims) if n > 1)
    neighbors = mpijax.cart_neighbors(cart, corners=k == 8)
    keep = [i for i, offset in enumerate(neighbors.offsets) if k != 2 or offset[decomposed]]
    if len(keep) != k:
        raise ValueError(f"halo.py: {k} neighbours; expected 2, 4 or 8")
    return [neighbors.sources[i] for i in keep], [neighbors.dests[i] for i in keep]


def body(impl, k, cart):
    """worker.py's loop body: (start of the carry, one step, exchanges per step)."""
    import jax.numpy as jnp

    sources, dests = messages(cart, k)
    if impl == "mpijax":
        import mpijax

        def exchange(strips):
            return tuple(mpijax.neighbor_exchange(list(strips), sources, dests, comm=cart))
    else:
        if impl == "mpijax chained":
            import mpijax as lib
        else:
            import mpi4jax as lib

        def exchange(strips):
            return tuple(
                lib.sendrecv(x, x, sources[i], dests[i], sendtag=i, recvtag=i, comm=cart) for i, x in enumerate(strips)
            )

    def step(i, carry):
        strips, other = carry
        other = exchange(strips)
        return exchange(other), other

    return (lambda strips: (strips, tuple(jnp.zeros_like(x) for x in strips))), step, 2


def serve(impl, reps):
    """One implementation under mpirun, answering run.py's interleaved cases."""
    import jax.numpy as jnp
    from worker import WORLD, served, time_jax_loops

    carts = {}
    for op, nbytes in served():
        dims, k = parse(op)
        if dims not in carts:  # collective: every rank meets the same case first
            carts[dims] = WORLD.Create_cart(list(dims), periods=[True, True], reorder=False)
        bodies = {op: body(impl, k, carts[dims])}
        strips = lambda op, nbytes, k=k: tuple(jnp.ones(max(nbytes // 4, 1), jnp.float32) for _ in range(k))  # noqa: E731
        time_jax_loops(impl, bodies, lambda f: f, strips, [(op, nbytes)], reps, fewer=k)


def medians(results):
    return {(r["server"], r["op"], r["bytes"]): statistics.median(r["times"]) for r in results}


def table(results, disturbed=()):
    """Median microseconds per exchange of all K messages, and ratios."""
    times = medians(results)
    header = [f"{impl} (/ {BASE[impl]})" if impl in BASE else impl for impl in IMPLS]
    lines = ["| decomposition | K | size | " + " | ".join(header) + " |", "| --- | --- | --- |" + " --- |" * len(IMPLS)]
    for op in OPS:
        dims, k = parse(op)
        for nbytes, mark in SIZES.items():
            if not any((impl, op, nbytes) in times for impl in IMPLS):
                continue
            cells = []
            for impl in IMPLS:
                t = times.get((impl, op, nbytes))
                base = times.get((BASE.get(impl), op, nbytes))
                ratio = f" ({t / base:.2f}×)" if t is not None and base else ""
                star = "*" if (impl, op, nbytes) in disturbed else ""
                cells.append("—" if t is None else f"{t:.2f}{star}{ratio}")
            lines.append(f"| {dims[0]}×{dims[1]} | {k} | {mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results):
    """How many cases meet the issue's targets."""
    times = medians(results)

    def count(impl, ops, test):
        pairs = [(times.get((impl, op, n)), times.get((BASE[impl], op, n))) for op in ops for n in SIZES]
        pairs = [(t, base) for t, base in pairs if t is not None and base]
        return f"{sum(test(t / base) for t, base in pairs)} of {len(pairs)}"

    many = [op for op in OPS if parse(op)[1] >= 4]
    return [
        f"mpijax within 1.1× of the C++ reference: {count('mpijax', OPS, lambda r: r <= 1.1)} cases",
        *[
            f"{impl} at least 1.5× slower than neighbor_exchange at 4+ neighbours: "
            f"{count(impl, many, lambda r: r >= 1.5)} cases"
            for impl in ("mpijax chained", "mpi4jax chained")
        ],
    ]


def overheads(results):
    """What JAX adds to the same MPI calls at 1 KiB, where the calls' fixed
    costs show: neighbor_exchange against the C++ Waitall, the
    chained sendrecv against the C++ MPI_Sendrecv chain (K calls)."""
    times = medians(results)
    nbytes = min(SIZES)
    if not any(n == nbytes for _, _, n in times):
        return []

    def added(impl, base, k):
        pairs = [(times.get((impl, op, nbytes)), times.get((base, op, nbytes))) for op in OPS if parse(op)[1] == k]
        extra = [t - b for t, b in pairs if t is not None and b is not None]
        return statistics.median(extra) if extra else float("nan")

    lines = [f"microseconds JAX adds to C++ per exchange at {SIZES[nbytes]} (median of the 2 layouts):"]
    for k in NEIGHBOURS:
        one = added("mpijax", "raw", k)
        chained = [added(impl, "raw chained", k) for impl in ("mpijax chained", "mpi4jax chained")]
        lines.append(
            f"  K = {k}: neighbor_exchange {one:+.2f} (one call); mpijax chained {chained[0]:+.2f} "
            f"({chained[0] / k:+.2f} a call); mpi4jax chained {chained[1]:+.2f} ({chained[1] / k:+.2f} a call)"
        )
    return lines


# What other users of the machine run that takes cores from the servers.
BUSY = re.compile(r"pytest|mpirun|mpiexec|prterun|orterun|pip install|cc1plus")
QUIET = 10  # seconds without any of them before a case starts


class Watch(threading.Thread):
    """The other work on the machine, which takes the servers' two cores and
    changes their timings several-fold: every second, the load average and
    the command lines of other MPI jobs, test suites and builds. A case starts
    only after QUIET seconds without them (`patience` seconds of waiting in
    all, then the run goes on regardless), and a case beside which one ran
    is marked."""

    def __init__(self, ours, patience):
        super().__init__(daemon=True)
        self.ours, self.patience = ours, patience
        self.loads, self.others, self.disturbed = [], set(), set()
        self.busy_scans, self.last_busy, self.waited, self.case = 0, -float("inf"), 0.0, None
        self.done, self.changed = threading.Event(), threading.Condition()

    def busy(self):
        found = False
        for process in pathlib.Path("/proc").glob("[0-9]*"):
            try:
                command = (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended
                continue
            if int(process.name) not in self.ours and BUSY.search(command):
                self.others.add(command.strip()[:100])
                found = True
        return found

    def run(self):
        while True:
            busy = self.busy()
            with self.changed:
                self.loads.append(os.getloadavg()[0])
                if busy:
                    self.busy_scans += 1
                    self.last_busy = time.monotonic()
                self.changed.notify_all()
            if self.done.wait(1):
                return

    def begin(self, case):
        """Wait for quiet, then count `case` as running."""
        self.end()
        with self.changed:
            start = time.monotonic()
            while time.monotonic() - self.last_busy < QUIET and self.waited + time.monotonic() - start < self.patience:
                self.changed.wait(1)
            self.waited += time.monotonic() - start
            self.case = (case, self.busy_scans)

    def end(self):
        with self.changed:
            if self.case is not None and self.busy_scans > self.case[1]:
                self.disturbed.add(self.case[0])
            self.case = None

    def stop(self):
        self.end()
        self.done.set()
        self.join()


class Gated:
    """A server's standard input (as run.interleaved uses it) that passes a
    case on only when the Watch lets it start."""

    def __init__(self, name, stream, watch):
        self.name, self.stream, self.watch, self.pending = name, stream, watch, ""

    def write(self, text):
        self.pending += text

    def flush(self):
        fields = self.pending.split()
        if len(fields) == 2:
            self.watch.begin((self.name, fields[0], int(fields[1])))
        self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()

    def close(self):
        self.watch.end()
        self.stream.write(self.pending)
        self.stream.close()


def noise(results, watch):
    """Signs of other work on the machine: the load average through the run,
    other jobs seen, and how far each server's repetitions of a case spread."""
    loads = watch.loads
    lines = [
        f"load average (1 min) at the start {loads[0]:.2f}, at the end {loads[-1]:.2f}, highest {max(loads):.2f}",
        f"waited {watch.waited:.0f} s for other jobs to end; * marks the {len(watch.disturbed)} measurements "
        "(server and case) beside which one ran in at least one round",
        *[f"seen running beside it: {command}" for command in sorted(watch.others)],
    ]
    for impl in IMPLS:
        mine = [r["times"] for r in results if r.get("server") == impl]
        spreads = [max(times) / min(times) for times in mine if min(times) > 0]
        if spreads:
            wide = sum(s > 2 for s in spreads)
            lines.append(
                f"{impl}: slowest / fastest repetition of a case, median {statistics.median(spreads):.2f}, "
                f"largest {max(spreads):.2f}; over 2 in {wide} of {len(spreads)} cases"
            )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("serve", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes per message")
    parser.add_argument("--patience", type=float, default=1200,
                        help="seconds to wait in all for other jobs to end before cases")  # fmt: skip
    parser.add_argument("--output", type=pathlib.Path, default=HERE.parent / "docs" / "benchmarks",
                        help="where halo.json and halo.log go")  # fmt: skip
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.serve:
        serve(args.impl, args.reps)
        return
    from run import build, interleaved, mpirun

    raw = [str(build("raw_mpi")), str(args.reps), "serve"]
    commands = {"raw": raw, "raw chained": [*raw, "chained"]}
    for impl in IMPLS[2:]:
        commands[impl] = [sys.executable, str(HERE / "halo.py"), "serve", "--impl", impl, "--reps", str(args.reps)]
    started = time.time()
    servers = {name: mpirun(2, *command, serve=True) for name, command in commands.items()}
    watch = Watch({os.getpid(), *(server.pid for server in servers.values())}, args.patience)
    watch.start()
    for name, server in servers.items():
        server.stdin = Gated(name, server.stdin, watch)
    results = []
    failed = interleaved(servers, args.sizes, args.rounds, results, ops=OPS)
    watch.stop()
    mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    setup = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        mpi=mpi,
        jax=importlib.metadata.version("jax"),
        mpi4jax=importlib.metadata.version("mpi4jax"),
        reps=args.reps * args.rounds,
        rounds=args.rounds,
        minutes=round((time.time() - started) / 60, 1),
        load_average=watch.loads,
        others=sorted(watch.others),
        waited_s=round(watch.waited),
        disturbed=sorted(watch.disturbed),
    )
    args.output.mkdir(parents=True, exist_ok=True)
    saved = dict(setup=setup, results=results, failed=failed)
    (args.output / "halo.json").write_text(json.dumps(saved, indent=1) + "\n")
    command = " ".join(["python benchmarks/halo.py", *sys.argv[1:]])
    log = [
        f"# {command}  ({setup['date']}, 2 ranks, {mpi}, JAX {setup['jax']}, mpi4jax {setup['mpi4jax']}, "
        f"{setup['machine']}, {setup['minutes']} min)",
        f"# median microseconds per exchange of all K messages over {args.reps} repetitions x {args.rounds} "
        "interleaved rounds; (ratio to the column named)",
        "# K = 2: the faces along the decomposed axis; 4: the four faces; 8: faces and corners (periodic, so",
        "#        at 2 ranks the neighbours along the axis of size 1 are the rank itself)",
        "# raw: MPI_Irecv x K, MPI_Isend x K, MPI_Waitall; raw chained: K MPI_Sendrecv; mpijax: one",
        "# neighbor_exchange; chained: K sendrecv(strip, strip, source, dest, sendtag=i, recvtag=i), one per direction",
        table(results, watch.disturbed),
        *[f"# {line}" for line in targets(results) + overheads(results) + noise(results, watch)],
        *([f"# failed: {', '.join(failed)}"] if failed else []),
    ]
    (args.output / "halo.log").write_text("\n".join(log) + "\n")
    print("\n".join(log))


if __name__ == "__main__":
    main()
