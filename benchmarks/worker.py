"""Timings of one implementation, run under `mpirun -n 2` by run.py.

Every implementation times the same operations on float32 arrays of the same
sizes, OSU style: one warm-up repetition, then REPS repetitions of
iterations(size) operations between barriers; a repetition's time is the
slowest rank's. The JAX implementations run the operations inside one jitted
lax.fori_loop and subtract the time of the same loop without the operation,
so that Python and JAX dispatch are not counted. mpi4py runs a Python loop and
converts from and to JAX arrays, as a user without a JAX binding would.
Rank 0 prints one JSON line per case: microseconds per operation.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

OPS = ["allreduce", "bcast", "allgather", "alltoall", "sendrecv", "sendrecv_inplace", "pingpong"]
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


def iterations(nbytes):
    return int(np.clip(2**28 // nbytes, 40, 10_000))


def per_op(op):
    return 2 if op == "pingpong" else 1  # a ping-pong iteration is two one-way messages


def shape_of(op, nbytes):
    n = max(nbytes // 4, 1)
    return (SIZE, n) if op == "alltoall" else (n,)


def report(impl, op, nbytes, times):
    if RANK == 0:
        print(json.dumps(dict(impl=impl, op=op, bytes=nbytes, times=times)), flush=True)


def mpi_library():
    """The first line of the MPI library's version (Open MPI's ends with a NUL)."""
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]


def slowest(seconds):
    return WORLD.allreduce(seconds, op=MPI.MAX)


# The JAX bindings' loop bodies: (start of the carry, one step, operations per
# step). Each step's input depends on the previous step's result, so that XLA
# can neither hoist a collective out of the loop nor drop it, and results are
# written in place where the binding can. sendrecv alternates two buffers (two
# operations a step); sendrecv_inplace receives into the array it sends, the
# README's idiom. raw_mpi.cc moves its data the same way.
# allgather and alltoall, whose result has another shape, write one element of
# it, at an index XLA cannot know in advance, back into their input, indexed
# in the input's own shape: an update through a flattened view (ravel, then
# reshape back) made XLA copy alltoall's 2-d input every step.


def _fed_one_element(collective):
    def index(i, a):  # element i % a.size of `a`, as a start index per axis
        return jnp.unravel_index(i % a.size, a.shape)

    def step(i, x):
        result = collective(x)
        element = lax.dynamic_slice(result, index(i, result), (1,) * result.ndim)
        return lax.dynamic_update_slice(x, element.reshape((1,) * x.ndim), index(i, x))

    return (lambda x: x), step, 1


def _alternating(exchange):
    def step(i, carry):
        x, y = carry
        y = exchange(x, y)
        return exchange(y, x), y

    return lambda x: (x, jnp.zeros_like(x)), step, 2


def _fed_back(op, count=1):
    return (lambda x: x), (lambda i, x: op(x)), count


def mpi_bodies(lib, comm):
    """Loop bodies for the mpi4jax API (mpijax and mpi4jax share it)."""

    def pingpong(x):
        if RANK == 0:
            lib.send(x, 1, comm=comm)
            return lib.recv(x, 1, comm=comm)
        x = lib.recv(x, 0, comm=comm)
        lib.send(x, 0, comm=comm)
        return x

    return {
        "allreduce": _fed_back(lambda x: lib.allreduce(x, op=MPI.SUM, comm=comm)),
        "bcast": _fed_back(lambda x: lib.bcast(x, 0, comm=comm)),
        "allgather": _fed_one_element(lambda x: lib.allgather(x, comm=comm)),
        "alltoall": _fed_one_element(lambda x: lib.alltoall(x, comm=comm)),
        "sendrecv": _alternating(lambda s, r: lib.sendrecv(s, r, PREV, NEXT, comm=comm)),
        "sendrecv_inplace": _fed_back(lambda x: lib.sendrecv(x, x, PREV, NEXT, comm=comm)),
        "pingpong": _fed_back(pingpong, 2),
    }


def jax_native_bodies():
    ring = [(j, (j + 1) % SIZE) for j in range(SIZE)]
    return {
        "allreduce": _fed_back(lambda x: lax.psum(x, "i")),
        # lax.pbroadcast has no CPU lowering (JAX 0.10): a psum of the root's value.
        "bcast": _fed_back(lambda x: lax.psum(jnp.where(lax.axis_index("i") == 0, x, 0), "i")),
        "allgather": _fed_one_element(lambda x: lax.all_gather(x, "i")),
        "alltoall": _fed_one_element(lambda x: lax.all_to_all(x, "i", 0, 0)),
        "sendrecv": _alternating(lambda s, r: lax.ppermute(s, "i", ring)),
        "sendrecv_inplace": _fed_back(lambda x: lax.ppermute(x, "i", ring)),
        "pingpong": _fed_back(lambda x: lax.ppermute(lax.ppermute(x, "i", [(0, 1)]), "i", [(1, 0)]), 2),
    }


def loops(body, wrap):
    """The jitted loop of `n` steps, and the same loop without the operation."""
    start, step, _ = body

    def run(step):
        def f(x, n):
            return lax.fori_loop(0, n, step, start(x))

        return jax.jit(wrap(f), static_argnums=1)

    return run(step), run(lambda i, c: c)


def batch(sizes):
    """Every operation at every size."""
    return ((op, nbytes) for nbytes in sizes for op in OPS)


def served():
    """The cases named on rank 0's standard input, one `OP BYTES` line each,
    until a blank line or the end: run.py interleaves implementations case by
    case this way.
    The other ranks wait for the next case asleep rather than spinning in MPI,
    so that an idle server leaves the cores to the one measuring."""
    while True:
        if RANK == 0:
            line = sys.stdin.readline()
            for rank in range(1, SIZE):
                WORLD.send(line, dest=rank, tag=7)
        else:
            request = WORLD.irecv(source=0, tag=7)
            while not (answer := request.test())[0]:
                time.sleep(0.0005)
            line = answer[1]
        if not line.strip():
            return
        op, nbytes = line.split()
        yield op, int(nbytes)


def time_jax_loops(impl, bodies, wrap, make_input, cases, reps, fewer=1):
    compiled = {}  # a server is asked for each case once per round: compile once
    if jax.default_backend() == "gpu":
        fewer *= 10  # a GPU operation takes tens of microseconds or more, a CPU one about one
    for op, nbytes in cases:
        iters = max(iterations(nbytes) // fewer, 10)
        x = make_input(op, nbytes)
        if op not in compiled:  # jax.jit then caches each size's executable
            compiled[op] = loops(bodies[op], wrap)
        with_op, empty = compiled[op]
        count = bodies[op][2]
        steps = max(iters // count, 1)
        jax.block_until_ready((with_op(x, steps), empty(x, steps)))  # compile
        times = []
        for rep in range(reps + 1):
            elapsed = []
            for loop in (with_op, empty):
                WORLD.Barrier()
                start = time.perf_counter()
                jax.block_until_ready(loop(x, steps))
                elapsed.append(time.perf_counter() - start)
            if rep:
                times.append(slowest((elapsed[0] - elapsed[1]) / (steps * count)) * 1e6)
        report(impl, op, nbytes, times)


def run_mpijax(cases, reps, check=False):
    import mpijax

    mpijax.set_check(check)
    comm = WORLD.Dup()
    inputs = lambda op, nbytes: jnp.ones(shape_of(op, nbytes), jnp.float32)  # noqa: E731
    name = "mpijax, check mode" if check else "mpijax" + cuda_aware("MPIJAX_CUDA_AWARE", "MPI4JAX_USE_CUDA_MPI")
    time_jax_loops(name, mpi_bodies(mpijax, comm), lambda f: f, inputs, cases, reps)


def run_mpi4jax(cases, reps):
    import mpi4jax

    comm = WORLD.Dup()
    inputs = lambda op, nbytes: jnp.ones(shape_of(op, nbytes), jnp.float32)  # noqa: E731
    name = f"mpi4jax {mpi4jax.__version__}" + cuda_aware("MPI4JAX_USE_CUDA_MPI")
    time_jax_loops(name, mpi_bodies(mpi4jax, comm), lambda f: f, inputs, cases, reps)


def cuda_aware(*variables):
    """The suffix ", CUDA-aware" where one of the binding's variables asks for that mode."""
    return ", CUDA-aware" if any(os.environ.get(v, "") not in ("", "0") for v in variables) else ""


