"""send, recv, sendrecv: ring exchanges checked against the neighbour's input,
status objects, tags, MPI.PROC_NULL and short messages."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import (
    BIG,
    DTYPES,
    MODES,
    MPI_FAILURE,
    RANK,
    SHAPES,
    SIZE,
    all_data,
    assert_equal,
    big_vector,
    checkerboard,
)

# A receive that waits for a message that never comes fails, not hangs.
pytestmark = pytest.mark.usefixtures("watchdog")

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE


def ring(x, comm, tag=0, template=None):
    """Pass x to the next rank (received into `template`, x by default); even
    ranks send first, odd ranks receive first, so blocking sends of any size
    complete at every ring length."""
    template = x if template is None else template
    if RANK % 2 == 0:
        mpijax.send(x, NEXT, tag=tag, comm=comm)
        return mpijax.recv(template, PREV, tag=tag, comm=comm)
    y = mpijax.recv(template, PREV, tag=tag, comm=comm)
    mpijax.send(x, NEXT, tag=tag, comm=comm)
    return y


@checkerboard(2, dtype=DTYPES, shape=SHAPES)
def test_send_recv_ring(comm, mode, dtype, shape):
    xs = all_data(shape, dtype)
    result = MODES[mode](lambda x: ring(x, comm))(xs[RANK])
    assert_equal(result, xs[PREV])


@checkerboard(2, dtype=DTYPES, shape=SHAPES)
def test_sendrecv_ring(comm, mode, dtype, shape):
    xs = all_data(shape, dtype)
    result = MODES[mode](lambda x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm))(xs[RANK])
    assert_equal(result, xs[PREV])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ring", "sendrecv"])
def test_8MiB(comm, mode, name):
    """At one rank the ring sends to itself first: that must not wait for the
    receive, which only runs after it."""
    f = (lambda x: ring(x, comm)) if name == "ring" else (lambda x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm))
    result = MODES[mode](f)(big_vector(RANK))
    np.testing.assert_array_equal(result, big_vector(PREV))


@pytest.mark.parametrize("check", [False, True], ids=["plain", "check_mode"])
@pytest.mark.parametrize("shape", [(5,), (BIG // 4,)], ids=["5", "8MiB"])
def test_sendrecv_in_place_in_a_loop(comm, check, shape):
    """The README's idiom, x = sendrecv(x, x, ...), in a jitted fori_loop: after
    5 steps around the ring (not a multiple of 2 or 3 ranks), each rank holds
    the input of the rank 5 before it."""
    steps = 5
    xs = all_data(shape, "float32")
    f = jax.jit(lambda x: lax.fori_loop(0, steps, lambda i, x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm), x))
    mpijax.set_check(check)
    try:
        result = f(xs[RANK])
        jax.block_until_ready(result)
    finally:
        mpijax.set_check(False)
    assert_equal(result, xs[(RANK - steps) % SIZE])


@pytest.mark.parametrize("loop", [False, True], ids=["alone", "fori_loop"])
def test_sendrecv_in_place_is_not_copied_first(comm, loop):
    """sendrecv(x, x) hands x itself to the call. An output aliased to recvbuf
    would make XLA copy x first (the call reads x while writing the output):
    a copy per call, and in a loop a second one."""
    step = lambda x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm)  # noqa: E731
    f = (lambda x: lax.fori_loop(0, 3, lambda i, x: step(x), x)) if loop else step
    text = jax.jit(f).lower(jnp.ones(1024, jnp.float32)).compile().as_text()
    call = re.search(r"custom-call\((%[\w.\-]+), (%[\w.\-]+),[^\n]*custom_call_target=\"mpijax_sendrecv\"", text)
    assert call is not None, text
    assert call.group(1) == call.group(2), call.group(0)


def test_sendrecv_different_shapes_and_dtypes(comm):
    """The send and receive buffers are independent; the receive side follows recvbuf."""
    send = jnp.arange(6, dtype=jnp.int32).reshape(2, 3) + RANK
    template = jnp.zeros((3, 2), jnp.int32)
    result = mpijax.sendrecv(send, template, PREV, NEXT, comm=comm)
    assert_equal(result, (np.arange(6, dtype=np.int32) + PREV).reshape(3, 2))


@pytest.mark.parametrize("mode", MODES)
def test_recv_status(comm, mode):
    status = MPI.Status()
    x = jnp.arange(5, dtype=jnp.float64) + RANK

    def f(x):
        if RANK % 2 == 0:
            mpijax.send(x, NEXT, tag=10 + RANK, comm=comm)
            return mpijax.recv(x, MPI.ANY_SOURCE, tag=MPI.ANY_TAG, comm=comm, status=status)
        y = mpijax.recv(x, MPI.ANY_SOURCE, tag=MPI.ANY_TAG, comm=comm, status=status)
        mpijax.send(x, NEXT, tag=10 + RANK, comm=comm)
        return y

    result = MODES[mode](f)(x)
    jax.block_until_ready(result)
    assert_equal(result, np.arange(5.0) + PREV)
    assert status.Get_source() == PREV
    assert status.Get_tag() == 10 + PREV
    assert status.Get_count(MPI.DOUBLE) == 5


@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_status(comm, mode):
    status = MPI.Status()
    x = jnp.arange(3, dtype=jnp.int16)
    f = lambda x: mpijax.sendrecv(x, x, PREV, NEXT, sendtag=RANK, comm=comm, status=status)  # noqa: E731
    jax.block_until_ready(MODES[mode](f)(x))
    assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.SHORT)) == (PREV, PREV, 3)


@pytest.mark.parametrize("op", ["recv", "sendrecv"])
def test_a_fresh_status_per_eager_call(comm, op):
    """1,000 eager calls, each with a new MPI.Status: after the first, nothing
    compiles, compiled programs keep no reference to the statuses, and each
    is filled in from its own message."""
    from mpijax._src.ops import point_to_point

    x = jnp.zeros(2, jnp.int32)

    def call(i):
        status = MPI.Status()
        tag = i % 7 if op == "recv" else 3  # sendrecv compiles once per sendtag (a static parameter)
        if op == "recv":
            message = np.full(2, i, np.int32)
            request = comm.Isend(message, NEXT, tag=tag)  # MPICH does not buffer a blocking send to oneself
            y = mpijax.recv(x, comm=comm, status=status)
            request.Wait()
        else:
            y = mpijax.sendrecv(x + i, x, MPI.ANY_SOURCE, NEXT, sendtag=tag, comm=comm, status=status)
        assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.INT)) == (PREV, tag, 2)
        assert_equal(y, np.full(2, i, np.int32))

    call(0)
    kept = len(point_to_point._statuses)
    compiles = []
    listener = lambda event, seconds, **kw: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i in range(1, 1000):
            call(i)
    finally:
        # JAX 0.8.0 cannot unregister it: there it goes on listening, harmlessly.
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister:
            unregister(listener)
    # No tracing, lowering or compiling: the persistent cache of the test
    # runs (conftest.py) would hide a compile, not a trace.
    assert not [event for event in compiles if event.startswith("/jax/core/compile/")]
    assert len(point_to_point._statuses) == kept


def test_tags_select_messages(comm):
    """Two messages in flight to the same rank are received by tag, in the opposite order."""
    a = jnp.full(4, 1.0) * (RANK + 1)
    b = jnp.full(4, 2.0) * (RANK + 1)

    @jax.jit
    def f(a, b):
        if RANK % 2 == 0:
            mpijax.send(a, NEXT, tag=1, comm=comm)
            mpijax.send(b, NEXT, tag=2, comm=comm)
            y2 = mpijax.recv(b, PREV, tag=2, comm=comm)
            y1 = mpijax.recv(a, PREV, tag=1, comm=comm)
        else:
            y2 = mpijax.recv(b, PREV, tag=2, comm=comm)
            y1 = mpijax.recv(a, PREV, tag=1, comm=comm)
            mpijax.send(a, NEXT, tag=1, comm=comm)
            mpijax.send(b, NEXT, tag=2, comm=comm)
        return y1, y2

    y1, y2 = f(a, b)
    assert_equal(y1, np.full(4, 1.0) * (PREV + 1))
    assert_equal(y2, np.full(4, 2.0) * (PREV + 1))


@pytest.mark.parametrize("mode", MODES)
def test_proc_null_shift(comm, mode):
    """A non-periodic shift: the ends talk to MPI.PROC_NULL, and a receive from
    it yields zeros (never uninitialised memory)."""
    source = RANK - 1 if RANK > 0 else MPI.PROC_NULL
    dest = RANK + 1 if RANK < SIZE - 1 else MPI.PROC_NULL
    x = jnp.arange(4, dtype=jnp.int32) + 100 * (RANK + 1)
    result = MODES[mode](lambda x: mpijax.sendrecv(x, x, source, dest, comm=comm))(x)
    want = np.zeros(4, np.int32) if RANK == 0 else np.arange(4, dtype=np.int32) + 100 * RANK
    assert_equal(result, want)


@pytest.mark.parametrize("mode", MODES)
def test_short_message_leaves_zeros(comm, mode):
    """A message shorter than the receive buffer fills its front; the rest is zero."""
    status = MPI.Status()
    short = jnp.arange(3, dtype=jnp.float32) + 1 + RANK
    template = jnp.full(7, -1.0, jnp.float32)
    f = lambda s, t: mpijax.sendrecv(s, t, PREV, NEXT, comm=comm, status=status)  # noqa: E731
    result = MODES[mode](f)(short, template)
    jax.block_until_ready(result)
    assert_equal(result, np.array([1 + PREV, 2 + PREV, 3 + PREV, 0, 0, 0, 0], np.float32))
    assert status.Get_count(MPI.FLOAT) == 3


@pytest.mark.parametrize("mode", MODES)
def test_a_message_of_another_dtype(comm, mode):
    """The trap of receiving into jnp.zeros(n) with x64 on (float64) what the
    sender holds as float32: MPI carries no types. Four float32 fill the front
    of a float64[4] with their bytes, as the README says; three end inside an
    element, and the receive raises, naming the cause (recv, sendrecv)."""
    x = np.arange(4, dtype=np.float32) + 10 * RANK + 1
    got = MODES[mode](lambda x: ring(x, comm, template=jnp.zeros(4)))(x)
    assert_equal(got, np.concatenate([(x - 10 * (RANK - PREV)).view(np.float64), np.zeros(2)]))

    def one_way(x):  # 12 bytes: every send completes before its receive is posted
        mpijax.send(x, NEXT, comm=comm)
        return mpijax.recv(jnp.zeros(3), PREV, comm=comm)

    for op, f in [("recv", one_way), ("sendrecv", lambda x: mpijax.sendrecv(x, jnp.zeros(3), PREV, NEXT, comm=comm))]:
        match = (
            rf"mpijax\.{op} failed on rank {RANK} of {SIZE}: the message ends inside an element of the "
            rf"float64 array receiving it \(receiving from rank {PREV} .*\): the sender's array has another dtype"
        )
        with pytest.raises(MPI_FAILURE, match=match):
            jax.block_until_ready(MODES[mode](f)(x[:3]))


@pytest.mark.parametrize("mode", MODES)
def test_short_messages_under_vmap_and_jacfwd(comm, mode):
    """Batched, each element's message fills the front of its own receive
    buffer, as the element's own call does (a tester's: the batch's one
    message filled the front of the whole batched buffer); also in a nested
    vmap, with the batch axis last, by sendrecv, recv and its tangent (jacfwd)."""
    xs = [np.arange(24.0).reshape(2, 4, 3) + 100 * r for r in range(SIZE)]
    pad = lambda x: np.concatenate([x, np.zeros((*x.shape[:-1], 2))], -1)  # noqa: E731
    shift = lambda x: mpijax.sendrecv(x, jnp.zeros(5), PREV, NEXT, comm=comm)  # noqa: E731
    assert_equal(MODES[mode](jax.vmap(jax.vmap(shift)))(xs[RANK]), pad(xs[PREV]))
    last = jax.vmap(shift, in_axes=1, out_axes=1)
    assert_equal(MODES[mode](last)(xs[RANK][0].T), pad(xs[PREV][0]).T)

    def received(x):
        return ring(x, comm, template=jnp.zeros(5))

    assert_equal(MODES[mode](jax.vmap(received))(xs[RANK][0]), pad(xs[PREV][0]))
    assert_equal(MODES[mode](jax.jacfwd(received))(xs[RANK][0, 0]), np.eye(5, 3))


@pytest.mark.parametrize("mode", MODES)
def test_reverse_mode_through_short_messages(comm, mode):
    """A message shorter than its receive buffer gets back a cotangent as long
    as itself, which the sender's template holds (a tester found MPI_ERR_TRUNCATE
    instead): grad through a sendrecv ring and through recv with the default
    source and tag, per-example under vmap, of a vmapped loss, the Hessian,
    and with check mode on. Against NumPy: the global loss is the sum over
    ranks of sum(w_r * y_r**2), y_r the previous rank's x padded with zeros."""
    w = lambda r: np.arange(5.0) + 10 * r + 1  # noqa: E731
    expected = lambda x: 2 * w(NEXT)[:3] * x  # noqa: E731

    def by_sendrecv(x):
        return jnp.sum(w(RANK) * mpijax.sendrecv(x, jnp.zeros(5), PREV, NEXT, comm=comm) ** 2)

    def by_recv(x):
        if RANK % 2 == 0:
            mpijax.send(x, NEXT, tag=RANK, comm=comm)
        y = mpijax.recv(jnp.zeros(5), comm=comm)
        if RANK % 2:
            mpijax.send(x, NEXT, tag=RANK, comm=comm)
        return jnp.sum(w(RANK) * y**2)

    x = np.arange(3.0) + RANK + 1  # float64, as jnp.zeros(5) (tests run with x64 on)
    xs = np.stack([x, 2 * x, -x])
    for loss in (by_sendrecv, by_recv):
        np.testing.assert_allclose(MODES[mode](jax.grad(loss))(x), expected(x), rtol=1e-6)
    np.testing.assert_allclose(MODES[mode](jax.vmap(jax.grad(by_sendrecv)))(xs), expected(xs), rtol=1e-6)
    batch_loss = lambda xs: jnp.sum(jax.vmap(by_sendrecv)(xs))  # noqa: E731
    np.testing.assert_allclose(MODES[mode](jax.grad(batch_loss))(xs), expected(xs), rtol=1e-6)
    np.testing.assert_allclose(MODES[mode](jax.hessian(by_sendrecv))(x), np.diag(2 * w(NEXT)[:3]), rtol=1e-6)
    mpijax.set_check(True)
    try:
        checked = MODES[mode](jax.grad(by_recv))(x)
        jax.block_until_ready(checked)
    finally:
        mpijax.set_check(False)
    np.testing.assert_allclose(checked, expected(x), rtol=1e-6)


