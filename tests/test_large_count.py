"""Counts past what one MPI call takes: with the per-call limit lowered to a
few elements every path runs on small arrays; then real arrays of more than
2**31 - 1 elements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import MODES, RANK, SIZE, all_data, assert_equal, checkerboard, data

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE
INT_MAX = 2**31 - 1


@pytest.fixture
def limit():
    assert core.count_limit() == INT_MAX
    core.set_count_limit(7)
    yield
    core.set_count_limit(INT_MAX)


COUNTS = [0, 6, 7, 14, 23]  # below, at, twice and past the limit


@checkerboard(2, dtype=["float16", "int8", "float64", "complex64"], n=COUNTS)
def test_every_op_past_the_limit(comm, limit, mode, dtype, n):
    xs = all_data((n,), dtype)
    blocks = all_data((SIZE, n), dtype, seed=1)
    x, root = xs[RANK], SIZE - 1
    run = lambda f, *a: np.asarray(MODES[mode](f)(*a))  # noqa: E731
    stack = np.stack(xs)
    assert_equal(run(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm), x), stack.sum(0, dtype=stack.dtype))
    assert_equal(run(lambda x: mpijax.scan(x, MPI.SUM, comm=comm), x), stack[: RANK + 1].sum(0, dtype=stack.dtype))
    assert_equal(
        run(lambda x: mpijax.reduce(x, MPI.SUM, root, comm=comm), x),
        stack.sum(0, dtype=stack.dtype) if RANK == root else x,
    )
    assert_equal(run(lambda x: mpijax.bcast(x, root, comm=comm), x), xs[root])
    assert_equal(run(lambda x: mpijax.gather(x, root, comm=comm), x), stack if RANK == root else x)
    assert_equal(
        run(lambda x: mpijax.scatter(x, root, comm=comm), blocks[RANK] if RANK == root else x), blocks[root][RANK]
    )
    assert_equal(run(lambda x: mpijax.allgather(x, comm=comm), x), stack)
    assert_equal(run(lambda b: mpijax.alltoall(b, comm=comm), blocks[RANK]), np.stack([b[RANK] for b in blocks]))
    assert_equal(run(lambda x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm), x), xs[PREV])


@checkerboard(n=COUNTS, timeout=[None, 60])
def test_v_variants_and_reduce_scatter_past_the_limit(comm, limit, mode, n, timeout):
    """Rank r has n + 3r rows: counts and offsets below and past the limit
    (MPI's v-collectives, or one MPI_Alltoallw with 64-bit offsets; and
    ragged_alltoall), with the
    blocking calls and under the watchdog (nonblocking ones, but a blocking
    MPI_Alltoallw where a block needs a derived datatype: docs/design.md)."""
    mpijax.set_timeout(timeout)
    try:
        _v_variants_and_reduce_scatter(comm, mode, n)
    finally:
        mpijax.set_timeout(None)


def _v_variants_and_reduce_scatter(comm, mode, n):
    counts = [n + 3 * r for r in range(SIZE)]
    xs = [data((c, 2), "int16", r) for r, c in enumerate(counts)]
    root = SIZE - 1
    whole = np.concatenate(xs)
    run = lambda f, *a: np.asarray(MODES[mode](f)(*a))  # noqa: E731
    assert_equal(run(lambda x: mpijax.allgatherv(x, counts, comm=comm), xs[RANK]), whole)
    assert_equal(
        run(lambda x: mpijax.gatherv(x, counts, root, comm=comm), xs[RANK]), whole if RANK == root else xs[RANK]
    )
    assert_equal(
        run(lambda x: mpijax.scatterv(x, counts, root, comm=comm), whole if RANK == root else xs[RANK]), xs[RANK]
    )
    # alltoallv: rank r sends n + r + j rows to rank j.
    sent = [[data((n + r + j, 2), "int16", r, seed=j) for j in range(SIZE)] for r in range(SIZE)]
    got = run(
        lambda x: mpijax.alltoallv(
            x, [n + RANK + j for j in range(SIZE)], [n + s + RANK for s in range(SIZE)], comm=comm
        ),
        np.concatenate(sent[RANK]),
    )
    assert_equal(got, np.concatenate([sent[s][RANK] for s in range(SIZE)]))
    # ragged_alltoall, the same rows by counts in an array, into RANK rows
    # more than arrive: at n = 0 and 2 ranks one rank's buffers fit
    # MPI_Alltoallv's ints and the other's do not, and both must choose alike.
    rows = sum(n + s + RANK for s in range(SIZE)) + RANK
    ragged = MODES[mode](lambda x, c: mpijax.ragged_alltoall(x, c, rows=rows, comm=comm))
    got, received = ragged(np.concatenate(sent[RANK]), np.array([n + RANK + j for j in range(SIZE)], np.int32))
    assert_equal(
        np.asarray(got), np.concatenate([*(sent[s][RANK] for s in range(SIZE)), np.zeros((RANK, 2), np.int16)])
    )
    assert_equal(np.asarray(received), np.array([n + s + RANK for s in range(SIZE)], np.int32))
    blocks = all_data((SIZE, n), "float64")
    got = run(lambda x: mpijax.reduce_scatter(x, MPI.SUM, comm=comm), blocks[RANK])
    assert_equal(got, np.sum([b[RANK] for b in blocks], axis=0))


def test_send_recv_past_the_limit_with_status(comm, limit):
    status = MPI.Status()
    x = jnp.asarray(data((20,), "int16", RANK))
    mpijax.send(x, RANK, tag=2, comm=comm)
    got = mpijax.recv(jnp.zeros(25, jnp.int16), RANK, tag=2, comm=comm, status=status)
    assert_equal(got, np.concatenate([np.asarray(x), np.zeros(5, np.int16)]))
    assert status.Get_count(MPI.SHORT) == 20


huge = pytest.mark.skipif(SIZE > 2, reason="2 GiB per array: run at 1 and 2 ranks to stay within memory")
N = 2**31 + 3  # int8 elements: more than INT_MAX


def pattern(offset):
    """int8 values that differ between neighbours, so a misplaced byte shows."""
    return jnp.arange(N, dtype=jnp.int8) + jnp.int8(offset)


def assert_periodic(got, period):
    """got[i] == period[i % 256] for all i, checked block by block to bound memory."""
    assert got.size == N
    block = 256 * 2**16
    tiled = np.tile(period, block // 256)
    for start in range(0, N, block):
        part = got[start : start + block]
        mismatch = np.flatnonzero(part != tiled[: part.size])
        assert mismatch.size == 0, f"{mismatch.size} wrong elements from index {start + mismatch[0]}"


@huge
def test_allreduce_more_than_int_max_elements(comm):
    got = np.asarray(jax.jit(lambda v: mpijax.allreduce(pattern(v), MPI.SUM, comm=comm))(RANK))
    base = np.arange(256, dtype=np.int64)
    assert_periodic(got, (base * SIZE + sum(range(SIZE))).astype(np.int8))


@huge
def test_sendrecv_more_than_int_max_elements(comm):
    f = jax.jit(lambda v: mpijax.sendrecv(pattern(v), jnp.zeros(N, jnp.int8), PREV, NEXT, comm=comm))
    got = np.asarray(f(RANK))
    assert_periodic(got, (np.arange(256) + PREV).astype(np.int8))


@huge
def test_allgatherv_more_than_int_max_elements_in_all(comm):
    """N int8 elements in all, split over the ranks: offsets past 2**30 at
    2 ranks (MPI_Allgatherv), one count past INT_MAX at 1 rank (MPI_Alltoallw)."""
    counts = [N // SIZE + (N % SIZE if r == SIZE - 1 else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    f = jax.jit(lambda v: mpijax.allgatherv(pattern(v)[start : start + counts[RANK]], counts, comm=comm))
    got = np.asarray(f(0))
    assert_periodic(got, np.arange(256).astype(np.int8))
