"""mpijax.tokens (mpi4jax's token API before 0.8), auto_tokenize, and the
migration message of the token-free API."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax
from mpijax import tokens
from mpijax.experimental import auto_tokenize
from test_ordering import chain_start

from reference import BIG, MODES, RANK, SIZE, assert_equal

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
ROOT = SIZE - 1

# mpi4jax's signatures before 0.8: the token-free ones plus token=None.
TOKEN_SIGNATURES = {
    "allgather": "(x, *, comm=None, token=None)",
    "allreduce": "(x, op, *, comm=None, token=None)",
    "alltoall": "(x, *, comm=None, token=None)",
    "barrier": "(*, comm=None, token=None)",
    "bcast": "(x, root, *, comm=None, token=None)",
    "gather": "(x, root, *, comm=None, token=None)",
    "recv": f"(x, source={MPI.ANY_SOURCE}, *, tag={MPI.ANY_TAG}, comm=None, status=None, token=None)",
    "reduce": "(x, op, root, *, comm=None, token=None)",
    "scan": "(x, op, *, comm=None, token=None)",
    "scatter": "(x, root, *, comm=None, token=None)",
    "send": "(x, dest, *, tag=0, comm=None, token=None)",
    "sendrecv": f"(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag={MPI.ANY_TAG}, comm=None, status=None, "
    "token=None)",
}


def is_token(t):
    return jnp.shape(t) == () and jnp.result_type(t) == jnp.float32


def test_signatures():
    for name, signature in TOKEN_SIGNATURES.items():
        assert str(inspect.signature(getattr(tokens, name))) == signature, name
    extras = {"gen_token", "create_token", "has_cuda_support", "has_sycl_support"}
    assert sorted(TOKEN_SIGNATURES) == sorted(set(tokens.__all__) - extras)
    assert tokens.has_cuda_support is mpijax.has_cuda_support and tokens.has_sycl_support() is False


def x_of(rank):
    return jnp.arange(4.0) + 10 * rank


# name -> (call with the token API, expected result on this rank)
def _calls(comm):
    stacked = jnp.stack([x_of(RANK) + j for j in range(SIZE)])
    world = [np.asarray(x_of(r)) for r in range(SIZE)]
    return {
        "allgather": (lambda t: tokens.allgather(x_of(RANK), comm=comm, token=t), np.stack(world)),
        "allreduce": (lambda t: tokens.allreduce(x_of(RANK), MPI.SUM, comm=comm, token=t), sum(world)),
        "alltoall": (lambda t: tokens.alltoall(stacked, comm=comm, token=t), np.stack([w + RANK for w in world])),
        "bcast": (lambda t: tokens.bcast(x_of(RANK), ROOT, comm=comm, token=t), world[ROOT]),
        "gather": (
            lambda t: tokens.gather(x_of(RANK), ROOT, comm=comm, token=t),
            np.stack(world) if RANK == ROOT else world[RANK],
        ),
        "reduce": (
            lambda t: tokens.reduce(x_of(RANK), MPI.SUM, ROOT, comm=comm, token=t),
            sum(world) if RANK == ROOT else world[RANK],
        ),
        "scan": (lambda t: tokens.scan(x_of(RANK), MPI.SUM, comm=comm, token=t), sum(world[: RANK + 1])),
        "scatter": (
            lambda t: tokens.scatter(
                jnp.stack([x_of(j) for j in range(SIZE)]) if RANK == ROOT else x_of(0), ROOT, comm=comm, token=t
            ),
            world[RANK],
        ),  # fmt: skip
        "sendrecv": (lambda t: tokens.sendrecv(x_of(RANK), x_of(0), PREV, NEXT, comm=comm, token=t), world[PREV]),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_token", [False, True])
@pytest.mark.parametrize(
    "name", ["allgather", "allreduce", "alltoall", "bcast", "gather", "reduce", "scan", "scatter", "sendrecv"]
)
def test_results_and_tokens(comm, mode, with_token, name):
    call, want = _calls(comm)[name]
    result, token = MODES[mode](lambda t: call(t if with_token else None))(tokens.gen_token())
    assert_equal(result, want)
    assert is_token(token)


@pytest.mark.parametrize("mode", MODES)
def test_send_recv_and_barrier_with_tokens(comm, mode):
    def run(x, token):
        token = tokens.barrier(comm=comm, token=token)
        if RANK % 2 == 0:
            token = tokens.send(x, NEXT, comm=comm, token=token)
            y, token = tokens.recv(x, PREV, comm=comm, token=token)
        else:
            y, token = tokens.recv(x, PREV, comm=comm, token=token)
            token = tokens.send(x, NEXT, comm=comm, token=token)
        return y, token

    y, token = MODES[mode](run)(x_of(RANK), tokens.create_token())
    assert_equal(y, np.asarray(x_of(PREV)))
    assert is_token(token)


def test_a_passed_token_is_a_data_dependency(comm):
    """The token is tied into mpijax's chain before the call (an optimization
    barrier with the chain's token), and the token returned after it."""
    call = jax.jit(lambda x, t: tokens.allreduce(x, MPI.SUM, comm=comm, token=t))
    text = call.lower(jnp.ones(2), tokens.gen_token()).as_text()
    start, (x, t) = chain_start(text, 2)
    joined = re.search(rf"(%\d+):2 = stablehlo.optimization_barrier {start}, {t}", text)
    assert joined, text
    call = re.search(rf"(%\d+):2 = stablehlo.custom_call @mpijax_allreduce\({x}, (%\S+)\)", text)
    assert call.group(2) == f"{joined.group(1)}#0"
    returned = re.search(rf"(%\d+):2 = stablehlo.optimization_barrier {re.escape(call.group(1))}#1, ", text)
    assert returned and re.search(rf"return .*{re.escape(returned.group(1))}#1 :", text), text


