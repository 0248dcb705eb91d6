"""The three example applications, side by side, on the same machine in the
same run: each at 1 and 2 ranks with

  mpijax     the example as written (one halo_exchange of all fields;
             tree_allreduce of the gradients);
  sendrecv   mpijax again, halos by one sendrecv per side and axis, the way
             mpi4jax users write them;
  mpi4jax    mpi4jax 0.9.1: the same sendrecv code with `import mpi4jax`
             (gradients: one allreduce of the flattened tree);
  sharding   JAX's own multi-process sharding: jax.distributed on gloo, the
             same local functions under shard_map, halos by lax.ppermute and
             sums by lax.psum (training: jit over the sharded global batch,
             XLA inserts the gradient all-reduce);
  local      1 rank only: the model with its communication replaced by local
             copies (periodic halos) or nothing (walls, sums): what MPI costs.

Method: each case is its own `mpirun -n N --bind-to core` job (Open MPI):
each rank on a core of its own, with every thread XLA starts for it, and
XLA's Eigen on one thread (--xla_cpu_multi_thread_eigen=false). Unbound, XLA's
CPU runtime spreads one rank's work over both cores of this machine, and at 2
ranks the threads of one rank compete with the other rank, which spins while
it waits in MPI (docs/benchmarks/apps_unbound.log). `first` is
the wall time of the first call of the jitted loop: tracing, compilation and
one run. Then the loop runs REPEATS more times; throughput is steps per
second of the fastest repetition, the one this shared VM disturbed least
(shallow water: time steps; halo, the shallow-water model's exchange alone:
exchanges; poisson: CG iterations; training: optimiser steps), and the
table gives the median over --rounds runs of each case (5), the rounds
interleaving all cases so that a slow spell hits them alike.
Every case prints a checksum of its result; the driver checks that all
backends of an application agree.

    python benchmarks/apps.py            # every case; writes docs/benchmarks/apps.json and apps.log
    python benchmarks/apps.py --only shallow_water
    mpirun -n 2 --bind-to core python benchmarks/apps.py --case shallow_water mpijax   # one case
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))
BACKENDS = ["mpijax", "sendrecv", "mpi4jax", "sharding", "local"]
REPEATS = 7


# ---------------------------------------------------------------- halos ----
def _slab(a, axis, i):
    return a[i] if axis == 0 else a[:, i]


def _put(a, axis, i, value):
    return a.at[i].set(value) if axis == 0 else a.at[:, i].set(value)


def sendrecv_halo(mpi, cart):
    """Ghost cells (one per side) by two sendrecv per axis, axis 0 first, so
    that the second axis carries the corners along: what users of mpi4jax
    write. `mpi` is the module, mpijax or mpi4jax."""
    import jax
    from mpi4py import MPI

    def fill(a):
        for axis in (0, 1):
            below, above = cart.Shift(axis, 1)
            from_above = mpi.sendrecv(_slab(a, axis, 1), _slab(a, axis, -1), source=above, dest=below, comm=cart)
            from_below = mpi.sendrecv(_slab(a, axis, -2), _slab(a, axis, 0), source=below, dest=above, comm=cart)
            # Beyond a wall (MPI.PROC_NULL) the ghost keeps its value.
            if above != MPI.PROC_NULL:
                a = _put(a, axis, -1, from_above)
            if below != MPI.PROC_NULL:
                a = _put(a, axis, 0, from_below)
        return a

    return lambda fields: jax.tree.map(fill, fields)


def ppermute_halo(dims, periods):
    """The same inside shard_map over a ("y", "x") mesh: a ghost slab comes
    from the neighbour by lax.ppermute; beyond a wall it keeps its value."""
    import jax
    from jax import lax

    def fill(a):
        for axis, name in enumerate(("y", "x")):
            n = dims[axis]
            up = [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if periods[axis] else [])
            down = [(j, i) for i, j in up]
            here = lax.axis_index(name)
            from_below = lax.ppermute(_slab(a, axis, -2), name, up)
            from_above = lax.ppermute(_slab(a, axis, 1), name, down)
            if not periods[axis]:
                from_below = jax.numpy.where(here == 0, _slab(a, axis, 0), from_below)
                from_above = jax.numpy.where(here == n - 1, _slab(a, axis, -1), from_above)
            a = _put(_put(a, axis, 0, from_below), axis, -1, from_above)
        return a

    return lambda fields: jax.tree.map(fill, fields)


def local_halo(periods):
    """One rank, no MPI: a periodic axis wraps onto itself, a wall keeps its
    ghost cells."""
    import jax

    def fill(a):
        for axis in (0, 1):
            if periods[axis]:
                a = _put(_put(a, axis, 0, _slab(a, axis, -2)), axis, -1, _slab(a, axis, 1))
        return a

    return lambda fields: jax.tree.map(fill, fields)


def _mpi_module(backend):
    """The binding whose calls the sendrecv-style code makes: mpi4jax, or mpijax."""
    import importlib

    return importlib.import_module("mpi4jax" if backend == "mpi4jax" else "mpijax")


def grid_comms(backend, cart, comms_type, native):
    """The Comms of a grid example (halo, sum) for `backend`."""
    from jax import lax
    from mpi4py import MPI

    dims, periods, _ = cart.Get_topo()
    if backend == "mpijax":
        return native(cart)
    if backend in ("sendrecv", "mpi4jax"):
        mpi = _mpi_module(backend)
        return comms_type(halo=sendrecv_halo(mpi, cart), sum=lambda x: mpi.allreduce(x, op=MPI.SUM, comm=cart))
    if backend == "sharding":
        return comms_type(halo=ppermute_halo(dims, periods), sum=lambda x: lax.psum(x, ("y", "x")))
    return comms_type(halo=local_halo(periods), sum=lambda x: x)


# ------------------------------------------------------------ the cases ----
def sharded(run, cart, args, out_specs):
    """`run` (local blocks -> local blocks) under shard_map over the ranks'
    Cartesian grid, one device per process, and its arguments as global
    arrays made of every process's blocks."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()).reshape(cart.Get_topo()[0]), ("y", "x"))
    spec = _sharded_spec()
    args = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(a)), args
    )
    in_specs = jax.tree.map(lambda _: spec, args)
    # check_vma=False: lax.custom_linear_solve (poisson) fails JAX 0.10's
    # varying-axes check under shard_map; JAX's error names this workaround.
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)), args


