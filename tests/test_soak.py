"""Soak and fuzz: long random programs, against NumPy and against mpi4py."""

import math
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import RANK, SIZE, all_data

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE
OPS = ["allreduce", "reduce", "scan", "bcast", "gather", "scatter", "allgather", "alltoall", "sendrecv"]


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# Soak ------------------------------------------------------------------------


def soak_program(rng, comm, length):
    """A jitted loop whose every step makes `length` random operations on
    arrays filled with i + rank + k (step i, operation k), and returns the
    sum of all their results; plus the same sum computed by NumPy."""
    plan = [
        (OPS[rng.integers(len(OPS))], int(rng.integers(1, 4097)), int(rng.integers(SIZE)), rng.choice(["f8", "i4"]))
        for _ in range(length)
    ]

    def op_sum(op, n, root, dtype, i, k):
        value = lambda r: i + r + k  # noqa: E731  every rank's fill value
        everyone = sum(value(r) for r in range(SIZE))
        return {
            "allreduce": n * everyone,
            "reduce": n * (everyone if RANK == root else value(RANK)),
            "scan": n * sum(value(r) for r in range(RANK + 1)),
            "bcast": n * value(root),
            "gather": n * (everyone if RANK == root else value(RANK)),
            "scatter": n * value(root),
            "allgather": n * everyone,
            "alltoall": n * everyone,
            "sendrecv": n * value(PREV),
        }[op]

    def call(op, x, root):
        return {
            "allreduce": lambda: mpijax.allreduce(x, MPI.SUM, comm=comm),
            "reduce": lambda: mpijax.reduce(x, MPI.SUM, root, comm=comm),
            "scan": lambda: mpijax.scan(x, MPI.SUM, comm=comm),
            "bcast": lambda: mpijax.bcast(x, root, comm=comm),
            "gather": lambda: mpijax.gather(x, root, comm=comm),
            "scatter": lambda: mpijax.scatter(x, root, comm=comm),
            "allgather": lambda: mpijax.allgather(x, comm=comm),
            "alltoall": lambda: mpijax.alltoall(x, comm=comm),
            "sendrecv": lambda: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm),
        }[op]()

    @jax.jit
    def run(start, steps):
        def body(i, total):
            for k, (op, n, root, dtype) in enumerate(plan):
                stacked = op == "alltoall" or (op == "scatter" and RANK == root)
                shape = (SIZE, n) if stacked else (n,)
                x = jnp.full(shape, i + RANK + k, dtype)
                total += call(op, x, root).astype(jnp.float64).sum()
            return total

        return lax.fori_loop(start, start + steps, body, jnp.float64(0))

    def expected(start, steps):
        return float(sum(op_sum(op, n, root, d, i, k) for i in range(start, start + steps)
                         for k, (op, n, root, d) in enumerate(plan)))  # fmt: skip

    return run, expected


@pytest.mark.skipif(SIZE != 2, reason="the soak runs at 2 ranks")
@pytest.mark.timeout(600)
def test_soak_100k_operations_with_flat_memory(comm):
    """2 random programs of 50 operations, 1000 steps each: 100,000 MPI
    operations of 1 to 4096 elements; resident memory must stay flat. (Few
    programs, many steps: compiling a program costs seconds, running a step
    of one about a millisecond.)"""
    rng = np.random.default_rng(2026)
    programs = [soak_program(rng, comm, 50) for _ in range(2)]
    for run, expected in programs:  # compile and check one step of each
        assert float(run(0, 1)) == expected(0, 1)
    before = rss_mib()
    mpijax.call_stats(reset=True)
    for run, expected in programs:
        for start in (1, 501):
            assert float(run(start, 500)) == expected(start, 500)
    after = rss_mib()
    calls = mpijax.call_stats()["calls"]
    assert calls == 100_000
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n[rank {RANK}] soak: {calls} operations, RSS {before:.1f} -> {after:.1f} MiB, peak {peak:.1f} MiB")
    assert after - before < 8, f"resident memory grew by {after - before:.1f} MiB over {calls} operations"


# Fuzz ------------------------------------------------------------------------

FUZZ_OPS = OPS + ["send_recv"]  # send_recv: a send and a recv, as two calls
FUZZ_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint32", "float32", "float64", "complex64",
               "complex128"]  # fmt: skip
REDUCTIONS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX}
# Where each rank's message goes and whence its own comes: every pattern
# matches each send with one receive.
PEERS = {
    "ring": (PREV, NEXT),
    "chain": (PREV if RANK > 0 else MPI.PROC_NULL, NEXT if RANK < SIZE - 1 else MPI.PROC_NULL),
    "self": (RANK, RANK),
}


