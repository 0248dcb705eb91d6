"""Program order: the token chain in the lowered program, and runs that would
deadlock (and fail by timeout) if any rank's MPI calls were reordered, merged
or dropped — within a jit, across jits, in loops, cond and custom_vjp."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import MODES, RANK, SIZE, assert_equal, big_vector, count_calls

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE
needs_peer = pytest.mark.skipif(SIZE < 2, reason="needs a second rank")


def send_then_recv(x, comm):
    """Rank parity picks the order, so a reordering on any rank deadlocks."""
    if RANK % 2 == 0:
        mpijax.send(x, NEXT, comm=comm)
        return mpijax.recv(x, PREV, comm=comm)
    y = mpijax.recv(x, PREV, comm=comm)
    mpijax.send(x, NEXT, comm=comm)
    return y


def mpi_calls(text):
    """(target, operand list, result name) of each mpijax custom call in StableHLO text."""
    pattern = r"(%\S+) = stablehlo\.custom_call @(mpijax_\w+)\(([^)]*)\)"
    return [(t, [o.strip() for o in ops.split(",") if o.strip()], r) for r, t, ops in re.findall(pattern, text)]


def chain_start(text, inputs):
    """The token that starts mpijax's chain in StableHLO text, and the names
    under which the calls see the program's first `inputs` arguments: where
    the sealed program is lowered inlined (JAX 0.11 and newer), main's, with
    the token created there; else the sealed function's, or an unsealed
    main's, whose first argument is the token."""
    created = re.search(r"(%\S+) = stablehlo.create_token", text)
    if created and "func.func private @mpijax_sealed" not in text:
        return created.group(1), [f"%arg{i}" for i in range(inputs)]
    return "%arg0", [f"%arg{i + 1}" for i in range(inputs)]


def token_result(name):
    """The token is a call's last result: `%3:2` is used as `%3#1`, `%3` as `%3`."""
    value, _, count = name.partition(":")
    return f"{value}#{int(count) - 1}" if count else value


def test_token_chain_links_every_call(comm):
    """Each MPI call consumes the token that the previous one produced, and
    the first consumes the function's input token."""

    def f(x):
        y = mpijax.allreduce(x, MPI.SUM, comm=comm)
        mpijax.send(x, NEXT, comm=comm)
        z = mpijax.recv(x, PREV, comm=comm)
        mpijax.barrier(comm=comm)
        return y + z

    text = jax.jit(f).lower(jnp.ones(3)).as_text()
    calls = mpi_calls(text)
    assert [c[0] for c in calls] == ["mpijax_allreduce", "mpijax_send", "mpijax_recv", "mpijax_barrier"]
    assert calls[0][1][-1] == chain_start(text, 0)[0]
    for (_, _, previous), (_, operands, _) in zip(calls[:-1], calls[1:], strict=True):
        assert operands[-1] == token_result(previous), (previous, operands)


def test_send_recv_8MiB_in_one_jit(comm):
    result = jax.jit(lambda x: send_then_recv(x, comm))(big_vector(RANK))
    np.testing.assert_array_equal(result, big_vector(PREV))


def test_order_across_jit_calls(comm):
    send = jax.jit(lambda x: mpijax.send(x, NEXT, comm=comm))
    recv = jax.jit(lambda x: mpijax.recv(x, PREV, comm=comm))
    x = big_vector(RANK)
    if RANK % 2 == 0:
        send(x)
        y = recv(x)
    else:
        y = recv(x)
        send(x)
    np.testing.assert_array_equal(y, big_vector(PREV))