def test_mixed_with_token_free_calls(comm):
    """Token and token-free calls in one jit, 8 MiB each way: one order."""
    x = jnp.arange(BIG // 4, dtype=jnp.float32) + RANK

    @jax.jit
    def f(x):
        if RANK % 2 == 0:
            token = tokens.send(x, NEXT, comm=comm)
            return mpijax.recv(x, PREV, comm=comm), token
        y = mpijax.recv(x, PREV, comm=comm)
        return y, tokens.send(x, NEXT, comm=comm)

    y, _ = f(x)
    np.testing.assert_array_equal(y, np.arange(BIG // 4, dtype=np.float32) + PREV)


LOOPS = {
    "fori_loop": lambda x, t, comm: lax.fori_loop(
        0, 3, lambda i, c: tokens.allreduce(c[0] / SIZE, MPI.SUM, comm=comm, token=c[1]), (x, t)
    )[0],
    "while_loop": lambda x, t, comm: lax.while_loop(
        lambda c: c[2] < 3,
        lambda c: (*tokens.allreduce(c[0] / SIZE, MPI.SUM, comm=comm, token=c[1]), c[2] + 1),
        (x, t, 0),
    )[0],
    "scan": lambda x, t, comm: lax.scan(
        lambda c, _: (tokens.allreduce(c[0] / SIZE, MPI.SUM, comm=comm, token=c[1]), None), (x, t), None, length=3
    )[0][0],
    "cond": lambda x, t, comm: lax.cond(
        x[0] >= 0,
        lambda c: tokens.allreduce(c[0], MPI.SUM, comm=comm, token=c[1]),
        lambda c: c,
        (x, t),
    )[0],
    "nested jit": lambda x, t, comm: jax.jit(lambda x, t: tokens.allreduce(x, MPI.SUM, comm=comm, token=t))(x, t)[0],
}


@pytest.mark.parametrize("loop", LOOPS)
def test_auto_tokenize_runs_token_code_under_control_flow(comm, loop):
    """Token code in loops, cond and nested jit (tokens as carries), with and
    without auto_tokenize, eager and jitted."""
    x = jnp.arange(3.0) + RANK
    total = sum(np.arange(3.0) + r for r in range(SIZE))
    # A loop step sums x / SIZE over ranks: the mean, which further steps keep.
    want = total if loop in ("cond", "nested jit") else total / SIZE

    def f(x):
        return LOOPS[loop](x, tokens.gen_token(), comm)

    assert_equal(auto_tokenize(f)(x), want)
    assert_equal(jax.jit(auto_tokenize(f))(x), want)
    # As token code moved with "from mpijax import tokens as mpi4jax" calls it.
    assert_equal(tokens.experimental.auto_tokenize(f, token=tokens.gen_token())(x), want)


def _shift(c, comm):
    """One step of a token-carrying ring: x to the next rank."""
    x, token = c
    return tokens.sendrecv(x, x, PREV, NEXT, comm=comm, token=token)


# name -> (x, token -> (result, token), how many steps the result is shifted)
CARRIED = {
    "fori_loop": (lambda c, comm: lax.fori_loop(0, 2, lambda i, c: _shift(c, comm), c), 2),
    "while_loop": (
        lambda c, comm: lax.while_loop(lambda c: c[2] < 2, lambda c: (*_shift(c[:2], comm), c[2] + 1), (*c, 0))[:2],
        2,
    ),
    "scan": (lambda c, comm: lax.scan(lambda c, _: (_shift(c, comm), None), c, None, length=2)[0], 2),
    "cond": (lambda c, comm: lax.cond(c[0][0] > -1, lambda c: _shift(c, comm), lambda c: c, c), 1),
    "checkpoint": (lambda c, comm: jax.checkpoint(lambda c: _shift(c, comm))(c), 1),
}


@pytest.mark.parametrize("carrier", CARRIED)
@pytest.mark.parametrize("mode", MODES)
def test_derivatives_with_the_token_carried_through_control_flow(comm, mode, carrier):
    """A token carried through a loop, cond or checkpoint gets a tangent as
    every floating-point carry does there (a tester found grad and jvp
    raising: the token chain had no JVP rule). Against NumPy: the result is
    x of the rank `steps` before, the loss sums w_r * y_r**2 over ranks."""
    run, steps = CARRIED[carrier]
    w = lambda r: np.arange(1.0, 4.0) + 10 * r  # noqa: E731
    xs = [np.arange(3.0) + 2 * r + 1 for r in range(SIZE)]
    vs = [np.ones(3) * (r + 1) for r in range(SIZE)]
    source = (RANK - steps) % SIZE

    def loss(x):
        y, token = run((x, tokens.gen_token()), comm)
        assert is_token(token)
        return jnp.sum(w(RANK) * y**2)

    jvp = MODES[mode](lambda x, v: jax.jvp(loss, (x,), (v,)))
    value, tangent = jvp(jnp.asarray(xs[RANK]), jnp.asarray(vs[RANK]))
    assert_equal(value, np.sum(w(RANK) * xs[source] ** 2))
    assert_equal(tangent, np.sum(2 * w(RANK) * xs[source] * vs[source]))
    if carrier != "while_loop":  # JAX has no reverse mode of while_loop
        assert_equal(MODES[mode](jax.grad(loss))(jnp.asarray(xs[RANK])), 2 * w((RANK + steps) % SIZE) * xs[RANK])


# name -> (x, a JAX token -> result, how many steps the result is shifted):
# the token enters each body from outside, as in mpi4jax < 0.8 code.
PASSED_IN = {
    "jit": (lambda x, t, comm: jax.jit(lambda x, t: _shift((x, t), comm))(x, t)[0], 1),
    "fori_loop": (lambda x, t, comm: lax.fori_loop(0, 2, lambda i, x: _shift((x, t), comm)[0], x), 2),
    "cond": (lambda x, t, comm: lax.cond(x[0] > -1, lambda x: _shift((x, t), comm)[0], lambda x: x, x), 1),
    "checkpoint": (lambda x, t, comm: jax.checkpoint(lambda x: _shift((x, t), comm)[0])(x), 1),
}


@pytest.mark.parametrize("body", PASSED_IN)
@pytest.mark.parametrize("mode", MODES)
def test_derivatives_with_a_jax_token_passed_into_a_body(comm, mode, body):
    """A JAX token passed into an inner jit, or closed over by a loop body, a
    cond branch or a checkpoint: as an operand of the body it broke grad and
    jvp there (found by a tester); it is ignored now. Against NumPy, as above."""
    run, steps = PASSED_IN[body]
    w = np.arange(1.0, 4.0) + 10 * RANK
    xs = [np.arange(3.0) + 2 * r + 1 for r in range(SIZE)]
    source = (RANK - steps) % SIZE

    def loss(x):
        return jnp.sum(w * run(x, lax.create_token(), comm) ** 2)

    value, tangent = MODES[mode](lambda x: jax.jvp(loss, (x,), (jnp.ones(3),)))(jnp.asarray(xs[RANK]))
    assert_equal(value, np.sum(w * xs[source] ** 2))
    assert_equal(tangent, np.sum(2 * w * xs[source]))
    grad = MODES[mode](jax.grad(loss))(jnp.asarray(xs[RANK]))
    assert_equal(grad, 2 * (np.arange(1.0, 4.0) + 10 * ((RANK + steps) % SIZE)) * xs[RANK])


@pytest.mark.parametrize(
    "name,args",
    [
        ("allgather", (jnp.ones(2),)),
        ("allreduce", (jnp.ones(2), MPI.SUM)),
        ("alltoall", (jnp.ones((SIZE, 2)),)),
        ("barrier", ()),
        ("bcast", (jnp.ones(2), 0)),
        ("gather", (jnp.ones(2), 0)),
        ("recv", (jnp.ones(2), 0)),
        ("reduce", (jnp.ones(2), MPI.SUM, 0)),
        ("scan", (jnp.ones(2), MPI.SUM)),
        ("scatter", (jnp.ones(2), 0)),
        ("send", (jnp.ones(2), 0)),
        ("sendrecv", (jnp.ones(2), jnp.ones(2), 0, 0)),
    ],
)
def test_token_free_api_refuses_tokens_with_a_migration_message(name, args):
    with pytest.raises(RuntimeError, match=rf"mpijax\.{name} takes no token: .*mpijax\.tokens\.{name}"):
        getattr(mpijax, name)(*args, token=tokens.gen_token())


def test_a_token_that_is_not_one_is_refused_by_name(comm):
    """A string gave JAX's internal error about mpijax_join (found by a tester)."""
    with pytest.raises(TypeError, match=r"mpijax\.tokens\.allreduce: token must be a token .* got str"):
        tokens.allreduce(jnp.ones(2), MPI.SUM, comm=comm, token="tok")