def run_jax_native(cases, reps):
    """jax.distributed with shard_map collectives over gloo (TCP on loopback)."""
    import socket
    from functools import partial

    from jax._src.lib import _jax  # gloo's address: the only way to pin it to loopback
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    _jax.make_gloo_tcp_collectives = partial(_jax.make_gloo_tcp_collectives, hostname="127.0.0.1")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = WORLD.bcast(port)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=SIZE, process_id=RANK)
    mesh = Mesh(np.array(jax.devices()), ("i",))
    sharding = NamedSharding(mesh, P("i"))

    def wrap(f):
        return lambda x, n: jax.shard_map(
            partial(f, n=n), mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False
        )(x)

    def inputs(op, nbytes):
        local = np.ones(shape_of(op, nbytes), np.float32)
        return jax.make_array_from_process_local_data(sharding, local)

    # gloo takes about a millisecond per operation: a fiftieth of the iterations.
    time_jax_loops(f"JAX shard_map (gloo) {jax.__version__}", jax_native_bodies(), wrap, inputs, cases, reps, fewer=50)
    jax.distributed.shutdown()


def run_mpi4py(cases, reps):
    """mpi4py on NumPy views of JAX arrays, results copied back into JAX."""
    comm = WORLD.Dup()

    def calls(op, x):
        n = x.size
        recv = np.empty((SIZE * n,), np.float32) if op == "allgather" else np.empty_like(np.asarray(x))

        def pingpong(x):
            if RANK == 0:
                comm.Send(np.asarray(x), 1)
                comm.Recv(recv, 1)
            else:
                comm.Recv(recv, 0)
                comm.Send(recv, 0)
            return jnp.asarray(recv)

        def bcast(x):
            buf = np.array(x)  # Bcast writes into its buffer: a writable copy
            comm.Bcast(buf, 0)
            return jnp.asarray(buf)

        def sendrecv_inplace(x):
            buf = np.array(x)  # a writable copy, as for bcast
            comm.Sendrecv_replace(buf, NEXT, source=PREV)
            return jnp.asarray(buf)

        return {
            "allreduce": lambda x: (comm.Allreduce(np.asarray(x), recv), jnp.asarray(recv))[1],
            "bcast": bcast,
            # The result, converted to JAX like the others'; the next call sends
            # its first block (a NumPy view, no copy).
            "allgather": lambda x: (comm.Allgather(np.asarray(x)[:n], recv), jnp.asarray(recv))[1],
            "alltoall": lambda x: (comm.Alltoall(np.asarray(x), recv), jnp.asarray(recv))[1],
            "sendrecv": lambda x: (comm.Sendrecv(np.asarray(x), NEXT, recvbuf=recv, source=PREV), jnp.asarray(recv))[1],
            "sendrecv_inplace": sendrecv_inplace,
            "pingpong": pingpong,
        }[op]

    for op, nbytes in cases:
        iters = iterations(nbytes)
        x = jnp.ones(shape_of(op, nbytes), jnp.float32)
        call = calls(op, x)
        times = []
        for rep in range(reps + 1):
            y = x
            WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                y = call(y)
            jax.block_until_ready(y)
            if rep:
                times.append(slowest((time.perf_counter() - start) / (iters * per_op(op))) * 1e6)
        report("mpi4py + NumPy", op, nbytes, times)


