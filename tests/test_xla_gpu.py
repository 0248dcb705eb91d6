"""mpijax's programs compiled by XLA:GPU on a machine without a GPU: JAX's
CUDA plugin compiles for a described H100 (an ahead-of-time compile with no
device), through every pass XLA:GPU runs, and nothing runs. That is where a
GPU run can fail before any MPI call: XLA's dynamic-slice fusion folded the
slices around MPI calls into fusions that priority fusion cannot cost, and
aborted the process (docs/gpu.md, "XLA's dynamic-slice fusion"). The fusion
is on here, as it was on the H200, and every case of test_autodiff.py (value,
jvp and vjp in one program, and vmap), a stencil loop, the three examples'
compiled loops (the Poisson solve with its gradient) and a training step must
compile, and between them call every handler the build has for CUDA; without
mpijax's barriers the stencil, shallow-water and Poisson loops abort here too
(docs/benchmarks/gpu/dynamic-slice-fusion/deviceless.log).

Needs JAX's CUDA plugin of the installed jaxlib (jax-cuda13-plugin and
jax-cuda13-pjrt) and mpijax's CUDA handlers. scripts/test.sh installs the
plugin in a venv of its own and runs this module at 2 ranks, with
JAX_PLATFORMS=cpu and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (the plugin's check
of the CUDA driver, which a machine without a GPU fails). Elsewhere the
module is skipped, unless MPIJAX_XLA_GPU_COMPILE=1 makes that a failure."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import FFI_TARGETS

import data_parallel
import poisson_cg
import shallow_water as sw
from reference import stencil_loop
from test_autodiff import CASES, inputs

# An H100 SXM as XLA's GPU compiler sees it (xla.GpuTargetConfigProto).
H100 = """
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
runtime_version { major: 13 }
dnn_version_info { major: 9 minor: 8 }
gpu_device_info {
  cuda_compute_capability { major: 9 }
  core_count: 132
  fpus_per_core: 128
  clock_rate_ghz: 1.98
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  registers_per_block_limit: 65536
  registers_per_core_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  memory_bandwidth: 3352320000000
  device_memory_size: 84929347584
}
"""
# JAX 0.11.2 ran XLA's dynamic-slice fusion on the H200 with no flag set;
# under JAX 0.10.2 it runs only when asked, with either version's plugin.
OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True}

try:
    if not mpijax.has_cuda_support():
        raise RuntimeError("mpijax was built without CUDA handlers (CMake found no CUDA toolkit)")
    from jax.experimental import topologies

    GPU = topologies.get_topology_desc("mpijax", "cuda", target_config=H100, topology="1x1x1").devices[0]
except Exception as error:
    if os.environ.get("MPIJAX_XLA_GPU_COMPILE") == "1":
        raise
    pytest.skip(f"needs JAX's CUDA plugin and mpijax's CUDA handlers: {error}", allow_module_level=True)

ON_GPU = jax.sharding.SingleDeviceSharding(GPU)
COMPILED = set()  # the handlers called by the programs compiled so far on this rank


def compile_for_gpu(f, *args):
    """f compiled by XLA:GPU for arguments shaped like args, placed on the
    described GPU; its optimized HLO."""
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=ON_GPU), args)
    hlo = jax.jit(f).trace(*specs).lower().compile(compiler_options=OPTIONS).as_text()
    COMPILED.update(mpi_calls(hlo))
    return hlo


def mpi_calls(hlo):
    return re.findall(r'custom_call_target="(mpijax_\w+)"', hlo)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_with_its_derivatives(comm, case):
    x = inputs(case)[comm.Get_rank()]

    def program(x, v, w):
        y, ydot = jax.jvp(lambda x: case.call(x, comm), (x,), (v,))
        _, pullback = jax.vjp(lambda x: case.call(x, comm), x)
        return y, ydot, pullback(w)[0]

    y = jax.eval_shape(lambda x: case.call(x, comm), x)
    assert mpi_calls(compile_for_gpu(program, x, x, np.zeros(y.shape, y.dtype)))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_under_vmap(comm, case):
    batch = np.stack([inputs(case)[comm.Get_rank()]] * 3)
    assert mpi_calls(compile_for_gpu(jax.vmap(lambda x: case.call(x, comm)), batch))


def test_a_stencil_loop_with_rows_going_straight_into_the_calls():
    """The loop that aborted on the H200 with barriers in front of the calls
    only (row-test-rewrite.diff): the fusion took the allreduce together with
    the row update its result feeds."""
    assert mpi_calls(compile_for_gpu(stencil_loop, np.zeros((130, 258), np.float32))) == [
        "mpijax_neighbor_exchange",
        "mpijax_allreduce",
    ]


def test_the_shallow_water_loop(comm):
    """The example's own loop as it compiles it by default (float32, its
    grid, a quarter day): the program that aborted on the H200 before the
    calls had barriers (example-rewrite.diff)."""
    cfg = sw.Config(n=sw.Config().n // comm.Get_size() * comm.Get_size())
    cart, rows, cols = sw.decompose(comm, cfg.n)
    loop, _ = sw.time_loop(cfg, cart)
    assert mpi_calls(compile_for_gpu(loop, sw.initial_state(cfg, rows, cols)))
    cart.Free()


def test_the_poisson_solve_and_its_gradient(comm):
    """The CG example at its default size: a while loop of halo exchanges
    and dot products, and its gradient (the adjoint solve), in float64."""
    cart = comm.Create_cart(MPI.Compute_dims(comm.Get_size(), 2), periods=[False, False])
    theta, problem = poisson_cg.setup(128, cart)
    comms = poisson_cg.mpijax_comms(cart)
    loss = jax.value_and_grad(lambda theta: poisson_cg.loss(theta, problem, comms))
    assert mpi_calls(compile_for_gpu(loss, theta))
    cart.Free()


def test_the_data_parallel_epoch(comm):
    """The training example's epoch: a scan of Adam steps whose gradients
    are averaged by one tree_allreduce each."""
    data = data_parallel.dataset(4800)
    params = data_parallel.init_params(jax.random.key(0), [2, 64, 64, 1])
    state = (params, data_parallel.adam_init(params))
    rows = np.zeros((20, 240 // comm.Get_size()), np.int32)
    epoch = data_parallel.make_epoch(data_parallel.mpi_average(comm), 3e-3)
    assert mpi_calls(compile_for_gpu(epoch, state, data, rows)) == ["mpijax_allreduce"]


def test_a_training_step_with_a_barrier(comm):
    def step(w, x):
        mpijax.barrier(comm=comm)
        loss = lambda w: mpijax.allreduce(jnp.sum(jnp.tanh(x @ w) ** 2), MPI.SUM, comm=comm)  # noqa: E731
        return jax.grad(loss)(w)

    assert mpi_calls(compile_for_gpu(step, np.zeros((8, 4)), np.zeros((16, 8)))) == [
        "mpijax_barrier",
        "mpijax_allreduce",
    ]


def test_every_handler_was_compiled(comm):
    """Last in the module, which it needs whole: its programs, on one rank or
    another, called every handler the build has for CUDA, so that an op added
    without a program here fails. Not alone: there a halo exchange whose
    axes are not periodic has no one to talk to and makes no call."""
    if comm.Get_size() == 1:
        pytest.skip("needs 2 or more ranks (scripts/test.sh runs this module at 2)")
    assert set().union(*comm.allgather(COMPILED)) == set(FFI_TARGETS["CUDA"])
