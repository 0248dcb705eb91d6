"""Benchmarks side by side: the C++ reference (the same MPI calls from C++),
mpijax, mpi4jax, mpi4py and JAX's own collectives, each under `mpirun -n 2`,
one XLA thread per rank, ranks bound to cores. Writes results.json, README.md (method, tables, ratios,
targets) and one PNG per operation to the output folder.

    python benchmarks/run.py            # the full run: 8 B to 64 MiB
    python benchmarks/run.py --quick    # a smoke run of a minute or two
    python benchmarks/run.py --gpu      # on an NVIDIA GPU: mpijax and mpi4jax,
                                        # staged (and CUDA-aware, where the MPI
                                        # is), against a device-host-device copy
    python benchmarks/run.py --hugepages  # every implementation's malloc on
                                          # transparent huge pages (huge_pages.py)
"""

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
OPS = ["allreduce", "bcast", "allgather", "alltoall", "sendrecv", "sendrecv_inplace", "pingpong"]
WHAT = {
    "allreduce": "MPI_Allreduce SUM of float32",
    "bcast": "broadcast from rank 0",
    "allgather": "allgather; size = each rank's block",
    "alltoall": "alltoall; size = each block sent to a rank",
    "sendrecv": "sendrecv around the ring",
    "sendrecv_inplace": "sendrecv(x, x) around the ring, the README idiom",
    "pingpong": "send/recv ping-pong; time of one way",
}
MARKS = {8: "8 B", 65536: "64 KiB", 16777216: "16 MiB"}
GPU_SIZES = [4096, 2**20, 2**26]
# glibc >= 2.35 then asks the kernel for transparent huge pages for malloc's
# heap and its mmap'ed chunks (XLA:CPU's buffers, std::vector). glibc reads it
# once, at process start; it does nothing where THP is "never".
HUGETLB = "glibc.malloc.hugetlb=1"


def with_huge_pages(env):
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    return env | {"GLIBC_TUNABLES": ":".join([*tunables, HUGETLB])}


