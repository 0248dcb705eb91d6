"""allreduce, reduce, scan against NumPy folds of every rank's input."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

from reference import (
    DTYPES,
    MODES,
    RANK,
    SHAPES,
    SIZE,
    all_data,
    assert_equal,
    big_vector,
    checkerboard,
    count_calls,
    data,
    np_dtype,
)

FOLDS = {
    "SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
    "LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}  # fmt: skip


def defined_ops(dtype):
    """The MPI standard's table of predefined reductions by type class."""
    if dtype == "bool":
        return ["LAND", "LOR", "LXOR"]
    if "int" in dtype:
        return list(FOLDS)
    if "float" in dtype:
        return ["SUM", "PROD", "MIN", "MAX"]
    return ["SUM", "PROD"]


def fold(op, arrays):
    dt = arrays[0].dtype
    return functools.reduce(lambda a, b: FOLDS[op](a, b).astype(dt), arrays)


def expected(name, op, xs, root):
    if name == "allreduce":
        return fold(op, xs)
    if name == "scan":
        return fold(op, xs[: RANK + 1])
    return fold(op, xs) if RANK == root else xs[RANK]


def call(name, x, op, root, comm):
    if name == "reduce":
        return mpijax.reduce(x, getattr(MPI, op), root, comm=comm)
    return getattr(mpijax, name)(x, getattr(MPI, op), comm=comm)


VARIANTS = [("allreduce", None), ("scan", None)] + [("reduce", r) for r in range(SIZE)]


def check(comm, mode, name, root, dtype, op, shape):
    xs = all_data(shape, dtype)
    result = MODES[mode](lambda x: call(name, x, op, root, comm))(xs[RANK])
    assert_equal(result, expected(name, op, xs, root))


# Each (dtype, op)'s arithmetic through one of the three collectives, which
# share it.
@checkerboard(3, name=["allreduce", "reduce", "scan"], **{"dtype,op": [(d, o) for d in DTYPES for o in defined_ops(d)]})
def test_every_op_and_dtype(comm, mode, name, dtype, op):
    check(comm, mode, name, SIZE - 1, dtype, op, (5,))


@checkerboard(4, **{"name,root": VARIANTS}, dtype=DTYPES, shape=SHAPES)
def test_shapes_and_roots(comm, mode, name, root, dtype, shape):
    check(comm, mode, name, root, dtype, defined_ops(dtype)[0], shape)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,root", VARIANTS)
def test_8MiB(comm, mode, name, root):
    x = big_vector(RANK)
    result = MODES[mode](lambda x: call(name, x, "SUM", root, comm))(x)
    ranks = range(RANK + 1) if name == "scan" else range(SIZE)
    want = sum(np.asarray(big_vector(r), np.float64) for r in ranks)
    if name == "reduce" and RANK != root:
        want = np.asarray(x, np.float64)
    np.testing.assert_array_equal(np.asarray(result, np.float64), want)


def order_free_16bit_inputs(dtype, op, n=64):
    """Three ranks' inputs, n elements each, whose 16-bit fold gives the same
    result in every order MPI may combine them in, while a float32 fold
    rounded to 16 bits at the end (an up-cast) gives another, in every order.
    (Two ranks cannot tell the two apart: one operation on two 16-bit values
    is exact in float32.)"""
    dt = np_dtype(dtype)
    rng = np.random.default_rng(16)
    candidates = [rng.uniform(0.5, 8, 200 * n).astype(dt) for _ in range(3)]

    def every_order(via):
        return [
            fold(op, [candidates[i].astype(via) for i in order]).astype(dt)
            for order in itertools.permutations(range(3))
        ]

    in_16bit, upcast = every_order(dt), every_order(np.float32)
    keep = np.logical_and.reduce([r == in_16bit[0] for r in in_16bit] + [r != in_16bit[0] for r in upcast])
    assert keep.sum() >= n
    return [c[keep][:n] for c in candidates]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["allreduce", "reduce", "scan"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "PROD"])
def test_16bit_floats_reduce_in_16bit(comm, mode, name, dtype, op):
    """Each partial result is rounded to 16 bits (no silent up-cast): from 3
    ranks on, inputs whose 16-bit fold differs from the up-cast one (further
    ranks add the identity) give the 16-bit fold exactly."""
    ranks = order_free_16bit_inputs(dtype, op)
    identity = np.ones_like(ranks[0]) if op == "PROD" else np.zeros_like(ranks[0])
    xs = [ranks[r] if r < 3 else identity for r in range(SIZE)]
    result = MODES[mode](lambda x: call(name, x, op, SIZE - 1, comm))(xs[RANK])
    assert_equal(result, expected(name, op, xs, SIZE - 1))


@pytest.mark.skipif(SIZE == 1, reason="a NaN meets other ranks' values from 2 ranks on")
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["MAX", "MIN"])
def test_max_and_min_need_not_carry_a_nan(comm, dtype, op):
    """MPI's MAX and MIN (and mpijax's own for 16-bit floats, which compare
    alike) do not propagate a NaN as jnp.max does: with the NaN on one rank
    after another, some placement loses it. README says so."""
    kept = []
    for holder in range(SIZE):
        x = jnp.full(3, jnp.nan if RANK == holder else 1.0 + RANK, dtype)
        kept.append(bool(np.isnan(np.asarray(mpijax.allreduce(x, getattr(MPI, op), comm=comm), np.float32)).all()))
    assert not all(kept), kept


@checkerboard(
    3,
    dtype=["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"],
    n=[1, 31, 32, 1000],
    name=["allreduce", "scan", "reduce"],
)
def test_integer_sums_wrap_like_jax(comm, mode, dtype, n, name):
    """Overflowing integer sums wrap (two's complement), as jnp.sum does, at
    every length: Open MPI 4.1's vectorised SUM saturates 8- and 16-bit
    integers instead (open-mpi/ompi#8045)."""
    info = np.iinfo(dtype)
    xs = [np.full(n, info.max - r, dtype) for r in range(SIZE)]
    result = MODES[mode](lambda x: call(name, x, "SUM", 0, comm))(xs[RANK])
    assert_equal(result, expected(name, "SUM", xs, 0))
    if name == "allreduce":
        assert_equal(result, np.asarray(jnp.sum(jnp.stack(xs), axis=0, dtype=dtype)))


@pytest.mark.parametrize("mode", MODES)
def test_tree_allreduce_reduces_every_leaf_in_one_call_per_dtype(comm, mode, capfd):
    """A pytree with scalars, an empty leaf and leaves of two dtypes: each
    leaf is the fold over ranks of that leaf, and the whole tree costs one
    MPI call per dtype."""

    def tree(r):
        return {
            "w": data((3, 2), "float32", r, 1),
            "b": [data((), "float32", r, 2), data((0, 4), "float32", r, 3)],
            "n": data((5,), "int64", r, 4),
        }

    trees = [tree(r) for r in range(SIZE)]
    f = MODES[mode](lambda t: mpijax.tree_allreduce(t, MPI.MAX, comm=comm))
    got = f(trees[RANK])
    want = jax.tree.map(lambda *leaves: fold("MAX", leaves), *trees)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for leaf, expected_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_equal(leaf, expected_leaf)
    assert count_calls(capfd, lambda: f(trees[RANK])) == 2