def test_many_queued_jitted_and_eager_calls_keep_program_order(comm, watchdog):
    """Nothing blocks until the end: every call is queued behind the last
    (async dispatch), eager and jitted calls alike, and a reordering on any
    rank deadlocks or mixes up the data."""
    send = jax.jit(lambda x: mpijax.send(x, NEXT, comm=comm))
    recv = jax.jit(lambda x: mpijax.recv(x, PREV, comm=comm))
    received, sums = [], []
    for i in range(6):
        x = big_vector(RANK) + i
        if RANK % 2 == 0:
            send(x)
            received.append(recv(x))
        else:
            received.append(recv(x))
            mpijax.send(x, NEXT, comm=comm)
        sums.append(mpijax.allreduce(x[:2], MPI.SUM, comm=comm))
    total = sum(np.asarray(big_vector(r))[:2] for r in range(SIZE))
    for i in range(6):
        np.testing.assert_array_equal(received[i], np.asarray(big_vector(PREV)) + i)
        np.testing.assert_array_equal(sums[i], total + SIZE * i)


def two_devices():
    """Two devices for programs to alternate between: two local ones
    (test_launch.py makes them on the CPU) or, beside a GPU, the GPU and the
    CPU (the seal takes one device; the other's programs keep JAX's token)."""
    devices = jax.local_devices()  # JAX's own list: not to be changed
    if len(devices) == 1 and devices[0].platform != "cpu":
        return [devices[0], jax.local_devices(backend="cpu")[0]]
    return devices[:2]


@pytest.mark.skipif(len(two_devices()) < 2, reason="needs two devices (test_launch.py makes them)")
def test_programs_on_two_devices_keep_program_order(comm, watchdog):
    d0, d1 = two_devices()
    send = jax.jit(lambda x: mpijax.send(x, NEXT, comm=comm))
    recv = jax.jit(lambda x: mpijax.recv(x, PREV, comm=comm))
    received = []
    for i in range(4):
        x = jax.device_put(big_vector(RANK) + i, (d0, d1)[i % 2])
        template = jax.device_put(x, (d1, d0)[i % 2])
        if RANK % 2 == 0:
            send(x)
            received.append(recv(template))
        else:
            received.append(recv(template))
            send(x)
    for i, y in enumerate(received):
        assert y.devices() == {(d1, d0)[i % 2]}
        np.testing.assert_array_equal(y, np.asarray(big_vector(PREV)) + i)


@pytest.mark.skipif(len(jax.local_devices()) < 2, reason="needs two local devices (test_launch.py makes them)")
def test_a_program_over_two_devices_is_refused_on_every_rank(comm):
    """A process makes its MPI calls from one device's program: one over
    several devices is refused, naming its MPI calls, jitted or eager."""
    spread = jax.device_put(jnp.ones(4), NamedSharding(Mesh(jax.local_devices()[:2], "x"), PartitionSpec("x")))
    refused = r"MPI calls \({}\) would run on 2 devices, over which its arrays are sharded"
    with pytest.raises(ValueError, match=refused.format("allreduce, sendrecv")):
        jax.jit(lambda x: mpijax.sendrecv(x, mpijax.allreduce(x, MPI.SUM, comm=comm), PREV, NEXT, comm=comm))(spread)
    with pytest.raises(ValueError, match=refused.format("bcast")):
        mpijax.bcast(spread, 0, comm=comm)


def test_calls_in_one_module_run_one_at_a_time_in_program_order(comm, capfd):
    """12 independent allreduces of 256 KiB and more on arrays made in the
    program, which XLA schedules in another order without the token chain
    (seen with the chain cut): the C++ core logs each when it has run, and
    counts how many ran at once."""
    sizes = [2**16 + 1000 * i for i in np.random.default_rng(0).permutation(12)]
    f = jax.jit(lambda s: [mpijax.allreduce(jnp.full(n, s), MPI.SUM, comm=comm) for n in sizes])
    one = jnp.float32(1)
    jax.block_until_ready(f(one))
    mpijax.call_stats(reset=True)
    core.set_logging(True)
    capfd.readouterr()
    try:
        results = f(one)
        mpijax.wait()
    finally:
        core.set_logging(False)
    logged = re.findall(rf"^mpijax r{RANK} \| allreduce \| op SUM \| (\d+) x float32", capfd.readouterr().err, re.M)
    assert [int(n) for n in logged] == sizes
    assert mpijax.call_stats()["max_in_flight"] == 1
    for r, n in zip(results, sizes, strict=True):
        np.testing.assert_array_equal(r, np.full(n, SIZE, np.float32))