def human(nbytes):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def mpirun(n, *command, serve=False, env=None):
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # on a GPU, the two ranks share it
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    openmpi = "Open MPI" in subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    bind = ["--bind-to", "core"] if openmpi else ["-bind-to", "core"]
    stdin = subprocess.PIPE if serve else None
    return subprocess.Popen(["mpirun", "-n", str(n), *bind, *command], env=env, stdin=stdin, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip


def summary(entry):
    """A case with its repetitions' min, median and max (every timer prints
    only its repetitions, kept in the order taken, round after round), and a
    line of progress."""
    times = entry["times"]
    entry = entry | dict(min=min(times), median=statistics.median(times), max=max(times))
    size = human(entry["bytes"])
    name = entry.get("server", entry["impl"])[:16]
    print(f"  {name:16s} {entry['op']:10s} {size:>7s}  {entry['median']:12.2f} us", flush=True)
    return entry


def record(entry, results, stage):
    """Keep one result."""
    results.append((summary(entry) if "op" in entry else entry) | {"stage": stage})


def collect(process, results, stage):
    """Read JSON lines as they come; False if the stage failed."""
    for line in process.stdout:
        if line.startswith("{"):
            record(json.loads(line), results, stage)
    if process.wait():
        print(f"== {stage} failed (exit code {process.returncode}): the report leaves it out", flush=True)
    return process.returncode == 0


def interleaved(servers, sizes, rounds, results, ops=OPS):
    """Every implementation case by case: each is a server under its own
    mpirun (`--serve`), asked for one case at a time, in an order that rotates
    from case to case. This machine has slow phases that last minutes (the
    same C++ ping-pong takes 13 us or 38 us depending on the minute);
    stage by stage, one could fall on one implementation and not another.
    Every case comes round `rounds` times, and its repetitions are pooled.
    A server that ends early is left out of the rest (and of the report);
    returns the names of those."""

    def ask(name, op, nbytes):
        server = servers[name]
        try:
            server.stdin.write(f"{op} {nbytes}\n")
            server.stdin.flush()
        except BrokenPipeError:
            pass
        line = next((line for line in server.stdout if line.startswith("{")), None)
        if line is None:
            print(f"== {name} ended before answering {op} {nbytes} (exit code {server.wait()}): left out", flush=True)
            names.remove(name)
            failed.append(name)
            return None
        return json.loads(line)

    names, failed = list(servers), []
    for name in list(names):  # a first call pays for setting MPI up: not a case
        ask(name, ops[0], 8)
    cases = [(op, nbytes) for nbytes in sizes for op in ops]
    pooled = {}
    for lap in range(rounds):
        print(f"== round {lap + 1} of {rounds}", flush=True)
        for i, (op, nbytes) in enumerate(cases):
            turn = (i + lap) % len(names)
            for name in names[turn:] + names[:turn]:
                if name != "check" or nbytes in MARKS:  # check mode: the summary's sizes only
                    answer = ask(name, op, nbytes)
                    if answer is None:
                        continue
                    answer["server"] = name
                    times = pooled.setdefault((name, op, nbytes), [])
                    times += answer["times"]
                    if lap < rounds - 1:
                        summary(answer)
                    else:
                        record(answer | {"times": times}, results, "close")
    for name in names:
        server = servers[name]
        server.stdin.write("\n")  # the end; Open MPI 5 does not pass on the end of input itself
        server.stdin.close()
        if server.wait():
            print(f"== {name} failed at the end (exit code {server.returncode})", flush=True)
            failed.append(name)
    return failed


def mps_running():
    """Whether an MPS daemon shares the GPU between the ranks."""
    for comm in pathlib.Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("nvidia-cuda-mps"):
                return True
        except OSError:  # the process ended
            pass
    return False


def gpu_name():
    """What JAX calls the GPU (asked in a process of its own, as the workers
    are: this one stays off the GPU; not nvidia-smi, which a container may lack)."""
    query = [sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip() or "unknown"


def build(program):
    """benchmarks/<program>.cc, built by CMake (copy_bound only with the CUDA toolkit)."""
    folder = ROOT / "build" / "benchmarks"
    subprocess.run(["cmake", "-S", str(HERE), "-B", str(folder), "-DCMAKE_BUILD_TYPE=Release"], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(["cmake", "--build", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return folder / program


def cuda_aware_mpi():
    """Whether mpijax takes CUDA-aware mode here: it refuses it where the MPI
    library says it cannot move device memory (mpi4jax would crash)."""
    probe = [sys.executable, "-c", "import mpijax; mpijax.set_cuda_aware(True)"]
    aware = subprocess.run(probe, capture_output=True, text=True)
    if aware.returncode:
        reason = (aware.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"== CUDA-aware mode left out: {reason}", flush=True)
    return aware.returncode == 0


def stages(sizes, reps, calls, gpu):
    """(name, ranks, command) of every part of a run."""
    worker = [sys.executable, str(HERE / "worker.py")]
    loops = ["--reps", str(reps), "--sizes", *map(str, sizes)]
    extras = [
        ("dispatch", 1, lambda: [*worker, "dispatch"]),
        ("memory", 2, lambda: [*worker, "memory", "--calls", str(calls)]),
    ]
    if gpu:  # the workers' arrays are on JAX's default device, the GPU
        # Each binding staged, then handing device pointers to MPI where the library can take them.
        aware = ["env", "MPIJAX_CUDA_AWARE=1", "MPI4JAX_USE_CUDA_MPI=1"]
        modes = [("", [])] + ([("-cuda-aware", aware)] if cuda_aware_mpi() else [])
        return [
            ("copy", 1, lambda: [str(build("copy_bound")), str(reps), *map(str, sizes)]),
            *[
                (impl + mode, 2, lambda impl=impl, env=env: [*env, *worker, impl, *loops])
                for mode, env in modes
                for impl in ["mpijax", "mpi4jax"]
            ],
            *extras,
        ]
    return extras


INTERLEAVED = ["raw", "mpijax", "check", "mpi4jax", "mpi4py", "jax"]


def servers(reps, have_mpi4jax):
    """Every implementation as a server of cases (interleaved): the C++
    reference, mpijax, mpijax in check mode, mpi4jax (if installed), mpi4py
    and JAX's shard_map collectives."""
    worker = [sys.executable, str(HERE / "worker.py")]
    commands = {"raw": [str(build("raw_mpi")), str(reps), "serve"]}
    for name in INTERLEAVED[1:]:
        if name != "mpi4jax" or have_mpi4jax:
            impl = "mpijax-check" if name == "check" else name
            commands[name] = [*worker, impl, "--reps", str(reps), "--serve"]
    return {name: mpirun(2, *command, serve=True) for name, command in commands.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 sizes, 2 repetitions, 10k calls for memory")
    parser.add_argument("--gpu", action="store_true", help=f"on a GPU: sizes {GPU_SIZES}, into docs/benchmarks/gpu")
    parser.add_argument("--hugepages", action="store_true",
                        help=f"every implementation under GLIBC_TUNABLES={HUGETLB} (see huge_pages.py)")  # fmt: skip
    parser.add_argument("--output", type=pathlib.Path)
    parser.add_argument("--only", nargs="+", metavar="STAGE",
                        help="run only these stages and keep the others' results from the output folder")  # fmt: skip
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS,
                        help="the close stage's operations (with --only close, the others' results stay)")  # fmt: skip
    args = parser.parse_args()
    args.output = args.output or ROOT / "docs" / "benchmarks" / ("gpu" if args.gpu else "")
    sizes = GPU_SIZES if args.gpu else list(MARKS) if args.quick else [2**k for k in range(3, 27)]
    reps, rounds = (2, 1) if args.quick else (3, 3)
    calls = 10_000 if args.quick else 100_000
    started = time.time()
    if args.hugepages:
        os.environ.update(with_huge_pages(os.environ))  # every mpirun below passes it on

    results, minutes, failed, rotation = [], 0.0, [], None
    saved = args.output / "results.json"
    date, reruns = time.strftime("%Y-%m-%d"), []
    if args.only:
        previous = json.loads(saved.read_text())
        ops = f" ({', '.join(args.ops)})" if "close" in args.only and args.ops != OPS else ""
        reruns = [*previous["setup"].get("reruns", []), f"{date}: {', '.join(args.only)}{ops}"]
        date = previous["setup"]["date"]
        results = [
            r
            for r in previous["results"]
            if r.get("stage") not in args.only or (r["stage"] == "close" and r["op"] not in args.ops)
        ]
        minutes = previous["setup"]["minutes"]
        rotation = previous["setup"].get("interleaved")
    have_mpi4jax = importlib.util.find_spec("mpi4jax") is not None
    if not args.gpu and (not args.only or "close" in args.only):
        print("== close: the C++ reference, mpijax (and in check mode)" + (", mpi4jax" if have_mpi4jax else "")
              + ", mpi4py, JAX shard_map, interleaved", flush=True)  # fmt: skip
        rotation = servers(reps, have_mpi4jax)
        left_out = interleaved(rotation, sizes, rounds, results, args.ops)
        rotation = [name for name in rotation if name not in left_out]
        failed += left_out
    for stage, ranks, command in stages(sizes, reps * rounds, calls, args.gpu):
        if args.only and stage not in args.only:
            continue
        if stage == "dispatch" and not have_mpi4jax:
            print(f"== {stage}: needs mpi4jax, not installed, skipped", flush=True)
            continue
        print(f"== {stage}", flush=True)
        if not collect(mpirun(ranks, *command()), results, stage):
            failed.append(stage)  # a GPU lease or a half-hour run is worth the other stages' numbers

    args.output.mkdir(parents=True, exist_ok=True)
    setup = {
        "date": date,  # of the first run; `reruns` says which stages ran again, when
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "mpi": subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        "python": platform.python_version(),
        "quick": args.quick,
        "hugepages": args.hugepages,
        "gpu": args.gpu,
        "mps": args.gpu and mps_running(),
        **({"gpu_name": gpu_name()} if args.gpu else {}),
        "reps": reps * rounds,  # timed repetitions per case, over all rounds
        "rounds": rounds,
        "minutes": round(minutes + (time.time() - started) / 60, 1),
        "failed": failed,
        # The servers of the interleaved rotation. Results without this key
        # come from runs where mpi4py and JAX ran one after the other, and
        # mpi4py's allgather did not convert its result back to JAX.
        **({"interleaved": rotation} if rotation is not None else {}),
        **({"reruns": reruns} if reruns else {}),
    }
    saved.write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    from report import write_gpu_report, write_report  # matplotlib only here

    (write_gpu_report if args.gpu else write_report)(results, setup, args.output)
    print(f"== wrote {args.output}/README.md and plots in {setup['minutes']} min", flush=True)
    if failed:
        raise SystemExit(f"failed stages: {', '.join(failed)}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if shutil.which("mpirun") is None:
        raise SystemExit("mpirun not found: run scripts/setup.sh first")
    main()
