"""reduce_scatter, exscan and the v-variants (allgatherv, gatherv, scatterv,
alltoallv) against NumPy references built from every rank's input; their
argument checks, and check mode on counts that ranks disagree on. Their
derivatives and vmap are in test_autodiff.py's case table, counts past the
per-call limit in test_large_count.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

from reference import (
    BIG,
    DTYPES,
    MODES,
    MPI_FAILURE,
    RANK,
    SIZE,
    all_data,
    assert_equal,
    checkerboard,
    data,
    hlo_copies,
    np_dtype,
)

ROOTS = list(range(SIZE))
# Rows per rank: uneven (rank r has r + 1), some ranks with none, one rank with all.
LAYOUTS = {
    "uneven": [r + 1 for r in range(SIZE)],
    "some-empty": [2 * (r % 2) for r in range(SIZE)],
    "one-has-all": [0] * (SIZE - 1) + [3],
}
ROWS = [(), (2,)]  # the shape of one row: scalars, or pairs


def run(mode, f, *args):
    return np.asarray(MODES[mode](f)(*args))


def blocks(counts, row, dtype, seed=0):
    """Every rank's rows."""
    return [data((n, *row), dtype, r, seed) for r, n in enumerate(counts)]


@checkerboard(3, dtype=DTYPES, layout=list(LAYOUTS), row=ROWS)
def test_allgatherv(comm, mode, dtype, layout, row):
    counts = LAYOUTS[layout]
    xs = blocks(counts, row, dtype)
    assert_equal(run(mode, lambda x: mpijax.allgatherv(x, counts, comm=comm), xs[RANK]), np.concatenate(xs))


@checkerboard(3, dtype=DTYPES, layout=list(LAYOUTS), root=ROOTS)
def test_gatherv(comm, mode, dtype, layout, root):
    counts = LAYOUTS[layout]
    xs = blocks(counts, (2,), dtype)
    got = run(mode, lambda x: mpijax.gatherv(x, counts, root, comm=comm), xs[RANK])
    assert_equal(got, np.concatenate(xs) if RANK == root else xs[RANK])


@checkerboard(3, dtype=DTYPES, layout=list(LAYOUTS), root=ROOTS)
def test_scatterv(comm, mode, dtype, layout, root):
    counts = LAYOUTS[layout]
    whole = data((sum(counts), 2), dtype, root)  # only the root's data travels
    x = whole if RANK == root else data((counts[RANK], 2), dtype, RANK, seed=1)
    start = sum(counts[:RANK])
    assert_equal(
        run(mode, lambda x: mpijax.scatterv(x, counts, root, comm=comm), x), whole[start : start + counts[RANK]]
    )


def sends(r, layout):
    """Rows rank r sends to each rank."""
    if layout == "uneven":
        return [(r + 2 * j + 1) % 3 for j in range(SIZE)]
    if layout == "some-empty":
        return [2 * ((r + j) % 2) for j in range(SIZE)]
    return [3 if j == SIZE - 1 else 0 for j in range(SIZE)]  # everything to the last rank


@checkerboard(3, dtype=DTYPES, layout=list(LAYOUTS), row=ROWS)
def test_alltoallv(comm, mode, dtype, layout, row):
    send_counts = [sends(r, layout) for r in range(SIZE)]
    xs = [data((sum(send_counts[r]), *row), dtype, r) for r in range(SIZE)]
    parts = [np.split(xs[s], np.cumsum(send_counts[s])[:-1]) for s in range(SIZE)]
    recv_counts = [send_counts[s][RANK] for s in range(SIZE)]
    got = run(mode, lambda x: mpijax.alltoallv(x, send_counts[RANK], recv_counts, comm=comm), xs[RANK])
    assert_equal(got, np.concatenate([parts[s][RANK] for s in range(SIZE)]))


@pytest.mark.parametrize("op", ["alltoallv", "ragged_alltoall"])
def test_a_rank_that_receives_nothing_under_the_watchdog(comm, op):
    """Rank 0 sends two rows to rank 1 and receives none: XLA placed its empty
    result at its input's address, which Open MPI's nonblocking all-to-alls
    took for MPI_IN_PLACE, so rank 0 sent nothing and rank 1 waited (found by
    a tester, under jit of vmap; ragged_alltoall's result empty by rows=0)."""
    send_counts = [[0, 2, *[0] * (SIZE - 2)] if r == 0 else list(np.eye(SIZE, dtype=int)[r]) for r in range(SIZE)]
    if SIZE == 1:
        send_counts = [[0]]
    recv_counts = [send_counts[s][RANK] for s in range(SIZE)]
    xs = [np.arange(sum(send_counts[r]) * 3.0).reshape(-1, 3) + 100 * r for r in range(SIZE)]
    parts = [np.split(2 * xs[s], np.cumsum(send_counts[s])[:-1]) for s in range(SIZE)]
    want = np.concatenate([parts[s][RANK] for s in range(SIZE)])
    if op == "alltoallv":
        f = lambda x: mpijax.alltoallv(x * 2, send_counts[RANK], recv_counts, comm=comm)  # noqa: E731
    else:
        f = lambda x: mpijax.ragged_alltoall(x * 2, np.array(send_counts[RANK]), rows=len(want), comm=comm)[0]  # noqa: E731
    mpijax.set_timeout(20)
    try:
        assert_equal(jax.jit(jax.vmap(f))(np.stack([xs[RANK], 3 * xs[RANK]])), np.stack([want, 3 * want]))
        assert_equal(jax.jit(f)(xs[RANK]), want)
    finally:
        mpijax.set_timeout(None)


