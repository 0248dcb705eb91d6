"""Check mode, the watchdog, and one MPI call in flight at a time."""

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import MODES, MPI_FAILURE, RANK, SIZE, all_data, assert_equal, data

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE
needs_two = pytest.mark.skipif(SIZE < 2, reason="needs a second rank to disagree with")


@pytest.fixture
def check():
    mpijax.set_check(True)
    yield
    mpijax.set_check(False)


@pytest.fixture
def timeout():
    mpijax.set_timeout(0.5)
    yield 0.5
    mpijax.set_timeout(None)


# Check mode ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_check_mode_runs_agreeing_programs_unchanged(comm, check, mode):
    """Every op, with check mode on, gives the NumPy reference."""
    x = jnp.asarray(data((3, 2), "float32", RANK))
    xs = all_data((3, 2), "float32")
    block = jnp.asarray(np.stack(all_data((2,), "int32"))) + 10 * RANK

    def program(x, block):
        status = MPI.Status()
        return (
            mpijax.allreduce(x, MPI.MAX, comm=comm),
            mpijax.reduce(x, MPI.SUM, SIZE - 1, comm=comm),
            mpijax.scan(x, MPI.SUM, comm=comm),
            mpijax.bcast(x, SIZE - 1, comm=comm),
            mpijax.gather(x, 0, comm=comm),
            mpijax.scatter(block if RANK == 0 else block[0], 0, comm=comm),
            mpijax.allgather(x, comm=comm),
            mpijax.alltoall(block, comm=comm),
            mpijax.sendrecv(x, x, PREV, NEXT, comm=comm, status=status),
            mpijax.barrier(comm=comm),
        )

    out = MODES[mode](program)(x, block)
    blocks = [np.stack(all_data((2,), "int32")) + 10 * r for r in range(SIZE)]
    assert_equal(out[0], np.max(xs, axis=0))
    assert_equal(out[1], np.sum(xs, axis=0) if RANK == SIZE - 1 else xs[RANK])
    assert_equal(out[2], np.sum(xs[: RANK + 1], axis=0))
    assert_equal(out[3], xs[SIZE - 1])
    assert_equal(out[4], np.stack(xs) if RANK == 0 else xs[RANK])
    assert_equal(out[5], blocks[0][RANK])
    assert_equal(out[6], np.stack(xs))
    assert_equal(out[7], np.stack([b[RANK] for b in blocks]))
    assert_equal(out[8], xs[PREV])


@pytest.mark.usefixtures("watchdog")
def test_check_mode_keeps_any_source_working(comm, check):
    """recv from ANY_SOURCE with ANY_TAG takes the message of the rank it
    shook hands with, or one that rank 0 sent itself, which shakes no hands
    (check mode waited for its announcement forever); status says which."""
    status = MPI.Status()
    if RANK == 0:
        mpijax.send(jnp.zeros(3), 0, tag=7, comm=comm)
        got = [mpijax.recv(jnp.zeros(3), comm=comm, status=status) for _ in range(SIZE)]
        senders = sorted(int(g[0]) for g in got)
        assert senders == list(range(SIZE))
        assert status.Get_tag() == 7 and status.Get_source() in senders
    else:
        mpijax.send(jnp.full(3, float(RANK)), 0, tag=7, comm=comm)


X4 = jnp.ones(4, jnp.float32)


# Never applied: check mode stops the call whose ranks disagree on the op.
USER_OP = MPI.Op.Create(lambda a, b, datatype: None, commute=True)


def disagreeing(rank_one, others):
    return rank_one if RANK == 1 else others