def numpy_call(comm, op, x, y):
    """One operation of run_numpy on x (and y), data flowing as in raw_mpi.cc."""
    flat, step = x.reshape(-1), [0]

    def feed_back():
        step[0] += 1
        flat[step[0] % flat.size] = y[(step[0] * 7) % y.size]

    def sendrecv():
        comm.Sendrecv(x, NEXT, recvbuf=y, source=PREV)
        comm.Sendrecv(y, NEXT, recvbuf=x, source=PREV)

    def pingpong():
        peer = 1 - RANK
        for transfer in (comm.Send, comm.Recv) if RANK == 0 else (comm.Recv, comm.Send):
            transfer(x, peer)

    return {
        "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, x),
        "bcast": lambda: comm.Bcast(x, 0),
        "allgather": lambda: (comm.Allgather(x, y), feed_back()),
        "alltoall": lambda: (comm.Alltoall(x, y), feed_back()),
        "sendrecv": sendrecv,
        "sendrecv_inplace": lambda: comm.Sendrecv_replace(x, NEXT, source=PREV),
        "pingpong": pingpong,
    }[op]


def run_numpy(cases, reps):
    """mpi4py on NumPy arrays alone, no JAX. NumPy asks for transparent huge
    pages for arrays of 4 MiB and more."""
    comm = WORLD.Dup()
    for op, nbytes in cases:
        iters = iterations(nbytes)
        x = np.ones(shape_of(op, nbytes), np.float32)
        call = numpy_call(comm, op, x, np.zeros(SIZE * x.size if op == "allgather" else x.size, np.float32))
        per_call = 2 if op in ("sendrecv", "pingpong") else 1
        times = []
        for rep in range(reps + 1):
            WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            if rep:
                times.append(slowest((time.perf_counter() - start) / (iters * per_call)) * 1e6)
        report("mpi4py, NumPy only", op, nbytes, times)