# Every reduction defined on the dtype, on a few dtypes of each kind.
REDUCED = {
    "int32": ["SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"],
    "uint8": ["SUM", "MAX", "BAND", "BXOR"],
    "bool": ["LAND", "LOR", "LXOR"],
    "float16": ["SUM", "MIN"],
    "bfloat16": ["SUM", "MAX"],
    "float64": ["SUM", "PROD", "MIN", "MAX"],
    "complex64": ["SUM", "PROD"],
}
NUMPY = {
    "SUM": np.add,
    "PROD": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "LAND": np.logical_and,
    "LOR": np.logical_or,
    "LXOR": np.logical_xor,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}
REDUCTIONS = [(dtype, op) for dtype, ops in REDUCED.items() for op in ops]


def fold(op, values, dtype):
    result = values[0]
    for v in values[1:]:
        result = NUMPY[op](result, v)
    return result.astype(np_dtype(dtype))


@checkerboard(2, **{"dtype,op": REDUCTIONS}, shape=[(), (3,)])
def test_reduce_scatter(comm, mode, dtype, op, shape):
    xs = all_data((SIZE, *shape), dtype)
    got = run(mode, lambda x: mpijax.reduce_scatter(x, getattr(MPI, op), comm=comm), xs[RANK])
    assert_equal(got, fold(op, [x[RANK] for x in xs], dtype))


def identity(op, dtype):
    """What exscan gives rank 0: the identity of op on dtype."""
    dt = np_dtype(dtype)
    if op in ("PROD", "LAND"):
        return np.ones((), dt)
    if op == "BAND":
        return np.array(-1).astype(dt)
    if op in ("MIN", "MAX"):
        if np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            return np.array(info.max if op == "MIN" else info.min, dt)
        return np.array(np.inf if op == "MIN" else -np.inf).astype(dt)
    return np.zeros((), dt)


@checkerboard(3, **{"dtype,op": REDUCTIONS}, shape=[(), (0,), (3,)])
def test_exscan(comm, mode, dtype, op, shape):
    xs = all_data(shape, dtype)
    got = run(mode, lambda x: mpijax.exscan(x, getattr(MPI, op), comm=comm), xs[RANK])
    want = fold(op, xs[:RANK], dtype) if RANK else np.full(shape, identity(op, dtype))
    assert_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_exscan_large_odd(comm, mode):
    """8 MiB and one element more: rank 0's identity (-inf for MAX) is
    written over the whole result, not only its start."""
    xs = all_data((BIG // 4 + 1,), "float32")
    want = np.max(xs[:RANK], axis=0) if RANK else np.full(xs[0].shape, -np.inf, np.float32)
    assert_equal(run(mode, lambda x: mpijax.exscan(x, MPI.MAX, comm=comm), xs[RANK]), want)


def test_exscan_fed_back_adds_no_copy(comm):
    """x = exscan(x) in a loop compiles with no more copies of x, on any rank,
    than the same loop without the call: the handler writes rank 0's identity
    in place. (A constant made in Python there cost two copies per call on
    rank 0.)"""

    def copies(step):
        return hlo_copies(
            jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, x: step(x), x)), jnp.ones(1024, jnp.float32)
        )

    with_call = copies(lambda x: mpijax.exscan(x, MPI.SUM, comm=comm))
    assert len(with_call) <= len(copies(lambda x: x * 1.0)), with_call


def test_exscan_with_a_user_defined_op_gives_zeros_on_rank_0(comm):
    """(1 + a)(1 + b) - 1, an op no predefined one computes."""

    def apply(inbuf, inoutbuf, datatype):
        out = np.frombuffer(inoutbuf, np.float64)
        a = np.frombuffer(inbuf, np.float64)
        out[:] = a + out + a * out

    op = MPI.Op.Create(apply, commute=True)
    try:
        xs = all_data((3,), "float64")
        want = np.prod([1 + x for x in xs[:RANK]], axis=0) - 1 if RANK else np.zeros(3)
        assert_equal(jax.jit(lambda x: mpijax.exscan(x, op, comm=comm))(xs[RANK]), want)
    finally:
        op.Free()


BIG_ROWS = 2**21  # 8 MiB of float32 per rank: far above any eager limit