MISMATCHES = {
    "shape": (
        lambda comm: mpijax.allreduce(jnp.ones(disagreeing(5, 4), jnp.float32), MPI.SUM, comm=comm),
        r"rank 1 called allreduce\(SUM\) of float32\[5\]",
    ),
    "dtype": (
        lambda comm: mpijax.allreduce(jnp.ones(4, disagreeing(jnp.float64, jnp.float32)), MPI.SUM, comm=comm),
        r"rank 1 called allreduce\(SUM\) of float64\[4\]",
    ),
    "root": (
        lambda comm: mpijax.bcast(jnp.ones(4, jnp.float32), disagreeing(1, 0), comm=comm),
        r"rank 1 called bcast of float32\[4\] with root 1",
    ),
    "op": (
        lambda comm: mpijax.allreduce(jnp.ones(4, jnp.float32), disagreeing(MPI.MAX, MPI.SUM), comm=comm),
        r"rank 1 called allreduce\(MAX\) of float32\[4\]",
    ),
    "user-defined op": (
        lambda comm: mpijax.allreduce(X4, disagreeing(USER_OP, MPI.SUM), comm=comm),
        r"rank 1 called allreduce\(user-defined #\d+\) of float32\[4\]",
    ),
    "operation": (
        lambda comm: mpijax.allgather(X4, comm=comm) if RANK == 1 else mpijax.allreduce(X4, MPI.SUM, comm=comm),
        r"rank 1 called allgather of float32\[4\]",
    ),
    "barrier": (
        lambda comm: mpijax.barrier(comm=comm) if RANK == 1 else mpijax.allreduce(X4, MPI.SUM, comm=comm),
        r"rank 1 called barrier(;|$)",
    ),
    # Rank 1 passes the root's whole array as its template, where MPI alone
    # would leave the result's rows past the first as they were.
    "scatter template": (
        lambda comm: mpijax.scatter(jnp.ones((SIZE, 4), jnp.float32) if RANK < 2 else X4, 0, comm=comm),
        rf"rank 1 called scatter of float32\[{SIZE}, 4\] with root 0",
    ),
}


@needs_two
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MISMATCHES)
def test_check_mode_reports_disagreement_on_every_rank(comm, check, mode, kind):
    call, says = MISMATCHES[kind]
    others = "rank 0" if SIZE == 2 else "ranks 0, 2"
    with pytest.raises(MPI_FAILURE, match=rf"check mode: the ranks disagree.*{others} called") as e:
        jax.block_until_ready(MODES[mode](lambda: call(comm))())
    assert re.search(says, str(e.value))
    # Nothing ran: the communicator is clean and agrees again.
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@needs_two
def test_check_mode_raises_on_jaxs_fast_path_too(comm, check):
    """A function called before takes JAX's C++ dispatch path, which raises an
    error met while it runs the program as a ValueError (JAX >= 0.7.2, jax-ml/jax
    issue 34083; JaxRuntimeError where the error comes later): the same message
    on every rank either way, and the communicator stays clean."""
    f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm))
    for n in (4, 5):  # each shape compiled and run once on every rank
        assert_equal(f(jnp.ones(n)), np.full(n, float(SIZE)))
    with pytest.raises(MPI_FAILURE, match="check mode: the ranks disagree"):
        jax.block_until_ready(f(jnp.ones(disagreeing(5, 4))))
    assert_equal(f(jnp.ones(4)), np.full(4, float(SIZE)))


