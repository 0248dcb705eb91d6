"""isend, irecv, ineighbor_exchange and wait against NumPy references built
from every rank's input: eager and jitted, over dtypes and shapes, requests
carried through fori_loop and cond, messages far above the eager limit,
vmap as one call, the compiled schedule (computation placed between start
and wait stays there), and the errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import BIG, MODES, MPI_FAILURE, RANK, SIZE, assert_equal, checkerboard, count_calls, data

pytestmark = pytest.mark.usefixtures("watchdog")

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


@checkerboard(dtype=["bool", "int8", "uint64", "bfloat16", "float32", "complex128"], shape=[(), (0,), (5,), (4, 2)])
def test_isend_irecv_ring(comm, mode, dtype, shape):
    xs = [data(shape, dtype, r) for r in range(SIZE)]

    def f(x):
        received = mpijax.irecv(jnp.zeros_like(x), PREV, tag=3, comm=comm)
        sent = mpijax.isend(x, NEXT, tag=3, comm=comm)
        y, nothing = mpijax.wait([received, sent])
        assert nothing is None
        return y

    assert_equal(MODES[mode](f)(xs[RANK]), xs[PREV])


@pytest.mark.parametrize("mode", MODES)
def test_ineighbor_exchange_matches_neighbor_exchange(comm, mode):
    left = PREV if RANK > 0 else MPI.PROC_NULL
    right = NEXT if RANK < SIZE - 1 else MPI.PROC_NULL
    x = jnp.arange(6.0) + 10 * RANK
    lists = ([x, 2 * x[:2], x[::-1]], [left, right, RANK], [right, left, RANK])

    def f(x):
        return mpijax.wait(mpijax.ineighbor_exchange(*lists, comm=comm))

    for got, want in zip(MODES[mode](f)(x), mpijax.neighbor_exchange(*lists, comm=comm), strict=True):
        assert_equal(got, want)


def test_large_messages_in_flight_together(comm):
    """8 MiB each way: both sends start before either rank waits."""
    x = jnp.arange(BIG // 4, dtype=jnp.float32) + RANK

    @jax.jit
    def f(x):
        sends = [mpijax.isend(x, NEXT, comm=comm), mpijax.isend(x + 1, PREV, tag=1, comm=comm)]
        recvs = [mpijax.irecv(x, PREV, comm=comm), mpijax.irecv(x, NEXT, tag=1, comm=comm)]
        return mpijax.wait(recvs + sends)[:2]

    a, b = f(x)
    base = np.arange(BIG // 4, dtype=np.float32)
    assert_equal(a, base + PREV)
    assert_equal(b, base + NEXT + 1)


def test_requests_carried_through_fori_loop(comm):
    """A pipeline: each iteration waits for the message the previous one
    started and starts the next; the last is waited for after the loop."""
    x = jnp.arange(3.0) + RANK

    @jax.jit
    def f(x):
        def body(_, carry):
            request, total = carry
            (y,) = mpijax.wait(request)
            return mpijax.ineighbor_exchange([y], [PREV], [NEXT], comm=comm), total + y

        first = mpijax.ineighbor_exchange([x], [PREV], [NEXT], comm=comm)
        request, total = lax.fori_loop(0, 4, body, (first, jnp.zeros(3)))
        (last,) = mpijax.wait(request)
        return total, last

    total, last = f(x)
    assert_equal(total, sum(np.arange(3.0) + (RANK - k) % SIZE for k in range(1, 5)))
    assert_equal(last, np.arange(3.0) + (RANK - 5) % SIZE)


@pytest.mark.parametrize("branch", [0, 1])
def test_inside_cond(comm, branch):
    x = jnp.arange(4.0) + RANK

    def exchange(dest, source):
        return lambda x: mpijax.wait(mpijax.ineighbor_exchange([x], [source], [dest], comm=comm))[0]

    y = jax.jit(lambda b, x: lax.cond(b, exchange(PREV, NEXT), exchange(NEXT, PREV), x))(branch, x)
    assert_equal(y, np.arange(4.0) + (NEXT if branch else PREV))


def test_vmap_is_one_start_and_one_wait(comm, capfd):
    batch = jnp.stack([jnp.arange(3.0) + 10 * RANK + b for b in range(4)])

    def f(x):
        request = mpijax.ineighbor_exchange([x, x[:1]], [PREV, NEXT], [NEXT, PREV], comm=comm)
        return mpijax.wait(request)

    vmapped = jax.jit(jax.vmap(f))
    assert count_calls(capfd, lambda: vmapped(batch)) == 2
    a, b = vmapped(batch)
    theirs = lambda r: np.stack([np.arange(3.0) + 10 * r + k for k in range(4)])  # noqa: E731
    assert_equal(a, theirs(PREV))
    assert_equal(b, theirs(NEXT)[:, :1])


def _stencil_step(comm, u):
    request = mpijax.ineighbor_exchange([u[0], u[-1]], [PREV, NEXT], [NEXT, PREV], comm=comm)
    inner = mpijax.started(request, u)
    interior = jnp.tanh(inner @ inner)
    top, bottom = mpijax.wait(request, after=interior)
    return interior, top, bottom


def _scheduled(f, *args):
    """The compiled (scheduled) program's entry, as lines."""
    text = jax.jit(f).lower(*args).compile().as_text()
    return text[text.index("ENTRY") :].splitlines()