@pytest.mark.parametrize("mode", MODES)
def test_8MiB_uneven(comm, mode):
    counts = [BIG_ROWS // (r + 1) for r in range(SIZE)]
    xs = [np.arange(n, dtype=np.float32) * (r + 1) for r, n in enumerate(counts)]
    assert_equal(run(mode, lambda x: mpijax.allgatherv(x, counts, comm=comm), xs[RANK]), np.concatenate(xs))
    big = [np.arange(SIZE * (BIG_ROWS // SIZE), dtype=np.float32) + r for r in range(SIZE)]
    send = [BIG_ROWS // SIZE] * SIZE
    got = run(mode, lambda x: mpijax.alltoallv(x, send, send, comm=comm), big[RANK])
    parts = [np.split(b, SIZE) for b in big]
    assert_equal(got, np.concatenate([parts[s][RANK] for s in range(SIZE)]))


# Argument checks: the same message on every rank, at trace time.
BAD_COUNTS = [
    ([1] * (SIZE + 1), ValueError, r"counts has \d+ entries; expected one per rank"),
    ([-1] + [0] * (SIZE - 1), ValueError, "counts must be non-negative"),
    ([1.5] * SIZE, TypeError, r"counts\[0\] must be an int"),
    (3, TypeError, "counts must be a sequence"),
    ({r: 1 for r in range(SIZE)}, TypeError, "counts must be a sequence"),  # its keys are no counts
    (set(range(SIZE)), TypeError, "counts must be a sequence"),  # unordered
]


@pytest.mark.parametrize("counts,error,match", BAD_COUNTS)
@pytest.mark.parametrize("name", ["allgatherv", "gatherv", "scatterv", "alltoallv"])
def test_bad_counts(comm, name, counts, error, match):
    x = jnp.ones((1, 2))
    call = {
        "allgatherv": lambda: mpijax.allgatherv(x, counts, comm=comm),
        "gatherv": lambda: mpijax.gatherv(x, counts, 0, comm=comm),
        "scatterv": lambda: mpijax.scatterv(x, counts, 0, comm=comm),
        "alltoallv": lambda: mpijax.alltoallv(x, counts, [1] * SIZE, comm=comm),
    }[name]
    with pytest.raises(error, match=f"mpijax.{name}: {match}"):
        call()


def test_traced_counts_are_refused(comm):
    with pytest.raises(TypeError, match=r"mpijax.allgatherv: counts\[0\] must be a static Python int"):
        jax.jit(lambda x, n: mpijax.allgatherv(x, [n] * SIZE, comm=comm))(jnp.ones((1,)), 1)


@pytest.mark.parametrize("mode", MODES)
def test_rows_must_match_counts(comm, mode):
    counts = [2] * SIZE
    f = MODES[mode]
    with pytest.raises(ValueError, match=rf"mpijax.allgatherv: x must have shape \(2, ...\) \(counts\[{RANK}\]"):
        f(lambda x: mpijax.allgatherv(x, counts, comm=comm))(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"mpijax.alltoallv: x must have shape \(\d+, ...\) \(sum\(send_counts\)"):
        f(lambda x: mpijax.alltoallv(x, counts, counts, comm=comm))(jnp.ones(()))
    with pytest.raises(ValueError, match=rf"mpijax.reduce_scatter: x must have shape \({SIZE}, ...\)"):
        f(lambda x: mpijax.reduce_scatter(x, MPI.SUM, comm=comm))(jnp.ones((SIZE + 1,)))
    if RANK == 0:
        with pytest.raises(
            ValueError, match=r"mpijax.scatterv: x must have shape \(\d+, ...\) \(sum\(counts\) rows on the root"
        ):
            f(lambda x: mpijax.scatterv(x, counts, 0, comm=comm))(jnp.ones((1,)))


needs_two = pytest.mark.skipif(SIZE < 2, reason="ranks must disagree")


@pytest.fixture
def check():
    mpijax.set_check(True)
    yield
    mpijax.set_check(False)


@needs_two
@pytest.mark.parametrize("mode", MODES)
def test_check_mode_names_the_ranks_whose_counts_differ(comm, check, mode):
    counts = [1] * SIZE if RANK == 1 else [1, 2] + [1] * (SIZE - 2)
    x = jnp.ones((counts[RANK], 2))
    others = "rank 0" if SIZE == 2 else "ranks 0, 2"
    mine = ", ".join(map(str, [1] * SIZE))
    with pytest.raises(MPI_FAILURE, match=r"the ranks disagree on the counts of allgatherv") as e:
        jax.block_until_ready(MODES[mode](lambda x: mpijax.allgatherv(x, counts, comm=comm))(x))
    assert f"{others} passed counts [1, 2" in str(e.value)
    assert f"rank 1 passed counts [{mine}]" in str(e.value)
    # Nothing ran: the communicator is clean.
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@needs_two
def test_check_mode_names_an_alltoallv_pair_that_does_not_match(comm, check):
    send = [1] * SIZE
    recv = [2 if (RANK == 1 and s == 0) else 1 for s in range(SIZE)]  # rank 1 expects 2 rows from rank 0
    with pytest.raises(MPI_FAILURE, match=r"rank 0 sends 1 rows to rank 1, which expects 2"):
        jax.block_until_ready(mpijax.alltoallv(jnp.ones((SIZE, 3)), send, recv, comm=comm))
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))