@needs_two
def test_check_mode_catches_a_jacobian_over_ranks_of_different_sizes(comm, check):
    """jacfwd vmaps over each rank's own input; with counts that differ by rank
    the ranks batch their calls differently (docs/autodiff.md, footnote 1)."""
    counts = tuple(2 if r % 2 == 0 else 0 for r in range(SIZE))
    x = jnp.ones((counts[RANK], 2))
    with pytest.raises(MPI_FAILURE, match="check mode: the ranks disagree"):
        jax.block_until_ready(jax.jacfwd(lambda x: mpijax.allgatherv(x, counts, comm=comm))(x))
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@needs_two
def test_check_mode_catches_a_primal_batched_on_one_rank_only(comm, check):
    """The case of docs/autodiff.md rule 2 that cannot work: under vmap of
    value_and_grad, rank 0's allreduce operand follows x and the others' is a
    constant. Without check mode Open MPI truncates on one rank and returns
    wrong values on another, and MPICH returns garbage (found by a tester)."""

    def f(x):
        return mpijax.allreduce(jnp.sum(x if RANK == 0 else jnp.zeros(3)), MPI.SUM, comm=comm)

    with pytest.raises(MPI_FAILURE, match="check mode: the ranks disagree") as error:
        jax.block_until_ready(jax.vmap(jax.value_and_grad(f))(jnp.ones((2, 3))))
    assert re.search(r"rank 0 called allreduce\(SUM\) of float\d+\[2\]", str(error.value))
    assert re.search(r"ranks? [1-9][0-9, ]* called allreduce\(SUM\) of float\d+\[\]", str(error.value))
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@needs_two
@pytest.mark.parametrize("checked", [False, True], ids=["plain", "check_mode"])
@pytest.mark.parametrize("mode", MODES)
def test_receives_into_larger_buffers_with_and_without_check_mode(comm, checked, mode):
    """A message shorter than its receive buffer, of another shape, fills the
    buffer's front and zeroes the rest, in check mode as without: a sendrecv
    ring, and a send from rank 0 to a recv on rank 1."""
    xs = all_data((2, 3), "float32")

    def program(x):
        ring = mpijax.sendrecv(x, jnp.ones((4, 2), jnp.float32), PREV, NEXT, comm=comm)
        if RANK == 0:
            mpijax.send(x, 1, tag=3, comm=comm)
        if RANK == 1:
            return ring, mpijax.recv(jnp.ones(7, jnp.float32), 0, tag=3, comm=comm)
        return ring, None

    def padded(x, shape):
        return np.concatenate([x.ravel(), np.zeros(math.prod(shape) - x.size, x.dtype)]).reshape(shape)

    mpijax.set_check(checked)
    try:
        ring, received = MODES[mode](program)(jnp.asarray(xs[RANK]))
    finally:
        mpijax.set_check(False)
    assert_equal(ring, padded(xs[PREV], (4, 2)))
    if RANK == 1:
        assert_equal(received, padded(xs[0], (7,)))


# What rank 0 sends with tag 3 to rank 1, which receives float32[4] with
# recvtag; and the two ends as check mode names them.
ILLEGAL_MESSAGES = {
    "overrun": (jnp.ones(5, jnp.float32), 3, "float32[5] with tag 3", "float32[4] with tag 3"),
    "dtype": (jnp.ones(4, jnp.int32), 3, "int32[4] with tag 3", "float32[4] with tag 3"),
    "tag": (jnp.ones(4, jnp.float32), 4, "float32[4] with tag 3", "float32[4] with tag 4"),
}


@needs_two
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ILLEGAL_MESSAGES)
def test_check_mode_reports_a_mismatched_message_at_both_ends(comm, check, mode, kind):
    """A message that would overrun its receive buffer, or has another dtype
    or tag: both ends raise the same message; further ranks are not involved."""
    sent, recvtag, sends, expects = ILLEGAL_MESSAGES[kind]
    says = f"a message does not match its receive: rank 0 sends {sends} (send), rank 1 expects {expects} (recv)"

    def program():
        if RANK == 0:
            return mpijax.send(sent, 1, tag=3, comm=comm)
        if RANK == 1:
            return mpijax.recv(jnp.zeros(4, jnp.float32), 0, tag=recvtag, comm=comm)
        return mpijax.barrier(comm=MPI.COMM_SELF)

    if RANK < 2:
        with pytest.raises(MPI_FAILURE, match=re.escape(says)):
            jax.block_until_ready(MODES[mode](program)())
    else:
        MODES[mode](program)()
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), np.full(2, float(SIZE)))


@needs_two
def test_check_mode_lets_the_matching_half_of_a_sendrecv_complete(comm, check):
    """In a ring where only rank 1's receive buffer is too small, ranks 0 and
    1 raise and the rest of the ring completes, so no rank hangs."""
    size = disagreeing(3, 4)
    f = jax.jit(lambda s, r: mpijax.sendrecv(s, r, PREV, NEXT, comm=comm))
    send, receive = jnp.full(4, RANK, jnp.float32), jnp.zeros(size, jnp.float32)
    if RANK in (0, 1):
        with pytest.raises(MPI_FAILURE, match=r"rank 0 sends float32\[4\].*rank 1 expects float32\[3\]"):
            jax.block_until_ready(f(send, receive))
    else:
        assert_equal(f(send, receive), np.full(4, PREV, np.float32))


