"""bcast, gather, scatter, allgather, alltoall, barrier against NumPy
references built from every rank's input."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import BIG, DTYPES, MODES, RANK, SHAPES, SIZE, all_data, assert_equal, checkerboard, data, hlo_copies

ROOTS = list(range(SIZE))


def run(mode, f, x):
    return MODES[mode](f)(x)


@checkerboard(4, dtype=DTYPES, shape=SHAPES, root=ROOTS)
def test_bcast(comm, mode, dtype, shape, root):
    xs = all_data(shape, dtype)
    result = run(mode, lambda x: mpijax.bcast(x, root, comm=comm), xs[RANK])
    assert_equal(result, xs[root])


@checkerboard(4, dtype=DTYPES, shape=SHAPES, root=ROOTS)
def test_gather(comm, mode, dtype, shape, root):
    xs = all_data(shape, dtype)
    result = run(mode, lambda x: mpijax.gather(x, root, comm=comm), xs[RANK])
    assert_equal(result, np.stack(xs) if RANK == root else xs[RANK])


UPDATES = {
    "functional": lambda x, y, i: x * 0.5 + 1.0,
    "stencil": lambda x, y, i: x.at[1:-1].add(0.1 * (x[2:] - x[:-2])),
    "element of the result": lambda x, y, i: x.at[i].set(y.ravel()[i + 1]),
}


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("op", ["gather", "gatherv", "reduce", "bcast"])
def test_where_x_is_returned_it_is_not_copied(comm, op, update):
    """Where a rooted call returns x itself (off the root for gather and
    reduce, on the root for bcast), a time loop that observes its state
    through the call and goes on updating it compiles with no more copies of
    the state than the same loop without the call. (An output aliased to x
    made XLA copy x before every call there, unless the update read the
    result.)"""
    root = SIZE - 1
    call = {
        "gather": lambda x: mpijax.gather(x, root, comm=comm),
        "gatherv": lambda x: mpijax.gatherv(x, (x.shape[0],) * SIZE, root, comm=comm),
        "reduce": lambda x: mpijax.reduce(x, MPI.SUM, root, comm=comm),
        "bcast": lambda x: mpijax.bcast(x, root, comm=comm),
    }[op]
    if (RANK == root) != (op == "bcast"):
        pytest.skip("x is not returned on this rank")

    def copies(observe):
        def step(i, carry):
            x, seen = carry
            y = observe(x)
            return UPDATES[update](x, y, i), seen + y.ravel()[i]

        return hlo_copies(jax.jit(lambda x: lax.fori_loop(0, 3, step, (x, jnp.zeros(())))), jnp.ones(1024, jnp.float32))

    assert len(copies(call)) <= len(copies(lambda x: x * 1.0)), copies(call)


@checkerboard(4, dtype=DTYPES, shape=SHAPES, root=ROOTS)
def test_scatter(comm, mode, dtype, shape, root):
    blocks = data((SIZE, *shape), dtype, rank=root)  # only the root's data travels
    x = blocks if RANK == root else data(shape, dtype, RANK, seed=1)
    result = run(mode, lambda x: mpijax.scatter(x, root, comm=comm), x)
    assert_equal(result, blocks[RANK])


@checkerboard(2, dtype=DTYPES, shape=SHAPES)
def test_allgather(comm, mode, dtype, shape):
    xs = all_data(shape, dtype)
    result = run(mode, lambda x: mpijax.allgather(x, comm=comm), xs[RANK])
    assert_equal(result, np.stack(xs))


@checkerboard(2, dtype=DTYPES, shape=SHAPES)
def test_alltoall(comm, mode, dtype, shape):
    xs = all_data((SIZE, *shape), dtype)
    result = run(mode, lambda x: mpijax.alltoall(x, comm=comm), xs[RANK])
    assert_equal(result, np.stack([xs[r][RANK] for r in range(SIZE)]))


@pytest.mark.parametrize("mode", MODES)
def test_barrier_lets_no_rank_leave_before_every_rank_arrived(comm, mode):
    """Each rank in turn arrives late (after a sleep); every rank must leave
    after that rank arrived. The ranks compare their clock readings afterwards,
    an ordering, not a duration: they share one machine's monotonic clock."""
    if len(set(comm.allgather(MPI.Get_processor_name()))) > 1:
        pytest.skip("compares clock readings: needs every rank on one machine")
    barrier = MODES[mode](lambda: mpijax.barrier(comm=comm))
    barrier()  # compile outside the timed rounds
    jax.effects_barrier()
    for late in range(SIZE):
        if RANK == late:
            time.sleep(0.2)
        arrived = time.monotonic()
        assert barrier() is None
        jax.effects_barrier()  # the call may have been dispatched asynchronously
        times = comm.allgather((arrived, time.monotonic()))
        assert all(left >= times[late][0] for _, left in times), (late, times)


BIG_OPS = {
    "bcast": lambda x, root, comm: mpijax.bcast(x, root, comm=comm),
    "gather": lambda x, root, comm: mpijax.gather(x, root, comm=comm),
    "scatter": lambda x, root, comm: mpijax.scatter(x, root, comm=comm),
    "allgather": lambda x, root, comm: mpijax.allgather(x, comm=comm),
    "alltoall": lambda x, root, comm: mpijax.alltoall(x, comm=comm),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", BIG_OPS)
def test_8MiB(comm, mode, name):
    """Each rank contributes or receives 8 MiB per block."""
    n = BIG // 4
    root = SIZE - 1
    blocks = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(SIZE)]
    stacked = np.stack(blocks)
    if name in ("scatter", "alltoall"):
        x = stacked * (RANK + 1) if (name == "alltoall" or RANK == root) else blocks[0]
    else:
        x = blocks[RANK]
    result = np.asarray(run(mode, lambda x: BIG_OPS[name](x, root, comm), x))
    want = {
        "bcast": blocks[root],
        "gather": stacked if RANK == root else blocks[RANK],
        "scatter": stacked[RANK] * (root + 1),
        "allgather": stacked,
        "alltoall": np.stack([blocks[RANK] * (r + 1) for r in range(SIZE)]),
    }[name]
    np.testing.assert_array_equal(result, want)
