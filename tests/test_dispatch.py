"""JAX's fast dispatch path with MPI inside: a jitted or eager MPI call runs
from JAX's C++ dispatch, without its Python path, ahead-of-time compiled
functions run any number of times, exports round-trip, and mpijax.wait()
drains what is queued. (Order across these calls: test_ordering.py.)"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.interpreters import pxla
from jax.experimental import io_callback
from mpi4py import MPI

import mpijax
from test_ordering import send_then_recv

from reference import RANK, SIZE, assert_equal, big_vector

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE


@pytest.fixture
def python_dispatches(monkeypatch):
    """How many executions went through JAX's Python dispatch path (the C++
    fast path calls the executable without it)."""
    count = [0]
    call = pxla.ExecuteReplicated.__call__

    def counted(self, *args):
        count[0] += 1
        return call(self, *args)

    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    return count


def sealed():
    """With several local devices, lowering cannot know which one a program
    will run on, so MPI programs keep JAX's runtime token (its Python path)."""
    return len(jax.local_devices()) == 1


def ring(x, comm):
    return mpijax.sendrecv(x, x, PREV, NEXT, comm=comm)


def test_jitted_and_eager_mpi_calls_take_the_fast_path(comm, python_dispatches):
    """Fails when a JAX upgrade loses the seal: every MPI call would then
    go through the Python path again, as an ordered io_callback does."""
    x = jnp.arange(3.0) + RANK
    callers = {
        "jit": jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm) + ring(x, comm)),
        "eager allreduce": lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm),
        "eager sendrecv": lambda x: ring(x, comm),
        "eager barrier": lambda x: mpijax.barrier(comm=comm),
        "ordered io_callback": jax.jit(lambda x: io_callback(lambda v: v, x, x, ordered=True)),
    }
    counts = {}
    for name, f in callers.items():
        jax.block_until_ready(f(x))  # compiles
        python_dispatches[0] = 0
        for _ in range(3):
            jax.block_until_ready(f(x))
        counts[name] = python_dispatches[0]
    assert counts == {name: 0 if sealed() and name != "ordered io_callback" else 3 for name in callers}


def test_eager_calls_keep_a_bounded_number_of_programs(comm):
    """Each eager call with new parameters (here a tag per iteration) compiles
    a program; keeping them all grew a process by 1.5 MB per iteration. The
    most recently used are kept, and reused."""
    from mpijax._src.ops.point_to_point import sendrecv_p
    from mpijax._src.primitive import EAGER_PROGRAMS

    x = jnp.arange(3.0) + RANK
    for tag in range(EAGER_PROGRAMS + 8):
        assert_equal(mpijax.sendrecv(x, x, PREV, NEXT, sendtag=tag, recvtag=tag, comm=comm), np.arange(3.0) + PREV)
    assert len(sendrecv_p._eager) == EAGER_PROGRAMS
    kept = dict(sendrecv_p._eager)
    mpijax.sendrecv(x, x, PREV, NEXT, sendtag=EAGER_PROGRAMS + 7, recvtag=EAGER_PROGRAMS + 7, comm=comm)
    assert sendrecv_p._eager == kept  # the last one, reused


def test_ahead_of_time_compiled_function_runs_repeatedly(comm, watchdog):
    x = big_vector(RANK)
    compiled = (
        jax.jit(lambda x: send_then_recv(x, comm) + mpijax.allreduce(x[:1], MPI.SUM, comm=comm)).lower(x).compile()
    )
    total = sum(np.asarray(big_vector(r))[0] for r in range(SIZE))
    for i in range(3):
        y = compiled(x + i)
        np.testing.assert_array_equal(y, np.asarray(big_vector(PREV)) + i + total + SIZE * i)


def test_function_without_inputs_compiles_and_runs(comm, watchdog):
    """A jitted function without arguments whose calls take constant buffers:
    sealed as a call, such a program made XLA (JAX 0.11 and 0.12) abort the
    process while compiling it (jax_compat._inline_late)."""
    f = jax.jit(
        lambda: (
            mpijax.allreduce(jnp.zeros(3), MPI.SUM, comm=comm),
            mpijax.allreduce(jnp.zeros((2, 3)) + RANK, MPI.SUM, comm=comm),
            mpijax.sendrecv(jnp.zeros(3) + RANK, jnp.zeros(3), PREV, NEXT, comm=comm),
        )
    )
    for _ in range(2):
        zeros, ranks, received = f()
        np.testing.assert_array_equal(zeros, np.zeros(3))
        np.testing.assert_array_equal(ranks, np.full((2, 3), SIZE * (SIZE - 1) / 2))
        np.testing.assert_array_equal(received, np.full(3, PREV))


def test_export_round_trip(comm, watchdog):
    """jax.export refuses custom calls without a compatibility guarantee
    unless told; with that, an exported MPI function serializes, loads and
    runs (in this process, which registered mpijax's handlers). Unsealed, the
    export carries the MPI effect and JAX threads its token when called."""
    targets = ["mpijax_allreduce", "mpijax_sendrecv"]
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
    f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm) * 2 + ring(x, comm))
    x = jnp.arange(4.0) + RANK
    exported = export.export(f, disabled_checks=checks)(x)
    assert (len(exported.ordered_effects), len(exported.unordered_effects)) == (0 if sealed() else 1, 0)
    loaded = export.deserialize(exported.serialize())
    expected = 2 * sum(np.arange(4.0) + r for r in range(SIZE)) + np.arange(4.0) + PREV
    np.testing.assert_array_equal(loaded.call(x), expected)
    np.testing.assert_array_equal(jax.jit(loaded.call)(x), expected)


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank")
def test_wait_returns_when_queued_calls_have_run(comm, watchdog):
    """Rank 0 queues a receive that rank 1 serves half a second later:
    mpijax.wait() returns only after it has run, without touching its result."""
    x = big_vector(RANK)
    if RANK == 1:
        time.sleep(0.5)
        mpijax.send(x, 0, comm=comm)
    elif RANK == 0:
        before = mpijax.call_stats()["calls"]
        y = jax.jit(lambda x: mpijax.recv(x, 1, comm=comm))(x)
        mpijax.wait()
        stats = mpijax.call_stats()
        assert (stats["calls"] - before, stats["in_flight"]) == (1, 0)
        np.testing.assert_array_equal(y, big_vector(1))
    mpijax.wait()


def test_mpi4py_on_another_communicator_between_queued_calls(comm, watchdog):
    """mpijax's calls run on an XLA thread while Python goes on: mpi4py calls
    on another communicator in between are safe (MPI_THREAD_MULTIPLE)."""
    step = jax.jit(lambda x: mpijax.allreduce(ring(x, comm), MPI.SUM, comm=comm))
    x = jnp.full(2**18, float(RANK))
    results, sums = [], []
    for i in range(5):
        results.append(step(x + i))
        sums.append(MPI.COMM_WORLD.allreduce(i * (RANK + 1)))
    for i, (y, s) in enumerate(zip(results, sums, strict=True)):
        np.testing.assert_array_equal(y, np.full(2**18, sum(range(SIZE)) + SIZE * i))
        assert s == i * SIZE * (SIZE + 1) // 2