@pytest.mark.parametrize("sender", ["mpi4py", "mpijax.isend"])
def test_check_mode_receive_of_a_send_without_handshake_waits(comm, check, timeout, sender):
    """mpi4py's send and mpijax's isend make no handshake, so a checked
    receive of them waits: the watchdog ends the wait, and the message is
    still there. (At one rank the message is to oneself, which check mode
    does not check.)"""
    message = np.arange(2.0)
    if sender == "mpi4py":
        done = comm.Isend(message, NEXT, tag=9).Wait
    else:
        request = mpijax.isend(jnp.asarray(message), NEXT, tag=9, comm=comm)
        done = lambda: mpijax.wait(request)  # noqa: E731
    if SIZE == 1:
        assert_equal(mpijax.recv(jnp.zeros(2), PREV, tag=9, comm=comm), message)
        done()
        return
    with pytest.raises(MPI_FAILURE, match=rf"mpijax\.recv on rank {RANK} of {SIZE} timed out"):
        jax.block_until_ready(mpijax.recv(jnp.zeros(2), PREV, tag=9, comm=comm))
    received = np.zeros(2)
    comm.Recv(received, PREV, tag=9)
    done()
    assert_equal(received, message)


def test_user_tags_stay_clear_of_derivative_and_handshake_tags(comm):
    """Users get the lower half of MPI's tags: derivatives and check mode's
    handshakes use the rest (csrc/tags.h)."""
    largest = core.largest_tag()
    assert largest == (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 5) // 2  # as docs/autodiff.md says
    assert core.derivative_tag(largest) <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 4
    assert core.derivative_tag(core.derivative_tag(7)) == core.derivative_tag(7) > largest
    for tag in (largest + 1, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)):
        with pytest.raises(ValueError, match=f"expected 0 <= tag <= {largest}; mpijax keeps the tags above it"):
            mpijax.send(jnp.ones(1), 0, tag=tag, comm=comm)
    x = jnp.arange(3.0)
    mpijax.send(x, RANK, tag=largest, comm=comm)
    assert_equal(mpijax.recv(jnp.zeros(3), RANK, tag=largest, comm=comm), x)


# Watchdog --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_watchdog_names_the_receive_without_a_sender(comm, timeout, mode):
    """Each rank waits for a message from itself that nobody sends."""
    f = MODES[mode](lambda x: mpijax.recv(x, RANK, tag=77, comm=comm))
    start = time.perf_counter()
    says = rf"mpijax\.recv on rank {RANK} of {SIZE} timed out after 0\.5 s .* from rank {RANK} with tag 77"
    with pytest.raises(MPI_FAILURE, match=says):
        jax.block_until_ready(f(jnp.zeros(2)))
    assert timeout <= time.perf_counter() - start < 30
    # The receive was cancelled: the communicator carries on.
    assert_equal(mpijax.sendrecv(jnp.ones(2), jnp.zeros(2), RANK, RANK, comm=comm), np.ones(2))


@needs_two
def test_watchdog_names_a_collective_that_a_rank_missed(comm, timeout):
    if RANK == 0:
        says = rf"waiting for the other ranks of its communicator \(size {SIZE}\) to call barrier"
        with pytest.raises(MPI_FAILURE, match=says):
            mpijax.barrier(comm=comm)
    MPI.COMM_WORLD.Barrier()
    # Join late, which completes rank 0's abandoned barrier while rank 0 drives
    # progress from the world barrier. Still with a timeout: MPI never matches
    # a blocking collective with rank 0's nonblocking one.
    mpijax.set_timeout(30)
    if RANK != 0:
        mpijax.barrier(comm=comm)
    MPI.COMM_WORLD.Barrier()