def test_ordered_io_callbacks_between_mpi_calls(comm, watchdog):
    """JAX's own ordered effect beside mpijax's in one function: the
    callbacks run in order, and so do the MPI calls between them."""
    seen = []

    def note(i):
        seen.append(int(i))
        return i

    def f(x):
        for i in range(4):
            x = send_then_recv(x, comm) + io_callback(
                note, jax.ShapeDtypeStruct((), jnp.int32), np.int32(i), ordered=True
            )
        return x

    g = jax.jit(f)
    x = big_vector(RANK, jnp.float64)
    y = g(g(x))
    mpijax.wait()
    assert seen == [0, 1, 2, 3] * 2
    shifted = [np.asarray(big_vector(r, jnp.float64)) for r in range(SIZE)]
    for _ in range(8):
        shifted = [shifted[(r - 1) % SIZE] for r in range(SIZE)]
    np.testing.assert_array_equal(y, shifted[RANK] + 2 * sum(range(4)))


def ring_step(x, comm):
    """One ring exchange of 8 MiB plus an allreduce, as a loop body."""
    return send_then_recv(x, comm) + mpijax.allreduce(x[:1], MPI.SUM, comm=comm)


def expected_after(steps):
    """Each step passes data one rank on and adds the sum of the first elements."""
    xs = [np.asarray(big_vector(r, jnp.float64)) for r in range(SIZE)]
    for _ in range(steps):
        total = sum(x[0] for x in xs)
        xs = [xs[(r - 1) % SIZE] + total for r in range(SIZE)]
    return xs[RANK]


LOOPS = {
    "fori_loop": lambda x, comm: lax.fori_loop(0, 3, lambda i, x: ring_step(x, comm), x),
    "while_loop": lambda x, comm: lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, ring_step(c[1], comm)), (0, x)
    )[1],
    "scan": lambda x, comm: lax.scan(lambda x, _: (ring_step(x, comm), None), x, None, length=3)[0],
    "cond": lambda x, comm: lax.cond(
        x[0] >= 0, lambda x: ring_step(ring_step(ring_step(x, comm), comm), comm), lambda x: x, x
    ),
    "nested jit": lambda x, comm: jax.jit(
        lambda x: ring_step(jax.jit(lambda y: ring_step(ring_step(y, comm), comm))(x), comm)
    )(x),
    "remat": lambda x, comm: jax.checkpoint(lambda x: ring_step(ring_step(ring_step(x, comm), comm), comm))(x),
    # Each rank takes another branch, and every branch makes the same calls.
    "switch on the rank": lambda x, comm: lax.switch(
        RANK % 3,
        [
            lambda x: ring_step(ring_step(ring_step(x, comm), comm), comm),
            lambda x: lax.fori_loop(0, 3, lambda i, x: ring_step(x, comm), x),
            lambda x: lax.scan(lambda x, _: (ring_step(x, comm), None), x, None, length=3)[0],
        ],
        x,
    ),
}


@pytest.mark.parametrize("loop", LOOPS)
def test_control_flow(comm, loop):
    result = jax.jit(lambda x: LOOPS[loop](x, comm))(big_vector(RANK, jnp.float64))
    np.testing.assert_array_equal(result, expected_after(3))