def test_linear_transpose_of_a_short_message_names_the_cause(comm):
    """jax.linear_transpose does not run the receive, so it cannot know the
    message's length: the whole cotangent goes back, and the sender's
    transposed receive raises, naming that (a tester found the truncation
    blamed on vmap)."""
    f = lambda x: mpijax.sendrecv(x, jnp.zeros(5), PREV, NEXT, recvtag=0, comm=comm)  # noqa: E731
    match = r"(?s)MPI_ERR_TRUNCATE.*a cotangent going back to the sender of a message that was shorter"
    with pytest.raises(MPI_FAILURE, match=match):
        jax.block_until_ready(jax.linear_transpose(f, jnp.ones(3))(jnp.ones(5)))


@pytest.mark.parametrize("mode", MODES)
def test_send_to_self_and_proc_null(comm, mode):
    """Sends to oneself complete before their receives, in order, at any size
    and with any MPI (a blocking MPI_Send to oneself may wait forever)."""

    def program(x, big):
        mpijax.send(jnp.ones(3), MPI.PROC_NULL, comm=comm)
        mpijax.send(x, RANK, tag=5, comm=comm)
        mpijax.send(big, RANK, tag=5, comm=comm)
        mpijax.send(x + 1, RANK, tag=5, comm=comm)
        return [mpijax.recv(a, RANK, tag=5, comm=comm) for a in (jnp.zeros(3), jnp.zeros_like(big), jnp.zeros(3))]

    small, big, last = MODES[mode](program)(jnp.arange(3.0), big_vector(RANK))
    assert_equal(small, np.arange(3.0))
    np.testing.assert_array_equal(big, big_vector(RANK))
    assert_equal(last, np.arange(3.0) + 1)


@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_with_an_integer_end_carries_no_derivative(comm, mode):
    """An integer sent into floats, or floats into integers: in a ring every
    rank has both ends, so no derivative travels on any rank (one used to
    wait for, or send, a cotangent that its peer never sent or received),
    and a later gradient is not disturbed."""
    ids = jnp.arange(4, dtype=jnp.int32) + RANK

    def int_to_float(x):
        return jnp.sum(x**2) + jnp.sum(mpijax.sendrecv(ids, jnp.zeros(4, jnp.float32), PREV, NEXT, comm=comm))

    def float_to_int(x):
        return jnp.sum(x**2) + jnp.sum(mpijax.sendrecv(2 * x, jnp.zeros(4, jnp.int32), PREV, NEXT, comm=comm))

    def floats(x):
        return jnp.sum(mpijax.sendrecv(3 * x, x, PREV, NEXT, comm=comm))

    x = jnp.arange(4, dtype=jnp.float32) + 1
    for f, want in [(int_to_float, 2 * x), (float_to_int, 2 * x), (floats, jnp.full(4, 3.0, jnp.float32))]:
        assert_equal(MODES[mode](jax.grad(f))(x), want)
