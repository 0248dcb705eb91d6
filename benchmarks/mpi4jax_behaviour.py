"""What docs/migration.md says mpi4jax does differently, run: each case is
one small program, run under mpirun once with `import mpi4jax as M` and once
with `import mpijax as M`, and its outcome printed (what it printed, the
exception, an abort or a hang past the time limit). Install mpi4jax first
(benchmarks/requirements.txt); the log is docs/benchmarks/mpi4jax_behaviour.log.
    python benchmarks/mpi4jax_behaviour.py [--mpirun mpirun.mpich] [--python PY]"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import textwrap

PRELUDE = """
import jax, jax.numpy as jnp
from mpi4py import MPI
import {module} as M
jax.config.update("jax_enable_x64", True)
rank = MPI.COMM_WORLD.Get_rank()
try:
{body}
except Exception as error:
    print(f"rank {{rank}}: {{type(error).__name__}}: {{str(error).splitlines()[0][:150]}}", flush=True)
"""

CASES = {
    "grad of allreduce MAX": (1, "print(jax.grad(lambda x: M.allreduce(x, MPI.MAX).sum())(jnp.arange(3.0)))"),
    "grad of bcast": (1, "print(jax.grad(lambda x: M.bcast(x, 0).sum())(jnp.arange(3.0)))"),
    "jacfwd of sendrecv": (
        2,
        "print(jax.jacfwd(lambda x: M.sendrecv(x, x, source=1 - rank, dest=1 - rank))(jnp.arange(2.0)).tolist())",
    ),
    "a message longer than its receive": (
        2,
        "if rank == 0:\n    M.send(jnp.ones(4), 1)\nelse:\n    print(M.recv(jnp.zeros(2), 0))",
    ),
    "send to oneself, 8 B, then recv": (1, "M.send(jnp.ones(1), 0)\nprint(M.recv(jnp.zeros(1), 0))"),
    "a message to oneself longer than its receive": (1, "M.send(jnp.arange(4.0), 0)\nprint(M.recv(jnp.zeros(2), 0))"),
    "sendrecv with oneself, longer than its receive": (1, "print(M.sendrecv(jnp.arange(4.0), jnp.zeros(2), 0, 0))"),
    "int8 sum of 100 + 100, 1000 elements (first, last)": (
        2,
        "print(M.allreduce(jnp.full(1000, 100, jnp.int8), MPI.SUM)[jnp.array([0, 999])])",
    ),
    "send to oneself, 8 MiB, then recv": (
        1,
        "M.send(jnp.ones(2**20), 0)\nprint(M.recv(jnp.zeros(2**20), 0).sum())",
    ),
}


def run(mpirun, python, ranks, module, body, timeout):
    code = PRELUDE.format(module=module, body=textwrap.indent(body, "    "))
    command = [mpirun, "-n", str(ranks), python, "-c", code]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout} s: killed (a hang)"
    lines = [
        line for line in (done.stdout + done.stderr).splitlines() if line.startswith("rank ") or "abort" in line.lower()
    ]
    printed = [line for line in done.stdout.splitlines() if not line.startswith("rank ")]
    if done.returncode and not lines:  # failed before the program's own try
        lines = [line for line in done.stderr.splitlines() if line.strip()][-1:]
    return f"exit status {done.returncode}; " + " | ".join(sorted(set(lines)) + printed[:2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=int, default=60)
    args = parser.parse_args()
    probe = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip(chr(0)))"
    library = subprocess.run([args.python, "-c", probe], capture_output=True, text=True).stdout.strip()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("jax", "mpi4jax", "mpijax", "mpi4py"))
    print(f"== {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}, {versions}, {library}")
    for name, (ranks, body) in CASES.items():
        print(f"== {name} ({ranks} rank{'s' * (ranks > 1)})", flush=True)
        for module in ("mpi4jax", "mpijax"):
            print(f"  {module:8s} {run(args.mpirun, args.python, ranks, module, body, args.timeout)}", flush=True)
    # What mpi4jax's CUDA extension stages through: the symbols it imports (found, not imported: no MPI here).
    bridge = pathlib.Path(importlib.util.find_spec("mpi4jax").origin).parent / "_src" / "xla_bridge"
    so = next(bridge.glob("mpi_xla_bridge_cuda*.so"))
    imports = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
    wanted = ("malloc", "free", "cudaMallocHost", "cudaHostAlloc", "cudaHostRegister", "cudaMemcpyAsync")
    found = sorted({line.split()[-1].split("@")[0] for line in imports.splitlines()} & set(wanted))
    print(f"== mpi4jax's CUDA extension ({so.name}) imports, of {', '.join(wanted)}: {', '.join(found)}")


if __name__ == "__main__":
    main()
