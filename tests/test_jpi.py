"""mpijax.jpi: JPI's public functions, signatures and return conventions
(token second, (result, token) back), against NumPy references."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax
from mpijax import jpi

from reference import MODES, RANK, SIZE, all_data, assert_equal

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
ROOT = SIZE - 1

# The __all__ of JPI's src/jpi/__init__.py and its functions' signatures
# (github.com/ellingsvee/jpi, src/jpi/<name>.py, type annotations left out).
JPI_SIGNATURES = {
    "allgather": "(x, token, comm=None)",
    "allreduce": "(x, token, op, comm=None)",
    "barrier": "(token, comm=None)",
    "bcast": "(x, token, root, comm=None)",
    "gather": "(x, token, root, comm=None)",
    "gen_token": "()",
    "recv": "(x, token, source, tag=0, comm=None)",
    "scatter": "(x, token, root, comm=None)",
    "send": "(x, token, dest, tag=0, comm=None)",
}


def is_token(t):
    return jnp.shape(t) == () and jnp.result_type(t) == jnp.float32


def test_public_names_and_signatures():
    assert sorted(jpi.__all__) == sorted(JPI_SIGNATURES)
    for name, signature in JPI_SIGNATURES.items():
        assert str(inspect.signature(getattr(jpi, name))) == signature, name
    assert is_token(jpi.gen_token())


def _calls(comm):
    xs = all_data((3, 2), "float32")
    return xs, {
        "allgather": (lambda x, t: jpi.allgather(x, t, comm), np.stack(xs)),
        "allreduce": (lambda x, t: jpi.allreduce(x, t, MPI.SUM, comm), sum(xs)),
        "bcast": (lambda x, t: jpi.bcast(x, t, ROOT, comm), xs[ROOT]),
        # JPI: (nproc, ...) everywhere, zeros off the root
        "gather": (lambda x, t: jpi.gather(x, t, ROOT, comm), np.stack(xs) if RANK == ROOT else np.zeros((SIZE, 3, 2))),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["allgather", "allreduce", "bcast", "gather"])
def test_collectives(comm, mode, name):
    xs, calls = _calls(comm)
    call, want = calls[name]
    result, token = MODES[mode](call)(xs[RANK], jpi.gen_token())
    assert_equal(result, np.asarray(want, np.float32))
    assert is_token(token)


@pytest.mark.parametrize("dtype", ["bool", "int8", "bfloat16"])
def test_gather_keeps_the_dtype_off_the_root(comm, dtype):
    """Zeros off the root of x's dtype (a bool gather once gave int32 there)."""
    xs = all_data((2,), dtype)
    result, _ = jax.jit(lambda x, t: jpi.gather(x, t, ROOT, comm))(xs[RANK], jpi.gen_token())
    assert_equal(result, np.stack(xs) if RANK == ROOT else np.zeros((SIZE, 2), xs[0].dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [1, 2])
def test_scatter_splits_the_leading_axis(comm, mode, block):
    """Rank i gets block i of the root's x; blocks of length 1 lose that axis."""
    xs = all_data((SIZE * block, 2), "int32")
    result, token = MODES[mode](lambda x, t: jpi.scatter(x, t, ROOT, comm))(xs[RANK], jpi.gen_token())
    want = xs[ROOT][RANK * block : (RANK + 1) * block]
    assert_equal(result, want[0] if block == 1 else want)
    assert is_token(token)


@pytest.mark.parametrize("shape", [(), (SIZE + 1, 2)])
def test_scatter_refuses_a_leading_axis_not_divisible_by_nproc(comm, shape):
    if SIZE == 1 and shape:
        pytest.skip("every length is a multiple of 1")
    with pytest.raises(ValueError, match=r"mpijax\.jpi\.scatter: x must have a leading axis that is a multiple"):
        jpi.scatter(jnp.zeros(shape), jpi.gen_token(), 0, comm)


@pytest.mark.parametrize("name", ["gather", "scatter"])
def test_a_traced_root_is_refused_by_name(comm, name):
    """jpi.scatter compared the traced root with the rank before any check
    (TracerBoolConversionError; found by a tester)."""
    call = lambda root: getattr(jpi, name)(jnp.ones((SIZE, 2)), jpi.gen_token(), root, comm)  # noqa: E731
    with pytest.raises(TypeError, match=r"mpijax\.(jpi\.)?" + name + r": root must be a static Python int"):
        jax.jit(call)(0)


@pytest.mark.parametrize("mode", MODES)
def test_send_recv_barrier(comm, mode):
    xs = all_data((4,), "float64")

    def ring(x, token):
        token = jpi.barrier(token, comm)
        if RANK == 0:  # rank 0 starts the ring
            sent, token = jpi.send(x, token, NEXT, 7, comm)
            y, token = jpi.recv(x, token, PREV, 7, comm)
        else:
            y, token = jpi.recv(x, token, PREV, 7, comm)
            sent, token = jpi.send(x, token, NEXT, 7, comm)
        return sent, y, token

    sent, y, token = MODES[mode](ring)(xs[RANK], jpi.gen_token())
    assert_equal(sent, xs[RANK])  # JPI's send returns its input
    assert_equal(y, xs[PREV])
    assert is_token(token)


def test_gradient_through_scatter_and_allreduce(comm):
    """d/dx of sum(allreduce(scatter(x) * (r + 1))): on the root, block r of
    the gradient is r + 1; elsewhere x is only a template, with gradient 0."""

    def f(x):
        block, token = jpi.scatter(x, jpi.gen_token(), 0, comm)
        total, _ = jpi.allreduce(block * (RANK + 1), token, MPI.SUM, comm)
        return total.sum()

    grad = jax.grad(jax.jit(f))(jnp.ones(2 * SIZE))
    want = np.repeat(np.arange(1.0, SIZE + 1), 2) if RANK == 0 else np.zeros(2 * SIZE)
    assert_equal(grad, want)


@pytest.mark.parametrize("mode", MODES)
def test_per_example_gradients_through_gather(comm, mode):
    """vmap of value_and_grad of allreduce(sum(W * gather(x))): gather's zeros
    off the root are batched as the root's result is (constant zeros gave
    MPI_ERR_TRUNCATE with Open MPI and garbage with MPICH; found by a
    tester). Against NumPy: the value is sum_r W[r] . x_r, the gradient on
    rank r is W[r] for every example."""
    weights = np.arange(1.0, 3 * SIZE + 1).reshape(SIZE, 3)
    xs = all_data((2, 3), "float32")

    def f(x):
        g, token = jpi.gather(x, jpi.gen_token(), ROOT, comm)
        return jpi.allreduce(jnp.sum(jnp.asarray(weights, jnp.float32) * g), token, MPI.SUM, comm)[0]

    value, grad = MODES[mode](jax.vmap(jax.value_and_grad(f)))(xs[RANK])
    assert_equal(value, sum(xs[r] @ weights[r] for r in range(SIZE)).astype(np.float32))
    assert_equal(grad, np.broadcast_to(weights[RANK], (2, 3)).astype(np.float32))


def test_gradient_with_the_token_carried_through_scan(comm):
    """JPI's token as a scan carry: grad of sum(w_r * allreduce(x)) is w_r,
    as without the token (allreduce's result is replicated: docs/autodiff.md),
    and with the result marked varying, the sum of every rank's w."""
    w = lambda r: np.arange(1.0, 4.0) + 10 * r  # noqa: E731

    def f(x, mark=lambda y: y):
        step = lambda c, _: (jpi.allreduce(*c, MPI.SUM, comm), None)  # noqa: E731
        (y, _), _ = lax.scan(step, (x, jpi.gen_token()), None, length=1)
        return jnp.sum(w(RANK) * mark(y))

    assert_equal(jax.jit(jax.grad(f))(jnp.ones(3)), w(RANK))
    assert_equal(jax.jit(jax.grad(lambda x: f(x, mpijax.varying)))(jnp.ones(3)), sum(w(r) for r in range(SIZE)))
