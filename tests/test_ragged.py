"""ragged_alltoall: alltoallv with counts known only when the call runs,
against NumPy computed from every rank's input; particle migration with the
counts computed inside jit; vmap with counts that differ per batch element;
the run-time errors, on every rank they concern. Its derivatives are in
test_autodiff.py's case table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

from reference import MODES, MPI_FAILURE, RANK, SIZE, assert_equal, count_calls, data

pytestmark = pytest.mark.usefixtures("watchdog")


def counts_of(r, seed=0):
    """Rank r's send counts: uneven, zeros among them, the same on every rank
    that computes them."""
    return np.array([(r + 2 * j + seed) % 3 for j in range(SIZE)])


def rows_of(r):
    """Rank r's rows: more than it sends, so some stay behind."""
    return 2 * SIZE + r


def received(xs, counts, r):
    """What rank r receives: from each rank s in turn, its rows for r."""
    parts = []
    for s, x in enumerate(xs):
        start = int(np.sum(counts[s][:r]))
        parts.append(x[start : start + counts[s][r]])
    return np.concatenate(parts)


def padded(rows, n):
    return np.concatenate([rows, np.zeros((n - len(rows), *rows.shape[1:]), rows.dtype)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype,trailing", [("float32", ()), ("int8", (2, 3)), ("bool", (3,)), ("complex64", ()), ("bfloat16", (2,))]
)
def test_matches_numpy(comm, mode, dtype, trailing):
    xs = [data((rows_of(r), *trailing), dtype, r) for r in range(SIZE)]
    counts = [counts_of(r) for r in range(SIZE)]
    out_rows = 2 * SIZE + 1  # above any rank's total: zeros after the rows received
    y, got = MODES[mode](lambda x, c: mpijax.ragged_alltoall(x, c, rows=out_rows, comm=comm))(
        xs[RANK], jnp.asarray(counts[RANK], jnp.int32)
    )
    assert_equal(got, np.array([counts[s][RANK] for s in range(SIZE)], np.int32))
    assert_equal(y, padded(received(xs, counts, RANK), out_rows))


def test_empty_and_default_rows(comm):
    """No rows anywhere; and the result's rows default to x's."""
    y, got = mpijax.ragged_alltoall(jnp.zeros((0, 2)), [0] * SIZE, comm=comm)
    assert y.shape == (0, 2) and list(np.asarray(got)) == [0] * SIZE
    x = jnp.arange(SIZE, dtype=jnp.float32) + 10 * RANK  # one row to each rank
    y, got = mpijax.ragged_alltoall(x, np.ones(SIZE, np.int16), comm=comm)
    assert_equal(y, np.arange(SIZE, dtype=np.float32) * 10 + RANK)
    assert_equal(got, np.ones(SIZE, np.int32))


@pytest.mark.parametrize("dtype", ["int64", "uint32", "uint64", "int32"])
def test_counts_past_int32_are_refused_quoting_them(comm, dtype):
    """Counts of 64-bit and uint32 dtypes (x64 is on here) travel as int64,
    and the received counts are int64 too: a count past 2**31, or 2**32 + 1,
    which int32 would wrap into 1, is refused quoting its value; every rank
    raises (int32 counts, for comparison, are received as int32)."""
    big = {"int32": 2**31 - 1, "uint32": 2**31 + 1}.get(dtype, 2**32 + 1)
    counts = np.zeros(SIZE, dtype)
    y, got = mpijax.ragged_alltoall(jnp.ones((1, 2)), counts, comm=comm)
    assert_equal(got, np.zeros(SIZE, np.int32 if dtype == "int32" else np.int64))
    counts[0] = big if RANK == 0 else 0
    says = (
        f"counts \\[{big}(, 0)*\\] do not fit the 1 rows"
        if RANK == 0
        else "the send_counts of rank 0 do not fit its rows"
    )
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(mpijax.ragged_alltoall(jnp.ones((1, 2)), counts, comm=comm))


def test_particle_migration_with_counts_computed_in_jit(comm):
    """A particle code's step: each particle goes to the rank that owns its
    position (the unit interval split over the ranks), found, sorted and
    counted inside jit; capacity rows with unused ones at the end."""
    capacity, n = 12, 7  # n particles in use on every rank

    def particles(r):
        rng = np.random.default_rng(r)
        return np.concatenate([rng.uniform(0, 1, n), np.full(capacity - n, np.nan)]).astype(np.float32)

    @jax.jit
    def migrate(pos):
        owner = jnp.where(jnp.isnan(pos), SIZE, jnp.floor(pos * SIZE).astype(jnp.int32))  # SIZE: unused
        order = jnp.argsort(owner)
        counts = jnp.bincount(owner, length=SIZE + 1)[:SIZE]
        moved, got = mpijax.ragged_alltoall(pos[order], counts, rows=capacity * SIZE, comm=comm)
        return moved, jnp.sum(got)

    moved, total = migrate(jnp.asarray(particles(RANK)))
    everyone = np.concatenate([particles(r)[:n] for r in range(SIZE)])
    mine = np.sort(everyone[np.floor(everyone * SIZE).astype(int) == RANK])
    assert int(total) == len(mine)
    np.testing.assert_array_equal(np.sort(np.asarray(moved)[: int(total)]), mine)
    assert not np.asarray(moved)[int(total) :].any()


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None)], ids=["counts-batched", "counts-shared"])
def test_vmap_matches_a_loop(comm, in_axes, capfd):
    """One call for the batch (as many MPI calls as one element's), each
    element with its own counts (or all with the same), against the calls one
    by one."""
    batch = 3
    xs = np.stack([data((rows_of(RANK), 2), "float32", RANK, seed) for seed in range(batch)])
    counts = np.stack([counts_of(RANK, seed) for seed in range(batch)])
    if in_axes[1] is None:
        counts = counts[0]
    stacked = np.moveaxis(xs, 0, in_axes[0])
    f = lambda x, c: mpijax.ragged_alltoall(x, c, rows=2 * SIZE, comm=comm)  # noqa: E731
    vmapped = jax.jit(jax.vmap(f, in_axes=in_axes))
    one = counts[0] if in_axes[1] is not None else counts
    calls = count_calls(capfd, lambda: f(xs[0], one))
    assert calls > 0
    assert count_calls(capfd, lambda: vmapped(stacked, counts)) == calls
    y, got = vmapped(stacked, counts)
    for b in range(batch):
        want_y, want_got = f(xs[b], counts[b] if in_axes[1] is not None else counts)
        assert_equal(y[b], want_y)
        assert_equal(got[b], want_got)