def _sharded_spec():
    from jax.sharding import PartitionSpec as P

    return P("y", "x")


def _shallow_water(backend, comm, loop, out_specs):
    """A case of the example's model at its default size, the README's run
    (256 x 256 cells): `loop(sw, cfg, comms)` is the jitted loop over its
    state, of 100 steps."""
    import jax

    import shallow_water as sw

    cfg = sw.Config()
    cart, rows, cols = sw.decompose(comm, cfg.n)
    state = sw.initial_state(cfg, rows, cols)
    run = loop(sw, cfg, grid_comms(backend, cart, sw.Comms, sw.mpijax_comms))
    if backend == "sharding":
        return sharded(run, cart, (state,), out_specs)
    return jax.jit(run), (state,)


def shallow_water_case(backend, comm):
    """100 time steps of the example's model."""
    from jax.sharding import PartitionSpec as P

    def loop(sw, cfg, comms):
        return lambda s: sw.simulate(s, 100, cfg, comms)

    advance, state = _shallow_water(backend, comm, loop, ((_sharded_spec(),) * 3, P()))
    # (function, its arguments, the next call's arguments from its result,
    # steps done by a call, a checksum: the domain's energy)
    return advance, state, lambda out: (out[0],), lambda out: 100, lambda out: float(out[1][0])


def halo_case(backend, comm):
    """The model's halo exchange alone, of (h, u, v): 100 exchanges in a
    loop; a step is an exchange."""
    from jax import lax

    def loop(sw, cfg, comms):
        return lambda s: lax.fori_loop(0, 100, lambda _, s: comms.halo(s), s)

    advance, state = _shallow_water(backend, comm, loop, (_sharded_spec(),) * 3)
    return advance, state, lambda out: (out,), lambda out: 100, lambda out: comm.allreduce(_sum_of(out[0]))