@needs_two
def test_a_communicator_whose_collective_timed_out_takes_no_more_calls(comm, timeout):
    """MPI cannot cancel a collective that timed out: a later call on its
    communicator ran beside it (a tester's allreduce after one that timed out
    crashed the process). It is refused, on that communicator only."""
    if RANK == 0:
        with pytest.raises(MPI_FAILURE, match="timed out"):
            mpijax.barrier(comm=comm)
        refused = r"mpijax\.allreduce on rank 0 of \d+: an earlier barrier on this communicator timed out unfinished"
        with pytest.raises(MPI_FAILURE, match=refused):
            jax.block_until_ready(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm))
    MPI.COMM_WORLD.Barrier()
    mpijax.set_timeout(30)  # as above: the others complete rank 0's barrier
    if RANK != 0:
        mpijax.barrier(comm=comm)
    MPI.COMM_WORLD.Barrier()
    assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM), np.full(2, float(SIZE)))


def test_watchdog_lets_calls_that_complete_through(comm, timeout):
    x = jnp.asarray(data((1000,), "float64", RANK))
    f = jax.jit(lambda x: mpijax.allreduce(mpijax.sendrecv(x, x, PREV, NEXT, comm=comm), MPI.SUM, comm=comm))
    assert_equal(f(x), np.sum(all_data((1000,), "float64"), axis=0))


# Each setter, a value to set, and the value to restore (what the other ranks keep).
SETTERS = {
    "set_timeout": (mpijax.set_timeout, lambda: 0.5, core.timeout),
    "set_check": (mpijax.set_check, lambda: not core.check(), core.check),
}


@needs_two
@pytest.mark.parametrize("setter", SETTERS)
def test_setters_leave_queued_calls_the_setting_they_were_dispatched_under(comm, setter):
    """The second receive is queued behind the first, and its message comes
    2 s later. Run under the 0.5 s timeout set meanwhile, it would time out
    (and a queued collective could run its nonblocking form against the
    other ranks' blocking one, which MPI never matches); run in check mode
    against a plain send, it would take the send for the agreement's message."""
    set_to, value, current = SETTERS[setter]
    x = jnp.zeros(3)
    if RANK == 0:
        # XLA:CPU runs a cheap program in the dispatching thread; a matrix
        # product makes this one run behind the dispatch, as larger ones do.
        m = jnp.ones((256, 256))

        def receive_two(x, m):
            return mpijax.recv(x, 1, tag=1, comm=comm), mpijax.recv(x, 1, tag=2, comm=comm), m @ m

        f = jax.jit(receive_two).lower(x, m).compile()
        previous = current()
        received = f(x, m)
        start = time.perf_counter()
        set_to(value())
        try:
            assert time.perf_counter() - start > 1.0, f"{setter} returned before the queued receives ran"
            assert_equal(received[1], np.full(3, 2.0))
        finally:
            set_to(previous)
    elif RANK == 1:
        mpijax.send(x + 1, 0, tag=1, comm=comm)
        time.sleep(2.0)
        mpijax.send(x + 2, 0, tag=2, comm=comm)
    mpijax.wait()


# One call in flight ----------------------------------------------------------


@pytest.mark.parametrize("async_dispatch", [True, False])
def test_independent_large_ops_in_one_jit_never_overlap(comm, async_dispatch):
    """16 independent 1 MiB allreduces and allgathers, which XLA:CPU would be
    free to run concurrently but for the token chain."""
    previous = jax.config.values["jax_cpu_enable_async_dispatch"]
    jax.config.update("jax_cpu_enable_async_dispatch", async_dispatch)
    try:
        xs = [jnp.full(2**18, float(i + RANK), jnp.float32) for i in range(8)]

        @jax.jit
        def f(*xs):
            return [mpijax.allreduce(jnp.sin(x), MPI.SUM, comm=comm) for x in xs] + [
                mpijax.allgather(x * 2, comm=comm) for x in xs
            ]

        jax.block_until_ready(f(*xs))  # compile
        mpijax.call_stats(reset=True)
        for _ in range(3):
            out = f(*xs)
        jax.block_until_ready(out)
        stats = mpijax.call_stats()
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", previous)
    assert stats["calls"] == 3 * 16
    assert stats["max_in_flight"] == 1
    np.testing.assert_allclose(out[0], sum(np.sin(np.float32(r)) for r in range(SIZE)) * np.ones(2**18), rtol=1e-6)