def _lines_of(lines, pattern):
    return [i for i, line in enumerate(lines) if re.search(pattern, line)]


START, WAIT = r'custom_call_target="mpijax_start"', r'custom_call_target="mpijax_wait"'


@pytest.mark.parametrize("mode", MODES)
def test_per_example_derivatives_through_isend_and_irecv(comm, mode):
    """vmap of jvp and of grad, the receive into the batched value itself:
    its primal is batched as the sender's is (a constant buffer's is not, and
    cannot meet a batched message: docs/autodiff.md, rule 2)."""

    def f(x):
        received = mpijax.irecv(x, PREV, comm=comm)
        y, _ = mpijax.wait([received, mpijax.isend(x, NEXT, comm=comm)])
        return y

    xs = [np.arange(6.0).reshape(2, 3) + 10 * r for r in range(SIZE)]
    jvps, grads = MODES[mode](
        lambda x: (
            jax.vmap(lambda x: jax.jvp(f, (x,), (2 * x,))[1])(x),
            jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x),
        )
    )(jnp.asarray(xs[RANK]))
    assert_equal(jvps, 2 * xs[PREV])
    assert_equal(grads, 2 * xs[RANK])  # the rank after this one squares this rank's x


def test_work_placed_between_start_and_wait_stays_there(comm):
    """In the compiled (scheduled) program, the work that `started` and
    wait's `after` bracket sits between the start and the wait."""
    u = jnp.ones((64, 64))
    lines = _scheduled(lambda u: _stencil_step(comm, u), u)
    (start,), (wait,) = _lines_of(lines, START), _lines_of(lines, WAIT)
    work = _lines_of(lines, r"\b(dot|fusion|call)\b.*(dot|tanh)|tanh")[0]
    assert start < work < wait, "\n".join(lines)
    interior, top, bottom = jax.jit(lambda u: _stencil_step(comm, u))(u)
    np.testing.assert_allclose(interior, np.tanh(np.full((64, 64), 64.0)))
    assert_equal(top, np.ones(64))


def test_backward_work_stays_between_the_reversed_start_and_its_wait(comm):
    """Under grad, the transpose of the wait starts the reversed messages
    and the transpose of the start waits for them: the transposed work (the
    two products of the matmul's transpose) is scheduled between the two."""

    def loss(u):
        interior, top, bottom = _stencil_step(comm, u)
        return jnp.sum(interior) + jnp.sum(top * bottom)

    u = jnp.ones((64, 64))
    lines = _scheduled(jax.grad(loss), u)
    starts, waits = _lines_of(lines, START), _lines_of(lines, WAIT)
    transposed = [i for i in _lines_of(lines, r"transpose\(jvp\(\)\)/(transpose|dot_general)") if "dot" in lines[i]]
    assert len(starts) == 2 and len(transposed) == 2, "\n".join(lines)
    assert waits[0] < starts[1] < min(transposed) <= max(transposed) < waits[-1], "\n".join(lines)


def _update(u, lo, hi):
    """Rows lo..hi-1 of u after one step of periodic diffusion with a
    nonlinear source (rows lo-1 and hi are read, columns wrap around)."""
    c = u[lo:hi]
    lap = u[lo - 1 : hi - 1] + u[lo + 1 : hi + 1] + jnp.roll(c, 1, 1) + jnp.roll(c, -1, 1) - 4 * c
    return c + 0.1 * lap + 0.05 * jnp.sin(c)