def poisson_case(backend, comm):
    """One CG solve to a relative residual of 1e-12 on 128 x 128 cells, in
    double precision; a step is a CG iteration (one halo exchange of the
    search direction, two sums)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    import poisson_cg as cg

    cart = comm.Create_cart(MPI.Compute_dims(comm.Get_size(), 2), periods=[False, False])
    theta, problem = cg.setup(128, cart)
    comms = grid_comms(backend, cart, cg.Comms, cg.mpijax_comms)

    def run(theta, f, target, inside):
        u, (steps, _) = cg.solve(theta, cg.Problem(f, target, inside, problem.h), comms)
        return u, steps

    args = (theta, problem.f, problem.target, problem.inside)
    if backend == "sharding":
        solve, args = sharded(run, cart, args, (_sharded_spec(), P()))
    else:
        solve = jax.jit(run)
    return solve, args, lambda out: args, lambda out: int(out[1]), lambda out: float(comm.allreduce(_sum_of(out[0])))


def training_case(backend, comm):
    """One epoch of the example's training: 20 Adam steps of a global batch
    of 240 rows, each rank its share, on a 2-64-64-1 MLP (4,417 float32
    parameters, the loss and the gradients averaged once per step)."""
    import jax
    import jax.flatten_util
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    import data_parallel as dp

    rank, size = comm.Get_rank(), comm.Get_size()
    data = dp.dataset(4800)
    params = dp.init_params(jax.random.key(0), [2, 64, 64, 1])
    state = (params, dp.adam_init(params))
    rows = dp.batch_rows(4800, 240, 0)
    local = rows[:, rank * (240 // size) : (rank + 1) * (240 // size)]
    lr = 3e-3

    if backend == "sharding":  # jit over the global batch: XLA adds the all-reduce of the gradients
        mesh = Mesh(np.array(jax.devices()), ("batch",))
        x, y = (jax.make_array_from_process_local_data(NamedSharding(mesh, P(None, "batch")), a[local]) for a in data)

        @jax.jit
        def epoch(state, x, y):
            def step(state, xy):
                params, opt = state
                value, grads = jax.value_and_grad(dp.loss)(params, *xy)
                return dp.adam_update(params, grads, opt, lr), value

            return jax.lax.scan(step, state, (x, y))

        replicated = NamedSharding(mesh, P())
        state = jax.tree.map(lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), state)
        return epoch, (state, x, y), lambda out: (out[0], x, y), lambda out: len(rows), lambda out: float(out[1][-1])

    def average(tree):
        if backend == "mpijax":
            return dp.mpi_average(comm)(tree)
        if backend == "local":
            return tree
        # What an mpi4jax user writes: one allreduce of the flattened tree.
        flat, unravel = jax.flatten_util.ravel_pytree(tree)
        return unravel(_mpi_module(backend).allreduce(flat, op=MPI.SUM, comm=comm) / size)

    args = (state, data, jnp.asarray(local))

    def again(out):
        return (out[0], *args[1:])

    return dp.make_epoch(average, lr), args, again, lambda out: len(rows), lambda out: float(out[1][-1])


def _sum_of(a):
    """The sum of this process's block of `a` (a global array under sharding)."""
    import numpy as np

    return float(np.sum(np.asarray(a.addressable_shards[0].data)))


CASES = {"shallow_water": shallow_water_case, "halo": halo_case, "poisson": poisson_case, "training": training_case}