def per_call_us(f, x, n=5000):
    """Wall time of one call of f, over n calls in a row, each on the last
    one's result (best of three); fewer calls where one takes more than
    100 µs (mpi4jax's eager calls take milliseconds)."""
    jax.block_until_ready(f(x))
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    n = int(min(n, max(20, WORLD.allreduce(0.5 / (time.perf_counter() - start), MPI.MIN))))

    def once():
        WORLD.Barrier()
        start = time.perf_counter()
        y = x
        for _ in range(n):
            y = f(y)
        jax.block_until_ready(y)
        return slowest(time.perf_counter() - start) / n * 1e6

    return min(once() for _ in range(3))


def run_dispatch():
    """What an MPI call costs in JAX's dispatch: a small function called
    eagerly and jitted, without MPI and with one allreduce of 8 bytes (at
    one rank, so that no waiting on another rank is counted), and mpi4py's
    Allreduce on NumPy arrays beside them. mpi4jax and JAX's ordered
    io_callback are timed before mpijax is imported, which changes how JAX
    passes the runtime token of every ordered effect."""
    import mpi4jax
    from jax.experimental import io_callback

    comm = WORLD.Dup()
    x = jnp.ones(2, jnp.float32)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    identity = lambda v: v  # noqa: E731

    def both(f):  # (eager, jitted): the call alone, and jitted with a multiplication
        return per_call_us(f, x), per_call_us(jax.jit(lambda x: f(x) * 1.0), x)

    results = {
        "without MPI (x * 1.0)": (per_call_us(lambda x: x * 1.0, x), per_call_us(jax.jit(lambda x: x * 1.0), x)),
        f"mpi4jax {mpi4jax.__version__} allreduce": both(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)),
        # One callback object: a new one per call would recompile per call.
        "JAX io_callback(ordered=True)": both(lambda x: io_callback(identity, shape, x, ordered=True)),
    }
    array, out = np.ones(2, np.float32), np.empty(2, np.float32)
    results["mpi4py Allreduce on NumPy"] = (per_call_us(lambda _: (comm.Allreduce(array, out), out)[1], array), None)
    import mpijax

    results["mpijax allreduce"] = both(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm))
    if RANK == 0:
        print(json.dumps({"dispatch_us": results}), flush=True)


def rss_mib(field="VmRSS"):
    """The resident set now (or its peak: VmHWM), from the kernel's one count."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def run_memory(calls):
    """Resident memory over many jitted calls that each make an allreduce."""
    import mpijax

    comm = WORLD.Dup()
    x = jnp.ones(2, jnp.float32)
    f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm) * (1.0 / SIZE))
    y = jax.block_until_ready(f(x))
    for _ in range(1000):  # warm-up
        y = f(y)
    jax.block_until_ready(y)
    before = rss_mib()
    for _ in range(calls):
        y = f(y)
    jax.block_until_ready(y)
    after, peak = rss_mib(), rss_mib("VmHWM")
    results = dict(
        calls=calls,
        rss_before_mib=WORLD.allreduce(before, op=MPI.MAX),
        rss_after_mib=WORLD.allreduce(after, op=MPI.MAX),
        peak_rss_mib=WORLD.allreduce(peak, op=MPI.MAX),
    )
    if RANK == 0:
        print(json.dumps({"memory": results}), flush=True)


RUNNERS = {
    "mpijax": run_mpijax,
    "mpijax-check": lambda cases, reps: run_mpijax(cases, reps, check=True),
    "mpi4jax": run_mpi4jax,
    "mpi4py": run_mpi4py,
    "numpy": run_numpy,
    "jax": run_jax_native,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=[*RUNNERS, "dispatch", "memory"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8], help="every operation at these sizes")
    parser.add_argument("--serve", action="store_true", help="the cases named on standard input instead")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    if args.impl == "dispatch":
        run_dispatch()
    elif args.impl == "memory":
        run_memory(args.calls)
    else:
        RUNNERS[args.impl](served() if args.serve else batch(args.sizes), args.reps)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