@pytest.mark.parametrize("mode", MODES)
def test_vmap_of_a_loop_until_the_ranks_agree_it_converged(comm, watchdog, capfd, mode):
    """`while allreduce(x, MAX) > 1: x = sendrecv(x / 2, ...)` under two
    vmaps, over cases that take 0 to 7 steps: each case stops at its own step
    and keeps what it had, as it does alone (JAX's own lowering ran every case
    to the last one's step), and each step makes one allreduce and one
    sendrecv for the whole batch."""
    start = [np.array([[4.0, 32.0, 1.5], [0.5, 100.0, 8.0]]) * (1 + r / 4) for r in range(SIZE)]

    def loop(x):
        going = lambda c: mpijax.allreduce(c[1], MPI.MAX, comm=comm) > 1  # noqa: E731
        step = lambda c: (c[0] + 1, mpijax.sendrecv(c[1] / 2, c[1], PREV, NEXT, comm=comm))  # noqa: E731
        return lax.while_loop(going, step, (0, x))

    steps, values = np.zeros((2, 3), int), np.stack(start).copy()
    for b in np.ndindex(2, 3):
        while values[(slice(None), *b)].max() > 1:
            values[(slice(None), *b)] = np.roll(values[(slice(None), *b)], 1) / 2
            steps[b] += 1
    assert steps.min() == 0 and len(set(steps.flat)) == 6
    run = MODES[mode](jax.vmap(jax.vmap(loop)))
    calls = count_calls(capfd, lambda: run(start[RANK]))
    got_steps, got = run(start[RANK])
    assert_equal(got_steps, steps.astype(got_steps.dtype))
    assert_equal(got, values[RANK])
    assert calls == 1 + 2 * steps.max()


def test_disable_jit_runs_the_same_calls_eagerly(comm, watchdog):
    """Under jax.disable_jit, a jitted function and its gradient run call by
    call in Python, with the results of the compiled program."""
    x = big_vector(RANK, jnp.float64)
    weights = jnp.arange(x.size, dtype=jnp.float64) * (RANK + 1)
    f = jax.jit(lambda x: LOOPS["fori_loop"](x, comm))
    shift = jax.jit(lambda x: send_then_recv(x, comm))
    with jax.disable_jit():
        result = f(x)
        grad = jax.grad(lambda x: jnp.vdot(weights, shift(x)))(x)
    np.testing.assert_array_equal(result, expected_after(3))
    np.testing.assert_array_equal(grad, np.arange(x.size) * (NEXT + 1.0))


def test_tracing_alone_makes_no_mpi_call(comm, watchdog):
    """eval_shape, make_jaxpr, lower and compile run no MPI call: a rank that
    only inspects a function stays in step with the others."""

    def f(x):
        return mpijax.allgather(send_then_recv(mpijax.allreduce(x, MPI.SUM, comm=comm), comm), comm=comm)

    x = jnp.arange(3.0) + RANK
    jax.effects_barrier()
    before = mpijax.call_stats()["calls"]
    assert jax.eval_shape(f, x).shape == (SIZE, 3)
    jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(x)
    jax.jit(jax.vmap(f)).lower(jnp.stack([x, x])).compile()
    jax.effects_barrier()
    assert mpijax.call_stats()["calls"] == before
    total = sum(np.arange(3.0) + r for r in range(SIZE))
    np.testing.assert_array_equal(jax.jit(f)(x), np.broadcast_to(total, (SIZE, 3)))


def test_grad_through_a_rematerialised_loop(comm, watchdog):
    """Forward shifts data three ranks on, in a fori_loop under checkpoint;
    the backward pass runs the transposed calls in reverse order."""
    shift3 = jax.checkpoint(lambda x: lax.fori_loop(0, 3, lambda i, x: send_then_recv(x, comm), x))
    x = big_vector(RANK, jnp.float64)
    weights = jnp.arange(x.size, dtype=jnp.float64) * (RANK + 1)
    grad = jax.jit(jax.grad(lambda x: jnp.vdot(weights, shift3(x))))(x)
    # d/dx_r of sum_s <w_s, x_{s-3}> is w_{r+3}.
    np.testing.assert_array_equal(grad, np.arange(x.size) * ((RANK + 3) % SIZE + 1.0))