def test_argument_errors_at_trace_time(comm):
    x = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match=rf"send_counts must be an integer array of shape \({SIZE},\)"):
        mpijax.ragged_alltoall(x, jnp.zeros(SIZE + 1, jnp.int32), comm=comm)
    with pytest.raises(ValueError, match="send_counts must be an integer array"):
        mpijax.ragged_alltoall(x, jnp.zeros(SIZE), comm=comm)
    with pytest.raises(ValueError, match="rows must be non-negative"):
        mpijax.ragged_alltoall(x, [0] * SIZE, rows=-1, comm=comm)
    with pytest.raises(ValueError, match="x must have a leading axis of rows"):
        mpijax.ragged_alltoall(jnp.float32(1), [0] * SIZE, comm=comm)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank whose counts the others see")
@pytest.mark.parametrize("mode", MODES)
def test_counts_that_do_not_fit_raise_on_every_rank(comm, mode):
    """Rank 1 asks to send more rows than it has: it raises, and so does every
    other rank, naming it."""
    counts = np.full(SIZE, 3) if RANK == 1 else np.eye(SIZE, dtype=int)[0]  # 2 rows each
    x = jnp.ones((2, 2)) * RANK
    says = "counts .* do not fit the 2 rows" if RANK == 1 else "the send_counts of rank 1 do not fit its rows"
    f = MODES[mode](lambda x, c: mpijax.ragged_alltoall(x, c, rows=4 * SIZE, comm=comm))
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(f(x, counts))
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank whose counts the others see")
def test_under_vmap_the_errors_name_the_batch_element(comm):
    """Rank 1's second batch element asks to send more rows than it has."""
    good = np.eye(SIZE, dtype=int)[0]
    counts = np.stack([good, np.full(SIZE, 3) if RANK == 1 else good])
    f = jax.vmap(lambda x, c: mpijax.ragged_alltoall(x, c, rows=4 * SIZE, comm=comm))
    says = (
        r"counts \[[3, ]+\] \(batch element 1\) do not fit the 2 rows"
        if RANK == 1
        else r"the send_counts of rank 1 \(batch element 1\) do not fit its rows"
    )
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(f(jnp.ones((2, 2, 2)), counts))


