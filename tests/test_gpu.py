"""mpijax on an NVIDIA GPU: every op, eager and jit, with jvp, vjp and vmap,
gives on device arrays what it gives on host arrays (which the rest of the
suite checks against NumPy and finite differences), staged through pinned host
memory and, where the MPI library moves device memory, CUDA-aware. Run by
scripts/gpu_check.sh at 2 ranks sharing one GPU; skipped where JAX sees none."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import BIG, DTYPES, MODES, RANK, SIZE, all_data, assert_equal, fresh_job_env
from test_autodiff import CASES, cotangents, inputs

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS:
    pytest.skip("needs an NVIDIA GPU: scripts/gpu_check.sh runs these on one", allow_module_level=True)
CPU = jax.devices("cpu")[0]
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


@pytest.fixture(params=["staged", "cuda-aware"])
def memory(request):
    """Both memory policies of the CUDA handlers."""
    if request.param == "cuda-aware":
        # Only where the library says yes: one that cannot tell (-1) might crash the whole run.
        if core.cuda_aware_mpi() != 1:
            pytest.skip(f"{MPI.Get_library_version().splitlines()[0]} does not say it can move device memory")
        mpijax.set_cuda_aware(True)
    yield request.param
    mpijax.set_cuda_aware(False)


def on(device, f, *args):
    """f's result, run on `device` (inputs placed there), as NumPy arrays."""
    with jax.default_device(device):
        out = f(*[jax.device_put(a, device) for a in args])
        return jax.tree.map(np.asarray, jax.block_until_ready(out))


def same_on_gpu_and_cpu(f, *args, atol=0.0):
    """MPI moves the same bytes on both; the arithmetic around it may round
    differently (cuBLAS, FMA contraction), by far less than atol where given."""
    gpu, cpu = on(GPUS[0], f, *args), on(CPU, f, *args)
    jax.tree.map(lambda g, c: np.testing.assert_allclose(g, c, rtol=1e-12, atol=atol), gpu, cpu)
    return gpu


def test_the_build_has_cuda_handlers():
    assert mpijax.has_cuda_support()


def test_bind_local_gpu_before_jax_starts():
    """In a job of its own (one rank), the helper binds the node's first GPU,
    JAX then sees that one alone, and an allreduce runs on it."""
    code = (
        "import mpijax; gpu = mpijax.bind_local_gpu(); import jax, jax.numpy as jnp; from mpi4py import MPI; "
        "x = mpijax.allreduce(jnp.arange(3.0), MPI.SUM); print(gpu, len(jax.devices()), x.devices(), x.tolist())"
    )
    # The ranks running this test hold their share of the GPU's memory already.
    env = fresh_job_env() | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    gpu, devices, placed, values = result.stdout.strip().splitlines()[-1].split(" ", 3)
    assert (gpu, devices, values) == ("0", "1", "[0.0, 1.0, 2.0]")
    assert "cuda" in placed.lower() or "gpu" in placed.lower(), placed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_value_jvp_and_vjp(comm, memory, case, mode):
    """Each op and its derivatives, on the GPU and on the host."""
    x, v = inputs(case)[RANK], inputs(case, "v")[RANK]
    w = cotangents(case)[RANK]

    def program(x, v, w):
        y, ydot = jax.jvp(lambda x: case.call(x, comm), (x,), (v,))
        _, pullback = jax.vjp(lambda x: case.call(x, comm), x)
        return y, ydot, pullback(w)[0]

    same_on_gpu_and_cpu(MODES[mode](program), x, v, w)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_under_vmap(comm, memory, case):
    xs = np.stack([inputs(case, f"batch{b}")[RANK] for b in range(3)])
    same_on_gpu_and_cpu(jax.jit(jax.vmap(lambda x: case.call(x, comm))), xs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (4, 2)])
def test_dtypes_and_shapes(comm, memory, mode, dtype, shape):
    """Data movement and a reduction over every dtype: the same bytes as on the host."""
    xs = all_data(shape, dtype)
    op = MPI.LOR if dtype == "bool" else MPI.SUM

    def program(x):
        return (
            mpijax.allreduce(x, op, comm=comm),
            mpijax.bcast(x, SIZE - 1, comm=comm),
            mpijax.allgather(x, comm=comm),
            mpijax.sendrecv(x, x, PREV, NEXT, comm=comm),
        )

    out = on(GPUS[0], MODES[mode](program), xs[RANK])
    assert_equal(out[1], xs[SIZE - 1])
    assert_equal(out[2], np.stack(xs))
    assert_equal(out[3], xs[PREV])
    assert_equal(out[0], on(CPU, MODES[mode](program), xs[RANK])[0])


@pytest.mark.parametrize("mode", MODES)
def test_8MiB_in_and_out_of_place(comm, memory, mode):
    """Large messages, in place (reductions) and not (gather), twice in a row
    so that the pinned buffers are reused."""
    x = jnp.arange(BIG // 4, dtype=jnp.float32) + RANK

    def program(x):
        total = mpijax.allreduce(x, MPI.SUM, comm=comm)
        return total, mpijax.gather(total + x, 0, comm=comm), mpijax.sendrecv(x, x, PREV, NEXT, comm=comm)

    for _ in range(2):
        same_on_gpu_and_cpu(MODES[mode](program), x)


def test_grad_of_a_jitted_training_step(comm, memory):
    """A data-parallel step: the gradient of a loss summed over ranks."""

    @jax.jit
    def step(w, x):
        loss = lambda w: mpijax.allreduce(jnp.sum(jnp.tanh(x @ w) ** 2), MPI.SUM, comm=comm)  # noqa: E731
        return jax.grad(loss)(w)

    rng = np.random.default_rng(RANK)
    same_on_gpu_and_cpu(step, rng.normal(size=(8, 4)), rng.normal(size=(16, 8)), atol=1e-10)
