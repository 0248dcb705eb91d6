"""User-defined reductions (mpi4py's MPI.Op.Create) as op= of allreduce,
reduce and scan: MPI applies the user's function, against NumPy folds of
every rank's input."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

from reference import MODES, RANK, SIZE, all_data, assert_equal, np_dtype


def odot(a, b):
    """a + b + ab = (1 + a)(1 + b) - 1: associative and commutative, and no
    predefined op computes it. On inputs in [1, 3] exact at any size here."""
    return a + b + a * b


# dtype name -> the name of the MPI datatype that the user function was given
SEEN = {}


def user_op(fn, dtype, commute=True):
    """An MPI.Op that sets inoutbuf = fn(inbuf, inoutbuf) on arrays of dtype."""

    def apply(inbuf, inoutbuf, datatype):
        SEEN[np.dtype(dtype).name] = datatype.Get_name()
        out = np.frombuffer(inoutbuf, dtype)
        out[:] = fn(np.frombuffer(inbuf, dtype), out)

    return MPI.Op.Create(apply, commute=commute)


DTYPES = ["float64", "int32", "float16", "bfloat16"]
ODOT = {dtype: user_op(odot, np_dtype(dtype)) for dtype in DTYPES}
# MPI folds a non-commutative op in rank order: x_0 op x_1 op ..., here x_0.
FIRST = user_op(lambda a, b: a, np.float64, commute=False)


def fold(fn, arrays):
    return functools.reduce(lambda a, b: fn(a, b).astype(a.dtype), arrays)


def leaves(x):
    """tree_allreduce's pytree: two leaves of one dtype, reduced as one buffer."""
    return {"x": x, "tail": x[1:]}


def run(name, x, op, root, comm):
    if name == "reduce":
        return mpijax.reduce(x, op, root, comm=comm)
    if name == "reduce_scatter":
        return mpijax.reduce_scatter(x[:SIZE], op, comm=comm)  # one row per rank
    if name == "tree_allreduce":
        return mpijax.tree_allreduce(leaves(x), op, comm=comm)
    return getattr(mpijax, name)(x, op, comm=comm)


def expected(name, fn, xs, root):
    if name == "scan":
        return fold(fn, xs[: RANK + 1])
    if name == "exscan":  # rank 0 gets zeros, the identity of an op mpijax cannot know
        return fold(fn, xs[:RANK]) if RANK else np.zeros_like(xs[0])
    if name == "reduce" and RANK != root:
        return xs[RANK]
    if name == "reduce_scatter":
        return fold(fn, [x[:SIZE] for x in xs])[RANK]
    if name == "tree_allreduce":
        return {key: fold(fn, [leaves(x)[key] for x in xs]) for key in ("x", "tail")}
    return fold(fn, xs)


VARIANTS = [(name, None) for name in ("allreduce", "scan", "exscan", "reduce_scatter", "tree_allreduce")]
VARIANTS += [("reduce", r) for r in range(SIZE)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,root", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_results(comm, mode, name, root, dtype):
    xs = all_data((5, 2), dtype)
    result = MODES[mode](lambda x: run(name, x, ODOT[dtype], root, comm))(xs[RANK])
    jax.tree.map(assert_equal, result, expected(name, odot, xs, root))


@pytest.mark.skipif(SIZE == 1, reason="MPI applies the op only to values of two ranks")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_floats_reach_the_function_as_uint16(comm, dtype):
    """MPI has no 16-bit float type: the function reads the bytes with the dtype it knows."""
    SEEN.pop(dtype, None)
    jax.block_until_ready(mpijax.allreduce(all_data((3,), dtype)[RANK], ODOT[dtype], comm=comm))
    # MPI may apply the op on some ranks only (a reduce to one rank, then a bcast).
    seen = comm.allgather(SEEN.get(np.dtype(np_dtype(dtype)).name))
    assert {name for name in seen if name} == {MPI.UINT16_T.Get_name()}, seen


def test_the_program_carries_a_small_id_not_the_handle(comm):
    text = jax.jit(lambda x: mpijax.allreduce(x, ODOT["float64"], comm=comm)).lower(jnp.ones(2)).as_text()
    (op,) = re.findall(r"op = (-?\d+) : i64", text)
    assert 10 <= int(op) < 10 + 100, text  # after the 10 predefined codes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,root", VARIANTS)
def test_non_commutative_op_folds_in_rank_order(comm, mode, name, root):
    xs = all_data((3,), "float64")
    result = MODES[mode](lambda x: run(name, x, FIRST, root, comm))(xs[RANK])
    jax.tree.map(assert_equal, result, expected(name, lambda a, b: a, xs, root))


@pytest.mark.parametrize("mode", MODES)
def test_vmap(comm, mode):
    """Element-wise, so a batch is one call on the stacked arrays."""
    xs = all_data((4, 3), "float64")
    result = MODES[mode](jax.vmap(lambda x: mpijax.allreduce(x, ODOT["float64"], comm=comm), in_axes=1))(xs[RANK])
    assert_equal(result, fold(odot, xs).T)


@pytest.mark.parametrize("transform", ["grad", "jvp"])
@pytest.mark.parametrize("name", ["allreduce", "reduce", "scan"])
def test_autodiff_is_refused_naming_the_op(comm, transform, name):
    """Raised at trace time on every rank, before any rank communicates
    (also where an operand is a constant: see _differentiable)."""
    op = ODOT["float64"]

    def f(x):
        return run(name, x, op, 0, comm).sum()

    x = jnp.ones(3)
    with pytest.raises(TypeError) as error:
        jax.grad(f)(x) if transform == "grad" else jax.jvp(f, (x,), (x,))
    message = str(error.value)
    assert message.startswith(f"mpijax.{name}: cannot differentiate through op=user-defined #"), message
    assert repr(op) in message


@pytest.mark.parametrize("op", ["MAXLOC", "REPLACE", "NO_OP", "OP_NULL"])
def test_predefined_ops_that_do_not_apply_are_refused(comm, op):
    with pytest.raises(ValueError, match=r"mpijax\.allreduce: op must be one of MPI\.SUM, .* got "):
        mpijax.allreduce(jnp.ones(2), getattr(MPI, op), comm=comm)
