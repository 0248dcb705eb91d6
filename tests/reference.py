"""Inputs for every rank, computed identically on every rank, so that each
test can build its NumPy reference from all ranks' data without communicating."""

import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip

SHAPES = [(), (0,), (5,), (4, 2)]  # scalar, empty, odd, even (2-d)
BIG = 8 * 2**20  # bytes: far above any eager (rendezvous) limit

MODES = {"eager": lambda f: f, "jit": jax.jit}
# What a call that fails at run time raises: JaxRuntimeError, or ValueError
# where JAX meets the error on its C++ dispatch path, as an eager call does
# once its program has run before (docs/failure-modes.md).
MPI_FAILURE = (jax.errors.JaxRuntimeError, ValueError)


def checkerboard(keep=1, **axes):
    """Parametrizes `mode` and every axis (name -> values; a name "a,b" takes
    tuples) over the combinations whose value indices add up to a multiple of
    `keep` (all, by default), each in one mode: eager and jit alternate along
    every axis. Every value of every axis still runs, and each test runs both
    eager and jitted, 1 / (2 * keep) of the grid in each mode (the MPI call is
    the same in both: only dispatch differs); a value runs in both modes where
    the sums of the other axes' indices take 2 * keep or more consecutive
    values. keep = k thins the grid k-fold, yet the
    values of all axes but one still meet wherever that axis has k or more
    values (one of them makes up the sum): axes that steer independent parts
    of a call (a dtype's arithmetic, a shape's count) meet pairwise without
    the whole grid."""
    cases = []
    for index in itertools.product(*(range(len(values)) for values in axes.values())):
        if sum(index) % keep:
            continue
        chosen = [values[i] for values, i in zip(axes.values(), index, strict=True)]
        flat = [v for name, value in zip(axes, chosen, strict=True) for v in (value if "," in name else (value,))]
        cases.append((list(MODES)[sum(index) // keep % 2], *flat))
    label = lambda v: ("x".join(map(str, v)) or "scalar") if isinstance(v, tuple) else str(v)  # noqa: E731
    return pytest.mark.parametrize(",".join(["mode", *axes]), cases, ids=["-".join(map(label, c)) for c in cases])


def stencil_loop(x, comm=None):
    """A stencil code's compiled loop, written as users write it: rows cut
    from the field x go straight into the calls, and their results into
    rows. Twice: the ghost rows 0 and -1 (columns 1:-1) come from the ring
    neighbours, then row 2 becomes its sum over ranks. XLA:GPU's
    dynamic-slice fusion fuses such slices with the calls (docs/gpu.md)."""
    prev, following = (RANK - 1) % SIZE, (RANK + 1) % SIZE

    def step(_, x):
        ghosts = mpijax.neighbor_exchange(
            [x[-2:-1, 1:-1], x[1:2, 1:-1]], [prev, following], [following, prev], comm=comm
        )
        x = x.at[:1, 1:-1].set(ghosts[0]).at[-1:, 1:-1].set(ghosts[1])
        return x.at[2, 1:-1].set(mpijax.allreduce(x[2, 1:-1], MPI.SUM, comm=comm))

    return jax.lax.fori_loop(0, 2, step, x)


# What mpirun gives its ranks; a process started without it is a job of its own.
LAUNCHER_VARS = ("OMPI_", "PMIX_", "PMI_", "OPAL_", "HYDRA_", "MPIR_")


def fresh_job_env():
    """This process's environment minus mpirun's variables (root's
    permission to run Open MPI stays, and so does OPAL_PREFIX, where an Open
    MPI that was moved after its build finds its files). A process started
    without mpirun is a job of its own, whose daemon Open MPI 4 launches
    through ssh or rsh unless told that the job stays on this machine
    (containers may have neither: the GPU machine had none)."""
    kept = ("ALLOW_RUN_AS_ROOT", "OPAL_PREFIX")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS) or any(s in k for s in kept)}
    return env | {"OMPI_MCA_plm": "isolated"}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(shape, dtype, rank, seed=0):
    """Small values of `dtype` for `rank`: integers in [1, 3], so sums and
    products over a few ranks are exact even in 16-bit floats and int8."""
    dt = np_dtype(dtype)
    rng = np.random.default_rng([seed, rank, zlib.crc32(dtype.encode())])
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(1, 4, shape)
    if np.issubdtype(dt, np.complexfloating):
        values = values + 1j * rng.integers(1, 4, shape)
    return values.astype(dt)


def all_data(shape, dtype, seed=0, size=SIZE):
    return [data(shape, dtype, r, seed) for r in range(size)]


def assert_equal(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)


def big_vector(rank, dtype=np.float32):
    n = BIG // np.dtype(dtype).itemsize
    return jnp.arange(n, dtype=dtype) + rank


def hlo_copies(jitted, x):
    """The copies of float32 arrays shaped like `x` in the compiled HLO of
    `jitted` applied to `x`: what XLA copies to make room for a call."""
    text = jitted.lower(x).compile().as_text()
    kind = f"f32[{','.join(map(str, x.shape))}]"
    return [line for line in text.splitlines() if " copy(" in line and kind in line]


def transposed(f, example):
    """jax.linear_transpose of the one-argument linear `f` at `example`'s
    shape, as a one-argument function (so that it can be transposed again)."""
    t = jax.linear_transpose(f, example)
    return lambda ct: t(ct)[0]


def count_calls(capfd, run):
    """How many MPI calls `run()` makes on this rank (MPIJAX_DEBUG's lines)."""
    from mpijax._src.runtime import core

    core.set_logging(True)
    try:
        capfd.readouterr()
        jax.block_until_ready(run())
        return capfd.readouterr().err.count("mpijax r")
    finally:
        core.set_logging(False)