def test_custom_vjp_forward_and_backward(comm):
    """A custom_vjp whose forward passes data on and whose backward passes the
    cotangent back: both directions run in order on every rank."""

    @jax.custom_vjp
    def shift(x):
        return send_then_recv(x, comm)

    def fwd(x):
        return shift(x), None

    def bwd(_, g):
        if RANK % 2 == 0:
            mpijax.send(g, PREV, comm=comm)
            return (mpijax.recv(g, NEXT, comm=comm),)
        y = mpijax.recv(g, NEXT, comm=comm)
        mpijax.send(g, PREV, comm=comm)
        return (y,)

    shift.defvjp(fwd, bwd)
    x = big_vector(RANK, jnp.float64)
    weights = jnp.arange(x.size, dtype=jnp.float64) * (RANK + 1)
    grad = jax.jit(jax.grad(lambda x: jnp.vdot(weights, shift(x))))(x)
    # d/dx_r of sum_s <w_s, x_{s-1}> is w_{r+1}.
    np.testing.assert_array_equal(grad, np.arange(x.size) * (NEXT + 1.0))


def test_custom_jvp_with_mpi_calls_in_its_rule(comm):
    """A custom_jvp whose function and whose rule both call MPI: forward mode
    runs the rule's calls, and reverse mode transposes the rule's linear
    part (the allreduce of the tangent) into the calls of its transpose."""

    @jax.custom_jvp
    def total(x):
        return mpijax.allreduce(x, MPI.SUM, comm=comm)

    @total.defjvp
    def total_jvp(primals, tangents):
        return total(primals[0]), 2.0 * mpijax.allreduce(tangents[0], MPI.SUM, comm=comm)

    x = jnp.arange(4.0) * (RANK + 1)
    t = jnp.full(4, RANK + 1.0)
    y, dy = jax.jit(lambda x, t: jax.jvp(total, (x,), (t,)))(x, t)
    np.testing.assert_array_equal(y, np.arange(4.0) * SIZE * (SIZE + 1) / 2)
    np.testing.assert_array_equal(dy, np.full(4, SIZE * (SIZE + 1.0)))
    # The rule's replicated result counts once (docs/autodiff.md): the
    # gradient of sum(w * total(x)) is 2 w on every rank.
    weights = jnp.arange(4.0) + 1
    grad = jax.jit(jax.grad(lambda x: jnp.vdot(weights, total(x))))(x)
    np.testing.assert_array_equal(grad, 2.0 * (np.arange(4.0) + 1))


@needs_peer
def test_unused_send_still_runs(comm):
    """The send's result is never used; if it were dropped, the receiver would hang."""
    x = jnp.arange(4.0) + RANK
    if RANK == 0:
        out = jax.jit(lambda x: (mpijax.send(x, 1, comm=comm), x + 1)[1])(x)
        np.testing.assert_array_equal(out, np.arange(4.0) + 1)
    elif RANK == 1:
        np.testing.assert_array_equal(mpijax.recv(x, 0, comm=comm), np.arange(4.0))


def test_unused_barrier_still_runs(comm, capfd):
    core.set_logging(True)
    try:
        out = jax.jit(lambda x: (mpijax.barrier(comm=comm), x * 2)[1])(jnp.ones(2))
        jax.block_until_ready(out)
        jax.effects_barrier()
    finally:
        core.set_logging(False)
    assert re.search(rf"^mpijax r{RANK} \| barrier \|", capfd.readouterr().err, re.M)


def test_many_independent_collectives_in_one_jit(comm):
    """16 independent 1 MiB allreduces: XLA may run independent work
    concurrently, but the token chain keeps one order on every rank."""
    xs = [jnp.full(2**18, float(i), jnp.float32) * (RANK + 1) for i in range(16)]
    results = jax.jit(lambda xs: [mpijax.allreduce(x, MPI.SUM, comm=comm) for x in xs])(xs)
    scale = SIZE * (SIZE + 1) / 2
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(2**18, i * scale, np.float32))