@pytest.mark.parametrize("mode", MODES)
def test_more_rows_than_the_result_holds_raise_on_every_rank(comm, mode):
    """Every rank sends rank 0 two rows, into a result of one row there: rank
    0 raises, saying so, and every other rank raises naming rank 0; nothing is
    cut silently."""
    counts = np.array([2] + [0] * (SIZE - 1))
    x = jnp.ones((2, 3)) * RANK
    f = MODES[mode](lambda x, c: mpijax.ragged_alltoall(x, c, rows=1, comm=comm))
    says = (
        f"add up to {2 * SIZE} rows, more than the 1 rows" if RANK == 0 else "rank 0 would take more rows than it holds"
    )
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(f(x, counts))
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank whose counts the others see")
@pytest.mark.parametrize("bad", [-1, 5], ids=["negative", "too-many"])
def test_the_rank_whose_counts_do_not_fit_is_the_one_named(comm, bad):
    """The last rank's send_counts do not fit its 4 rows, and what it
    announces would also overfill rank 0's result: every other rank names
    the last rank (a tester: rank 0 said its receives added up to 1 row,
    more than 4, or named itself for another rank's counts)."""
    last = SIZE - 1
    counts = np.array([bad] + [0] * last) if RANK == last else np.eye(SIZE, dtype=int)[0] * 2
    says = "do not fit the 4 rows they send from" if RANK == last else f"the send_counts of rank {last} do not fit"
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(mpijax.ragged_alltoall(jnp.ones((4, 2)), counts, rows=2 * last + 1, comm=comm))


@pytest.mark.parametrize("counts", [[2**32 + 1], [-(2**32) + 1], [2**40]])
def test_host_counts_past_int32_are_refused_without_x64(comm, counts):
    """Without x64, NumPy int64 counts (and Python ints) past int32 saturate
    and are refused, quoting the saturated value, not wrapped by jnp.asarray
    into 1 row (a tester)."""
    saturated = int(np.clip(counts[0], -(2**31), 2**31 - 1))
    says = rf"counts \[{saturated}(, 0)*\] do not fit" if RANK == 0 else "the send_counts of rank 0 do not fit"
    counts = np.array(counts + [0] * (SIZE - 1), np.int64)
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(MPI_FAILURE, match=says):
            jax.block_until_ready(
                mpijax.ragged_alltoall(jnp.ones((1, 2)), counts if RANK == 0 else counts * 0, comm=comm)
            )
    finally:
        jax.config.update("jax_enable_x64", True)


def test_an_overflow_inside_a_loop_stops_every_rank_at_the_same_step(comm):
    """A scan of three exchanges whose second overflows rank 0's result: every
    rank leaves the loop there, raising, so the ranks stay in step and later
    calls match (found by a tester: the others went on to the third step,
    and the next allreduce took their counts, or hung)."""

    def step(carry, counts):
        y, got = mpijax.ragged_alltoall(carry, counts, comm=comm)
        return y, jnp.sum(got)

    steps = np.array(
        [np.eye(SIZE, dtype=np.int32)[RANK], np.eye(SIZE, dtype=np.int32)[0] * 4, np.zeros(SIZE, np.int32)]
    )
    x = jnp.ones((4, 2)) * RANK
    run = jax.jit(lambda x, s: jax.lax.scan(step, x, s))
    if SIZE == 1:
        y, sums = run(x, steps)
        assert_equal(sums, np.array([1, 4, 0]))  # jnp.sum of int32 is int64 under x64
    else:
        says = (
            f"add up to {4 * SIZE} rows, more than the 4 rows"
            if RANK == 0
            else "rank 0 would take more rows than it holds"
        )
        with pytest.raises(MPI_FAILURE, match=says):
            jax.block_until_ready(run(x, steps))
    for _ in range(3):
        assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


def test_check_mode_lets_rows_differ_between_ranks(comm):
    """The ranks' x differ in rows (by design), not in dtype or trailing shape."""
    mpijax.set_check(True)
    try:
        xs = [data((rows_of(r), 2), "float32", r) for r in range(SIZE)]
        counts = [counts_of(r) for r in range(SIZE)]
        y, _ = mpijax.ragged_alltoall(xs[RANK], counts[RANK], rows=2 * SIZE, comm=comm)
        assert_equal(y, padded(received(xs, counts, RANK), 2 * SIZE))
        if SIZE > 1:
            trailing = 3 if RANK == 1 else 2
            with pytest.raises(MPI_FAILURE, match=r"ragged_alltoall of float\d+\[\*, 3\]"):
                jax.block_until_ready(mpijax.ragged_alltoall(jnp.zeros((4, trailing)), [0] * SIZE, comm=comm))
    finally:
        mpijax.set_check(False)
