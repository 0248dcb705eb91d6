"""Large messages with and without transparent huge pages: the C++ reference
and mpijax, each started twice, as they come and under
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (run.py's --hugepages), and, as they
come, mpi4py + NumPy converting from and to JAX arrays (run.py's "mpi4py")
and mpi4py on NumPy arrays alone ("numpy", whose arrays of 4 MiB and more
NumPy puts on huge pages itself), all interleaved case by case as in
run.py. Prints the
median µs per operation of each, then ratios taken round by round (the
servers run a case within seconds of each other, while this machine's slow
phases last minutes) and their median over the rounds, and the most memory
a rank of each server held on huge pages (AnonHugePages, sampled each
second) and in all (VmHWM).
    python benchmarks/huge_pages.py [--rounds 5] [--reps 2] [--ops bcast allreduce sendrecv] [--mib 1 4 16 64]
                                    [--servers "C++ hugetlb" "mpijax hugetlb"]
"""

import argparse
import os
import pathlib
import re
import statistics
import sys
import threading

from run import HUGETLB, build, human, interleaved, mpirun, with_huge_pages

HERE = pathlib.Path(__file__).resolve().parent
SERVERS = ["C++ plain", "C++ hugetlb", "mpijax plain", "mpijax hugetlb", "mpi4py plain", "numpy plain"]
RATIOS = [
    ("mpijax plain", "C++ plain"),
    ("mpijax hugetlb", "C++ hugetlb"),
    ("mpijax hugetlb", "mpijax plain"),
    ("C++ hugetlb", "C++ plain"),
    ("mpijax hugetlb", "mpi4py plain"),
    ("mpijax hugetlb", "numpy plain"),
]


def command(impl, reps):
    if impl == "C++":
        return [str(build("raw_mpi")), str(reps), "serve"]
    return [sys.executable, str(HERE / "worker.py"), impl, "--reps", str(reps), "--serve"]


def children():
    """Each process's children."""
    found = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # it ended
            continue
        found.setdefault(parent, []).append(int(stat.parent.name))
    return found


def below(pid, tree):
    """The processes under `pid` (mpirun's ranks)."""
    found, todo = [], list(tree.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += tree.get(found[-1], [])
    return found


def kib(pid, path, key):
    try:
        return int(re.search(rf"^{key}:\s+(\d+) kB", pathlib.Path(f"/proc/{pid}/{path}").read_text(), re.M)[1])
    except (OSError, TypeError):
        return 0


def sample(servers, peaks, stop):
    while not stop.wait(1.0):
        tree = children()
        for name, server in servers.items():
            for pid in below(server.pid, tree):
                huge, hwm = peaks.get(name, (0, 0))
                now = kib(pid, "smaps_rollup", "AnonHugePages"), kib(pid, "status", "VmHWM")
                peaks[name] = (max(huge, now[0]), max(hwm, now[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2, help="repetitions per case and round")
    parser.add_argument("--ops", nargs="+", default=["bcast", "allreduce", "sendrecv"])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--servers", nargs="+", default=SERVERS, choices=SERVERS, metavar="SERVER",
                        help="a subset of: " + ", ".join(f"'{s}'" for s in SERVERS))  # fmt: skip
    args = parser.parse_args()
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print(f"transparent huge pages: {f.read().strip()}; hugetlb: GLIBC_TUNABLES={HUGETLB}", flush=True)
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    envs = {"plain": plain, "hugetlb": with_huge_pages(plain)}
    servers = {}
    for name in args.servers:
        impl, pages = name.split()
        servers[name] = mpirun(2, *command(impl, args.reps), serve=True, env=envs[pages])
    peaks, stop = {}, threading.Event()
    sampler = threading.Thread(target=sample, args=(servers, peaks, stop))
    sampler.start()
    results = []
    try:
        failed = interleaved(servers, [m << 20 for m in args.mib], args.rounds, results, args.ops)
    finally:
        stop.set()
        sampler.join()
    found = {(r["server"], r["op"], r["bytes"]): r for r in results}

    def per_round(name, case):
        times = found[(name, *case)]["times"]
        return [statistics.median(times[i : i + args.reps]) for i in range(0, len(times), args.reps)]

    def ratio(a, b, case):
        if (a, *case) not in found or (b, *case) not in found:
            return "—"
        ratios = [x / y for x, y in zip(per_round(a, case), per_round(b, case), strict=True)]
        if len(ratios) < 4:
            return f"{statistics.median(ratios):.2f}"
        low, middle, high = statistics.quantiles(ratios, n=4)
        return f"{middle:.2f} ({low:.2f}–{high:.2f})"

    print(f"\nmedian µs per operation over {args.rounds} rounds of {args.reps} repetitions "
          f"(plain: as it comes; hugetlb: GLIBC_TUNABLES={HUGETLB})")  # fmt: skip
    head = ["op", "size", *args.servers]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    cases = [(op, mib << 20) for op in args.ops for mib in args.mib]
    for case in cases:
        cells = [f"{found[(n, *case)]['median']:.1f}" if (n, *case) in found else "—" for n in args.servers]
        print(f"| {case[0]} | {human(case[1])} | " + " | ".join(cells) + " |")
    print("\nratios of times, round by round; median over the rounds (below 1: the first is faster)"
          "\nand, from 4 rounds, the quartiles: the middle half of the rounds lies between them")  # fmt: skip
    ratios = [(a, b) for a, b in RATIOS if a in args.servers and b in args.servers]
    head = ["op", "size", *(f"{a} / {b}" for a, b in ratios)]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for case in cases:
        print(f"| {case[0]} | {human(case[1])} | " + " | ".join(ratio(a, b, case) for a, b in ratios) + " |")
    print("\nmost memory of one rank, MiB: on huge pages (AnonHugePages, sampled each second) / resident (VmHWM)")
    for name in args.servers:
        huge, hwm = peaks.get(name, (0, 0))
        print(f"  {name:16s} {huge / 1024:7.0f} / {hwm / 1024:7.0f}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