def _overlapped_run(comm, u, steps=3):
    """docs/halo.md's pattern: 4 rows per rank between ghost rows; rows 2 and
    3 are updated while the ghost rows move, rows 1 and 4 after."""

    def step(_, u):
        request = mpijax.ineighbor_exchange([u[1], u[-2]], [NEXT, PREV], [PREV, NEXT], comm=comm)
        interior = _update(mpijax.started(request, u), 2, 4)
        bottom, top = mpijax.wait(request, after=interior)
        u = u.at[-1].set(bottom).at[0].set(top)
        return jnp.concatenate([u[:1], _update(u, 1, 2), interior, _update(u, 4, 5), u[-1:]])

    return jnp.sum(lax.fori_loop(0, steps, step, u)[1:-1] ** 2)


def _global_run(glob, steps=3):
    for _ in range(steps):
        lap = sum(np.roll(glob, s, axis) for axis in (0, 1) for s in (1, -1)) - 4 * glob
        glob = glob + 0.1 * lap + 0.05 * np.sin(glob)
    return np.sum(glob**2)


@pytest.mark.parametrize("mode", MODES)
def test_grad_through_a_loop_of_overlapped_steps(comm, mode):
    """The gradient of the whole run (every rank's loss summed) against
    central finite differences of the same run in NumPy on the whole grid,
    along a random direction; and its value."""
    rng = np.random.default_rng(5)
    glob, direction = rng.normal(size=(2, 4 * SIZE, 5))
    local = lambda g: jnp.asarray(np.pad(g, ((1, 1), (0, 0)), mode="wrap")[4 * RANK : 4 * RANK + 6])  # noqa: E731
    loss, grad = MODES[mode](jax.value_and_grad(lambda u: _overlapped_run(comm, u)))(local(glob))
    np.testing.assert_allclose(comm.allreduce(float(loss)), _global_run(glob), rtol=1e-12)
    mine = float(np.sum(np.asarray(grad)[1:-1] * np.asarray(local(direction))[1:-1]))
    h = 1e-6
    fd = (_global_run(glob + h * direction) - _global_run(glob - h * direction)) / (2 * h)
    np.testing.assert_allclose(comm.allreduce(mine), fd, rtol=1e-6)


# A pipeline: each of 3 iterations waits for the message that the previous
# one started and sends it on, times the sender's u; rank r's loss sums what
# it received. The first message starts before the transformed function.
X0 = np.arange(3.0)[None] + np.arange(SIZE)[:, None]


def _pipeline(u):
    """Every rank's loss, in NumPy, from every rank's u."""
    y, total = np.roll(X0, 1, 0), np.zeros(SIZE)
    for _ in range(3):
        total, y = total + y.sum(1), np.roll(y * u, 1, 0)
    return total + y.sum(1)


def _pipeline_loss(comm):
    def loss(u, first):
        def body(_, carry):
            request, total = carry
            (y,) = mpijax.wait(request)
            return mpijax.ineighbor_exchange([y * u], [PREV], [NEXT], comm=comm), total + jnp.sum(y)

        request, total = lax.fori_loop(0, 3, body, (first, jnp.zeros(())))
        return total + jnp.sum(mpijax.wait(request)[0])

    return loss


def _first(comm):
    return mpijax.ineighbor_exchange([jnp.asarray(X0[RANK])], [PREV], [NEXT], comm=comm)


@pytest.mark.parametrize("mode", MODES)
def test_grad_of_a_pipeline_whose_first_request_starts_outside(comm, mode):
    """The first wait has no derivative messages, the later ones do, and
    all share one transposed wait. The gradient (every rank's, along a random
    direction) against central differences of the pipeline in NumPy; and no
    request is left pending (the transpose of the first wait started
    reversed messages that nothing waited for, until it was guarded by the
    request's id)."""
    rng = np.random.default_rng(7)
    u, direction = rng.normal(size=(2, SIZE, 3))
    before = mpijax._src.runtime.core.pending_requests()
    value, grad = MODES[mode](jax.value_and_grad(_pipeline_loss(comm)))(jnp.asarray(u[RANK]), _first(comm))
    jax.block_until_ready(grad)
    assert mpijax._src.runtime.core.pending_requests() == before
    np.testing.assert_allclose(comm.allreduce(float(value)), _pipeline(u).sum(), rtol=1e-12)
    h = 1e-6
    fd = (_pipeline(u + h * direction).sum() - _pipeline(u - h * direction).sum()) / (2 * h)
    np.testing.assert_allclose(comm.allreduce(float(np.dot(grad, direction[RANK]))), fd, rtol=1e-6)