def run_case(app, backend):
    """One case under mpirun: prints its result as one JSON line on rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if backend == "sharding":
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None)
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=comm.Get_size(), process_id=comm.Get_rank())
    import jax

    run, args, again, count, checksum = CASES[app](backend, comm)
    comm.Barrier()
    start = time.perf_counter()
    out = jax.block_until_ready(run(*args))
    first = time.perf_counter() - start
    rates = []
    for _ in range(REPEATS):
        args = again(out)
        comm.Barrier()
        start = time.perf_counter()
        out = jax.block_until_ready(run(*args))
        rates.append(count(out) / (time.perf_counter() - start))
    result = {"app": app, "backend": backend, "ranks": comm.Get_size(), "first_s": first}
    result |= {"steps_per_s": max(rates), "checksum": checksum(out)}
    if comm.Get_rank() == 0:
        print(json.dumps(result), flush=True)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(apps, rounds, log):
    """Every case of `apps`, `rounds` times over (the rounds interleave the
    cases, so that a slow spell of the machine hits them alike)."""
    mpirun = os.environ.get("MPIJAX_MPIRUN", "mpirun")
    runs = []
    for _ in range(rounds):
        for app in apps:
            for ranks in (1, 2):
                for backend in BACKENDS:
                    if backend == "local" and ranks > 1:
                        continue
                    command = [mpirun, "-n", str(ranks), "--bind-to", "core", sys.executable, __file__]
                    command += ["--case", app, backend]
                    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
                    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                    log.write(f"$ {' '.join(command[:3])} ... --case {app} {backend}\n")
                    if proc.returncode or not lines:
                        log.write(f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}\n")
                        runs.append({"app": app, "backend": backend, "ranks": ranks, "error": proc.stderr[-300:]})
                    else:
                        log.write(lines[-1] + "\n")
                        runs.append(json.loads(lines[-1]))
                    log.flush()
    return runs


def summarize(runs):
    """Per case: the median over rounds of steps/s and of the first call's
    time; the parallel efficiency from 1 to 2 ranks; the checksums' spread."""
    cases = {}
    for run in runs:
        cases.setdefault((run["app"], run["backend"], run["ranks"]), []).append(run)
    table = []
    for (app, backend, ranks), group in cases.items():
        ok = [r for r in group if "error" not in r]
        row = {"app": app, "backend": backend, "ranks": ranks, "rounds": len(ok)}
        if ok:
            row["steps_per_s"] = statistics.median(r["steps_per_s"] for r in ok)
            row["first_s"] = statistics.median(r["first_s"] for r in ok)
            row["checksum"] = ok[0]["checksum"]
        else:
            row["error"] = group[0]["error"]
        table.append(row)
    rate = {(r["app"], r["backend"], r["ranks"]): r.get("steps_per_s") for r in table}
    for row in table:
        one = rate.get((row["app"], row["backend"], 1))
        if row["ranks"] == 2 and one and row.get("steps_per_s"):
            row["efficiency"] = row["steps_per_s"] / (2 * one)
        mine = rate.get((row["app"], "mpijax", row["ranks"]))
        if mine and row.get("steps_per_s"):
            row["mpijax_speedup"] = mine / row["steps_per_s"]
    for app in {r["app"] for r in table}:
        for ranks in (1, 2):
            sums = [r["checksum"] for r in table if r["app"] == app and r["ranks"] == ranks and "checksum" in r]
            spread = (max(sums) - min(sums)) / abs(max(sums, key=abs))
            if spread > 1e-5:
                raise SystemExit(f"{app} at {ranks} ranks: the backends' results differ ({sums})")
    return table


def markdown(table):
    lines = [
        "| application | backend | ranks | steps/s | mpijax is × faster | efficiency 1→2 | first call (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['app']} | {r['backend']} | {r['ranks']} | failed: {r['error'][-80:]!r} | | | |")
            continue
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else ""
        lines.append(
            f"| {r['app']} | {r['backend']} | {r['ranks']} | {r['steps_per_s']:.0f} | "
            f"{r['mpijax_speedup']:.2f} | {eff} | {r['first_s']:.2f} |"
        )
    return "\n".join(lines)


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = list(CASES)
    fig, axes = plt.subplots(1, len(apps), figsize=(4.5 * len(apps), 3.6))
    for ax, app in zip(axes, apps, strict=True):
        for k, ranks in enumerate((1, 2)):
            rows = [r for r in table if r["app"] == app and r["ranks"] == ranks and "steps_per_s" in r]
            names = [r["backend"] for r in rows]
            xs = [BACKENDS.index(n) + 0.4 * k - 0.2 for n in names]
            ax.bar(xs, [r["steps_per_s"] for r in rows], width=0.4, label=f"{ranks} rank{'s' * (ranks > 1)}")
        ax.set_xticks(range(len(BACKENDS)), BACKENDS, rotation=30)
        ax.set(title=app, ylabel="steps per second")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs=2, metavar=("APP", "BACKEND"), help="run one case (under mpirun)")
    parser.add_argument("--only", choices=CASES, nargs="*", default=list(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.case:
        return run_case(*args.case)
    out = ROOT / "docs" / "benchmarks"
    with open(out / "apps.log", "w") as log:
        log.write(f"== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {_versions()}\n")
        runs = sweep(args.only, args.rounds, log)
    table = summarize(runs)
    (out / "apps.json").write_text(json.dumps({"versions": _versions(), "runs": runs, "table": table}, indent=1))
    plot(table, out / "apps.png")
    print(markdown(table))


def _versions():
    import importlib.metadata

    mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    packages = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("jax", "mpi4jax", "mpi4py"))
    return f"{packages}, {mpi}"


if __name__ == "__main__":
    main()