def fuzz_case(rng):
    """One random call, the same on every rank (all draw from one seed)."""
    op = FUZZ_OPS[rng.integers(len(FUZZ_OPS))]
    dtype = FUZZ_DTYPES[rng.integers(len(FUZZ_DTYPES))]
    if op in ("allreduce", "reduce", "scan"):
        dtype = FUZZ_DTYPES[1 + rng.integers(len(FUZZ_DTYPES) - 1)]  # no reductions on bool
    names = ["SUM", "PROD"] if dtype.startswith("complex") else list(REDUCTIONS)
    reduction = names[rng.integers(len(names))]
    shape = [(), (0,), (int(rng.integers(1, 9)),), (int(rng.integers(1, 5)), int(rng.integers(1, 5)))][rng.integers(4)]
    if op in ("scatter", "alltoall"):
        shape = (SIZE, *shape)
    # A receive buffer may hold more than the message, in any shape.
    n = math.prod(shape)
    recv_shape = [shape, (n + int(rng.integers(1, 4)),), (n + 1, 2)][rng.integers(3)]
    peers = list(PEERS)[rng.integers(len(PEERS))]
    return op, dtype, shape, int(rng.integers(SIZE)), reduction, peers, recv_shape, bool(rng.integers(2))


def with_mpi4py(comm, op, x, root, reduction, peers, recv_shape):
    """The same call made by mpi4py on NumPy arrays."""
    out = np.empty_like(x)
    red = REDUCTIONS[reduction]
    if op == "allreduce":
        comm.Allreduce(x, out, red)
    elif op == "reduce":
        comm.Reduce(x, out, red, root)
        out = out if RANK == root else x
    elif op == "scan":
        comm.Scan(x, out, red)
    elif op == "bcast":
        out = np.array(x)  # a writable copy, also of a NumPy scalar
        comm.Bcast(out, root)
    elif op in ("gather", "allgather"):
        out = np.empty((SIZE, *x.shape), x.dtype)
        if op == "gather":
            comm.Gather(x, out, root)
            out = out if RANK == root else x
        else:
            comm.Allgather(x, out)
    elif op == "scatter":
        out = np.empty(x.shape[1:], x.dtype)
        comm.Scatter(x, out, root)
    elif op == "alltoall":
        comm.Alltoall(x, out)
    elif op in ("sendrecv", "send_recv"):
        source, dest = PEERS[peers]
        out = np.zeros(recv_shape, x.dtype)  # MPI leaves the rest as it was, mpijax zeroes it
        comm.Sendrecv(x, dest, recvbuf=out, source=source)
    return out


def send_then_recv(x, template, source, dest, comm):
    """A send and a recv in an order that cannot deadlock: rank 0 and a rank
    that messages itself send first, the others pass the message on."""
    if RANK == 0 or source == RANK:
        mpijax.send(x, dest, comm=comm)
        return mpijax.recv(template, source, comm=comm)
    received = mpijax.recv(template, source, comm=comm)
    mpijax.send(x, dest, comm=comm)
    return received


def with_mpijax(comm, op, x, root, reduction, peers, recv_shape):
    red = REDUCTIONS[reduction]
    source, dest = PEERS[peers]
    template = jnp.ones(recv_shape, x.dtype)  # a constant: only its shape and dtype count
    return {
        "allreduce": lambda x: mpijax.allreduce(x, red, comm=comm),
        "reduce": lambda x: mpijax.reduce(x, red, root, comm=comm),
        "scan": lambda x: mpijax.scan(x, red, comm=comm),
        "bcast": lambda x: mpijax.bcast(x, root, comm=comm),
        "gather": lambda x: mpijax.gather(x, root, comm=comm),
        "scatter": lambda x: mpijax.scatter(x, root, comm=comm),
        "allgather": lambda x: mpijax.allgather(x, comm=comm),
        "alltoall": lambda x: mpijax.alltoall(x, comm=comm),
        "sendrecv": lambda x: mpijax.sendrecv(x, template, source, dest, comm=comm),
        "send_recv": lambda x: send_then_recv(x, template, source, dest, comm),
    }[op]


# Other programs at each number of ranks.
@pytest.mark.parametrize("seed,check", [(2 * SIZE, False), (2 * SIZE + 1, True)], ids=["plain", "check_mode"])
def test_fuzz_random_programs_against_mpi4py(comm, seed, check):
    """40 random calls per seed (op, dtype, shape, root, reduction, message
    pattern and receive buffer, eager or jit), each compared with mpi4py
    making the same call on NumPy arrays, with and without check mode (which
    must change no result)."""
    rng = np.random.default_rng(seed)
    reference = comm.Dup()
    mpijax.set_check(check)
    try:
        for case in range(40):
            op, dtype, shape, root, reduction, peers, recv_shape, jitted = fuzz_case(rng)
            x = all_data(shape, dtype, seed=case)[RANK]
            f = with_mpijax(comm, op, x, root, reduction, peers, recv_shape)
            mine = x[0] if op == "scatter" and RANK != root else x  # off the root, one block
            got = np.asarray((jax.jit(f) if jitted else f)(jnp.asarray(mine)))
            want = with_mpi4py(reference, op, x, root, reduction, peers, recv_shape)
            where = f"seed {seed} case {case}: {op} {reduction} {dtype}{list(shape)} root {root} {peers} "
            where += f"into {list(recv_shape)} jit {jitted}"
            assert got.dtype == want.dtype and got.shape == want.shape, where
            np.testing.assert_array_equal(got, want, err_msg=where)
    finally:
        mpijax.set_check(False)
        reference.Free()