def test_vmap_and_jacfwd_of_a_pipeline_whose_first_request_starts_outside(comm):
    """vmap batches the loop's request, so the first one, started unbatched,
    is waited for as batched: every element gets its messages (the wait
    refused them as not matching). jacfwd against central differences,
    every rank moving its u along basis vector j at once."""
    rng = np.random.default_rng(8)
    us = rng.normal(size=(2, SIZE, 3))
    loss = _pipeline_loss(comm)
    batched = jax.jit(jax.vmap(loss, in_axes=(0, None)))(jnp.asarray(us[:, RANK]), _first(comm))
    np.testing.assert_allclose(batched, [_pipeline(u)[RANK] for u in us], rtol=1e-12)
    jac = jax.jit(jax.jacfwd(loss))(jnp.asarray(us[0, RANK]), _first(comm))
    h = 1e-6
    for j, e in enumerate(np.eye(3)):
        fd = (_pipeline(us[0] + h * e) - _pipeline(us[0] - h * e))[RANK] / (2 * h)
        np.testing.assert_allclose(jac[j], fd, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_without_neighbours_waits_for_no_requests(comm, mode):
    """A chain whose ranks post requests only to the neighbours they have: at
    1 rank the lists are empty, and started and wait take them (started([],
    x) raised an IndexError; found by a tester)."""
    neighbours = [r for r in (RANK - 1, RANK + 1) if 0 <= r < SIZE]

    def f(x):
        requests = [mpijax.irecv(jnp.zeros_like(x), r, comm=comm) for r in neighbours]
        requests += [mpijax.isend(x, r, comm=comm) for r in neighbours]
        y = 2 * mpijax.started(requests, x)
        received = mpijax.wait(requests)[: len(neighbours)]
        return sum(received, y)

    x = jnp.arange(3.0) + 10 * RANK
    assert_equal(MODES[mode](f)(x), 2 * (np.arange(3.0) + 10 * RANK) + sum(np.arange(3.0) + 10 * r for r in neighbours))


def test_errors(comm):
    with pytest.raises(ValueError, match="source=MPI.ANY_SOURCE is not accepted"):
        mpijax.irecv(jnp.zeros(2), MPI.ANY_SOURCE, comm=comm)
    with pytest.raises(ValueError, match="tag=MPI.ANY_TAG is not accepted"):
        mpijax.isend(jnp.zeros(2), RANK, tag=MPI.ANY_TAG, comm=comm)
    with pytest.raises(TypeError, match="expected mpijax Requests"):
        mpijax.wait([jnp.zeros(2)])
    with pytest.raises(TypeError, match="expected mpijax Requests .* got int"):
        mpijax.wait(3)
    xs = jnp.arange(6.0).reshape(2, 3) + 10 * RANK
    requests = jax.vmap(lambda x: [mpijax.irecv(jnp.zeros_like(x), PREV, comm=comm), mpijax.isend(x, NEXT, comm=comm)])(
        xs
    )
    with pytest.raises(ValueError, match="started under jax.vmap and left it"):
        mpijax.wait(requests)
    received, _ = jax.vmap(mpijax.wait)(requests)
    assert_equal(received, np.arange(6.0).reshape(2, 3) + 10 * PREV)
    with pytest.raises(TypeError, match="after= needs requests"):
        mpijax.wait(after=jnp.zeros(2))
    request = mpijax.ineighbor_exchange([jnp.ones(2)], [RANK], [RANK], comm=comm)
    assert_equal(mpijax.wait(request)[0], np.ones(2))
    # Found while JAX dispatches the eager call, the error comes as JAX raises those: a ValueError.
    with pytest.raises(MPI_FAILURE, match="mpijax.wait: request [0-9]+ is not pending"):
        jax.block_until_ready(mpijax.wait(request))


@pytest.mark.skipif(SIZE < 2, reason="a message to another rank")
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_wait_still_completes_the_requests_after_it(comm, mode):
    """The wait's first request fails (a message longer than its receive):
    the wait raises that, and completes the send after it all the same, so
    that none is left pending (found by a tester: the send stayed pending,
    reported at exit as never waited for)."""
    before = mpijax._src.runtime.core.pending_requests()

    def exchange(x):
        received = mpijax.irecv(jnp.zeros(2), PREV, comm=comm)
        return mpijax.wait([received, mpijax.isend(x, NEXT, comm=comm)])

    with pytest.raises(MPI_FAILURE, match="MPI_ERR_TRUNCATE"):
        jax.block_until_ready(MODES[mode](exchange)(jnp.ones(4)))
    assert mpijax._src.runtime.core.pending_requests() == before


def test_a_wait_refusing_a_request_completes_the_others(comm):
    before = mpijax._src.runtime.core.pending_requests()
    done = mpijax.ineighbor_exchange([jnp.ones(2)], [RANK], [RANK], comm=comm)
    mpijax.wait(done)
    fresh = mpijax.ineighbor_exchange([jnp.ones(2)], [RANK], [RANK], comm=comm)
    with pytest.raises(MPI_FAILURE, match="is not pending"):
        jax.block_until_ready(mpijax.wait([done, fresh]))
    assert mpijax._src.runtime.core.pending_requests() == before


def test_vmap_of_a_loop_whose_elements_stop_apart_refuses_a_carried_request(comm):
    """A request carried through a while_loop whose batch elements stop at
    different steps: each element keeps its own id (the one that stopped,
    a request that a later step's wait took already). The wait used the
    first element's id for all, and the others got another step's message
    (found by a tester, both MPIs) or an error that blamed waiting twice.
    It raises a message that names the cause; elements that stop together
    run as without vmap."""

    def f(x):
        def body(carry):
            x, request = carry
            x = x + mpijax.wait(request)[0] + 1
            return x, mpijax.ineighbor_exchange([x], [PREV], [NEXT], comm=comm)

        def going(carry):
            return mpijax.allreduce(carry[0][0], MPI.MAX, comm=comm) < 50

        x, request = lax.while_loop(going, body, (x, mpijax.ineighbor_exchange([x], [PREV], [NEXT], comm=comm)))
        return x + mpijax.wait(request)[0]

    def reference(starts):  # every rank's start -> this rank's result
        xs = list(starts)
        while max(xs) < 50:
            xs = [x + xs[(r - 1) % SIZE] + 1 for r, x in enumerate(xs)]
        return xs[RANK] + xs[PREV]

    batched = jax.jit(jax.vmap(f))
    together = [[1.0 + r for r in range(SIZE)], [1.1 + r for r in range(SIZE)]]  # 5 steps each
    got = batched(jnp.array([[starts[RANK]] for starts in together]))
    assert_equal(got[:, 0], [reference(starts) for starts in together])
    with pytest.raises(MPI_FAILURE, match="the batch's elements hold different requests"):
        jax.block_until_ready(batched(jnp.array([[1.0], [20.0]])))


def test_vmap_of_a_cond_on_a_batched_predicate_refuses_the_request_it_starts(comm):
    """Each element keeps the request of its own branch: the wait raises as
    for a loop whose elements stop apart (docs/halo.md)."""

    def f(p, x):
        start = lambda x: mpijax.ineighbor_exchange([x], [PREV], [NEXT], comm=comm)  # noqa: E731
        return mpijax.wait(lax.cond(p, start, lambda x: start(2 * x), x))[0]

    with pytest.raises(MPI_FAILURE, match="the batch's elements hold different requests"):
        jax.block_until_ready(jax.jit(jax.vmap(f))(jnp.array([True, False]), jnp.ones((2, 3))))


def test_a_request_never_waited_for_is_an_error_at_trace_time(comm):
    def f(x):
        mpijax.isend(x, RANK, comm=comm)
        return x + 1

    with pytest.raises(ValueError, match=r"1 request\(s\) started by isend, irecv or ineighbor_exchange .* never used"):
        jax.jit(f).lower(jnp.ones(2))
    with pytest.raises(ValueError, match="never used"):
        jax.jit(lambda x: lax.fori_loop(0, 2, lambda i, x: f(x), x)).lower(jnp.ones(2))
    # Passed to started only: still never waited for (a tester's).
    with pytest.raises(ValueError, match="never used"):
        jax.jit(lambda x: mpijax.started(mpijax.isend(x, RANK, comm=comm), x)).lower(jnp.ones(2))
