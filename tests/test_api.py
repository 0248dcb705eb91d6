"""The public API is mpi4jax's (>= 0.8): names, signatures, defaults, and
code written for it runs with `import mpijax as mpi4jax`."""

import inspect
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src import environment, jax_version
from mpijax._src.runtime import core

from reference import RANK, SIZE, stencil_loop

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE

# Signatures of mpi4jax 0.8 / 0.9 (token-free API; token= is only there to be refused).
MPI4JAX_SIGNATURES = {
    "allgather": "(x, *, comm=None, token=NOTSET)",
    "allreduce": "(x, op, *, comm=None, token=NOTSET)",
    "alltoall": "(x, *, comm=None, token=NOTSET)",
    "barrier": "(*, comm=None, token=NOTSET)",
    "bcast": "(x, root, *, comm=None, token=NOTSET)",
    "gather": "(x, root, *, comm=None, token=NOTSET)",
    "recv": f"(x, source={MPI.ANY_SOURCE}, *, tag={MPI.ANY_TAG}, comm=None, status=None, token=NOTSET)",
    "reduce": "(x, op, root, *, comm=None, token=NOTSET)",
    "scan": "(x, op, *, comm=None, token=NOTSET)",
    "scatter": "(x, root, *, comm=None, token=NOTSET)",
    "send": "(x, dest, *, tag=0, comm=None, token=NOTSET)",
    "sendrecv": f"(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag={MPI.ANY_TAG}, comm=None, status=None, "
    "token=NOTSET)",
    "has_cuda_support": "()",
    "has_sycl_support": "()",
}
# mpijax's own additions: the collectives mpi4jax lacks (README), the halo exchange (docs/halo.md), the
# reliability switches (docs/failure-modes.md), the GPU helpers (docs/gpu.md)
# and waiting for queued calls (README).
MPIJAX_EXTRAS = {
    "allgatherv": "(x, counts, *, comm=None)",
    "alltoallv": "(x, send_counts, recv_counts, *, comm=None)",
    "exscan": "(x, op, *, comm=None)",
    "gatherv": "(x, counts, root, *, comm=None)",
    "reduce_scatter": "(x, op, *, comm=None)",
    "scatterv": "(x, counts, root, *, comm=None)",
    "ragged_alltoall": "(x, send_counts, *, rows=None, comm=None)",
    "neighbor_exchange": "(sends, sources, dests, *, recvs=None, tags=None, comm=None)",
    "cart_neighbors": "(comm, *, corners=True)",
    "halo_exchange": "(x, comm, *, width=1, corners=True)",
    "bind_local_gpu": "(comm=None)",
    "call_stats": "(*, reset=False)",
    "set_check": "(enabled=True)",
    "set_cuda_aware": "(enabled=True)",
    "set_timeout": "(seconds)",
    "wait": "(requests=None, *, after=None)",
    "isend": "(x, dest, *, tag=0, comm=None)",
    "irecv": "(x, source, *, tag=0, comm=None)",
    "ineighbor_exchange": "(sends, sources, dests, *, recvs=None, tags=None, comm=None)",
    "started": "(requests, x)",
    "tree_allreduce": "(tree, op, *, comm=None)",
    "varying": "(x, *, comm=None)",
}


def test_public_names_and_signatures():
    public = MPI4JAX_SIGNATURES | MPIJAX_EXTRAS
    seed = ["Allreduce", "Recv", "Send", "Sendrecv"]  # mpi4jax 0.2's API: tests/test_seed_api.py
    types = ["Request"]  # what isend, irecv and ineighbor_exchange return
    assert sorted(mpijax.__all__) == sorted([*public, *seed, *types])
    for name, signature in public.items():
        assert str(inspect.signature(getattr(mpijax, name))) == signature, name


# Every public name of mpi4jax 0.9.1: the __all__ of its mpi4jax/__init__.py
# (its only public module; everything else lives in mpi4jax._src).
MPI4JAX_091_PUBLIC = [
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv", "reduce", "scan",
    "scatter", "send", "sendrecv", "has_cuda_support", "has_sycl_support",
]  # fmt: skip
# mpi4jax 0.5-0.6 held the token-free ops in mpi4jax.experimental.notoken, 0.7
# in mpi4jax.notoken (the __all__ of those modules); 0.8 made them the top level.
MPI4JAX_NOTOKEN = [
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv", "reduce", "scan",
    "scatter", "send", "sendrecv",
]  # fmt: skip


def test_every_public_name_of_mpi4jax_0_9_1():
    namespace = {}
    exec("from mpijax import *", namespace)
    for name in MPI4JAX_091_PUBLIC:
        assert callable(namespace[name]), name
    assert isinstance(mpijax.__version__, str)
    assert mpijax.has_sycl_support() is False


def test_notoken_modules_of_mpi4jax_0_5_to_0_7():
    import mpijax.experimental.notoken
    import mpijax.notoken

    for module in (mpijax.experimental.notoken, mpijax.notoken):
        assert sorted(module.__all__) == sorted(MPI4JAX_NOTOKEN)
        for name in MPI4JAX_NOTOKEN:
            assert getattr(module, name) is getattr(mpijax, name), (module, name)
    y = mpijax.experimental.notoken.allreduce(jnp.full(2, RANK + 1.0), op=MPI.SUM)
    np.testing.assert_array_equal(y, np.full(2, SIZE * (SIZE + 1) / 2))


def test_error_messages_keep_mpi4jax_words():
    """mpi4jax's tests look for these phrases in the exception text."""
    with pytest.raises(ValueError) as error:
        mpijax.alltoall(jnp.zeros((SIZE + 1, 2)))
    assert "must have shape (nproc, ...)" in str(error.value)
    root = SIZE - 1
    if RANK == root:  # only the root knows the shape it scatters
        with pytest.raises(ValueError) as error:
            jax.jit(lambda x: mpijax.scatter(x, root))(jnp.zeros((SIZE + 1, 2)))
        assert str(error.value).startswith("mpijax.scatter: Scatter input must have shape (nproc, ...) on the root")


@pytest.mark.parametrize(
    "value,on",
    [(None, False), ("", False), ("1", True), ("TRUE", True), ("on", True), ("yes", True)]
    + [("0", False), ("false", False), ("Off", False), (" no ", False)],
)
def test_switches_read_as_mpi4jax_reads_its_own(monkeypatch, value, on):
    """MPI4JAX_USE_CUDA_MPI=false turned CUDA-aware mode on, and
    MPI4JAX_DEBUG=off the log (found by a tester): every switch reads the
    words mpi4jax reads, and one that is set to another word raises."""
    monkeypatch.delenv("MPIJAX_CHECK", raising=False)
    if value is not None:
        monkeypatch.setenv("MPIJAX_CHECK", value)
    assert environment.flag("MPIJAX_CHECK") is on
    assert environment.flag("MPIJAX_CHECK", default=True) is (on or value in (None, ""))
    monkeypatch.setenv("MPIJAX_CHECK", "enabled")
    with pytest.raises(ValueError, match=r"MPIJAX_CHECK='enabled': expected one of 1, true, on, yes \(on\)"):
        environment.flag("MPIJAX_CHECK")


def test_mpijax_names_decide_over_mpi4jax_names_and_every_switch_is_checked(monkeypatch):
    monkeypatch.setenv("MPIJAX_DEBUG", "0")
    monkeypatch.setenv("MPI4JAX_DEBUG", "1")
    assert environment.flag("MPIJAX_DEBUG", "MPI4JAX_DEBUG") is False
    monkeypatch.setenv("MPIJAX_DEBUG", "")
    assert environment.flag("MPIJAX_DEBUG", "MPI4JAX_DEBUG") is True
    monkeypatch.setenv("MPIJAX_DEBUG", "yes")
    monkeypatch.setenv("MPI4JAX_DEBUG", "2")
    with pytest.raises(ValueError, match="MPI4JAX_DEBUG='2'"):
        environment.flag("MPIJAX_DEBUG", "MPI4JAX_DEBUG")
    monkeypatch.setenv("MPIJAX_UNTESTED_JAX", "maybe")  # checked with a tested JAX too
    with pytest.raises(ValueError, match="MPIJAX_UNTESTED_JAX='maybe'"):
        jax_version.warn_if_untested(jax_version.TESTED[0])


def test_setters_take_a_bool_and_seconds_not_words():
    """set_check("false") turned check mode on, and set_timeout(True) set one
    second (found by a tester)."""
    before = core.check(), core.timeout()
    for value in ["false", "0", None, 0.5]:
        with pytest.raises(TypeError, match=f"mpijax.set_check: enabled must be True or False, got {value!r}"):
            mpijax.set_check(value)
    for value in ["5", True, np.bool_(False)]:
        with pytest.raises(TypeError, match="mpijax.set_timeout: seconds must be a number or None"):
            mpijax.set_timeout(value)
    with pytest.raises(ValueError, match="mpijax.set_timeout: seconds must be >= 0 or None, got -1.0"):
        mpijax.set_timeout(-1)
    assert (core.check(), core.timeout()) == before
    mpijax.set_check(np.bool_(before[0]))
    mpijax.set_timeout(np.float32(before[1]))
    assert (core.check(), core.timeout()) == before


def test_cuda_support_is_what_the_build_has():
    """A build with the CUDA toolkit has CUDA handlers, and programs lower for
    CUDA with the same token-threaded custom calls (checked without a GPU)."""
    assert mpijax.has_cuda_support() is ("CUDA" in core.ffi_targets())
    if not mpijax.has_cuda_support():
        pytest.skip("a CPU-only build: CMake found no CUDA toolkit")
    f = jax.jit(lambda x: mpijax.sendrecv(mpijax.allreduce(x, MPI.SUM), x, PREV, NEXT))
    text = f.trace(jnp.ones(3)).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(mpijax_\w+)\(([^)]*)\)", text)
    assert [name for name, _ in calls] == ["mpijax_allreduce", "mpijax_sendrecv"], text
    assert all("!stablehlo.token" in text for _ in calls)


def test_the_cuda_lowering_puts_barriers_between_the_calls_and_the_slices_around_them():
    """XLA:GPU's dynamic-slice fusion folds a custom call together with the
    slices that feed it, or the slice updates its results feed, into one
    fusion, token and all, which aborted compiling on an H200 (JAX 0.11.2):
    on CUDA every array in or out of an MPI call passes an optimization
    barrier (checked without a GPU; tests/test_gpu.py compiles such a loop)."""
    if not mpijax.has_cuda_support():
        pytest.skip("a CPU-only build: CMake found no CUDA toolkit")
    lowered = jax.jit(stencil_loop).trace(jnp.ones((6, 8))).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")

    def ops(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield inner.operation
                    yield from ops(inner.operation)

    def arrays(values):
        return [v for v in values if str(v.type) != "!stablehlo.token"]

    calls = [op for op in ops(module.operation) if op.name == "stablehlo.custom_call"]
    assert sorted(str(call.attributes["call_target_name"]) for call in calls) == [
        '"mpijax_allreduce"',
        '"mpijax_neighbor_exchange"',
    ]
    for call in calls:
        assert all(v.owner.name == "stablehlo.optimization_barrier" for v in arrays(call.operands)), call
        assert all(use.owner.name == "stablehlo.optimization_barrier" for v in arrays(call.results) for use in v.uses)


def test_cuda_aware_mode_needs_an_mpi_that_moves_device_memory():
    if not mpijax.has_cuda_support():
        with pytest.raises(RuntimeError, match="no CUDA handlers"):
            mpijax.set_cuda_aware(True)
    elif core.cuda_aware_mpi() == 0:
        with pytest.raises(RuntimeError, match="says it cannot move device memory") as refused:
            mpijax.set_cuda_aware(True)
        assert not core.cuda_aware()
        assert MPI.Get_library_version().replace("\0", "").splitlines()[0] in str(refused.value)
        assert "\0" not in str(refused.value)
    else:
        pytest.skip("this MPI library is CUDA-aware: tests/test_gpu.py uses the mode")
    mpijax.set_cuda_aware(False)  # always allowed


def test_bind_local_gpu_must_come_before_jax_starts():
    jax.devices()
    with pytest.raises(RuntimeError, match="before JAX starts"):
        mpijax.bind_local_gpu()


def test_mpi4jax_code_runs_unchanged():
    """The shape of mpi4jax's README example, with only the import changed."""
    import mpijax as mpi4jax

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    @jax.jit
    def foo(arr):
        arr = arr + rank
        arr_sum = mpi4jax.allreduce(arr, op=MPI.SUM, comm=comm)
        return arr_sum

    a = jnp.zeros((3, 3))
    result = foo(a)
    np.testing.assert_array_equal(result, np.full((3, 3), SIZE * (SIZE - 1) / 2))

    # Keyword arguments as mpi4jax's docs use them.
    y = mpi4jax.sendrecv(sendbuf=a + rank, recvbuf=a, source=(rank - 1) % SIZE, dest=(rank + 1) % SIZE, comm=comm)
    np.testing.assert_array_equal(y, np.full((3, 3), (rank - 1) % SIZE))
    np.testing.assert_array_equal(mpi4jax.bcast(a + rank, root=0, comm=comm), np.zeros((3, 3)))
    gathered = mpi4jax.gather(a + rank, root=0, comm=comm)
    every = np.stack([np.full((3, 3), float(r)) for r in range(SIZE)])
    np.testing.assert_array_equal(gathered, every if RANK == 0 else every[RANK])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_where_results_differ_from_mpi4jax(mode):
    """docs/migration.md's differences: send and barrier return None
    (mpi4jax: []); a weakly typed input gives a weakly typed result, so a
    bfloat16 array divided by it stays bfloat16 (mpi4jax: float32); an input
    returned unchanged comes back as a JAX array (mpi4jax: x itself)."""
    run = jax.jit if mode == "jit" else (lambda f: f)
    comm = MPI.COMM_WORLD
    assert run(lambda: mpijax.barrier(comm=comm))() is None
    assert run(lambda x: mpijax.send(x, MPI.PROC_NULL, comm=comm))(jnp.ones(2)) is None
    n = run(lambda x: mpijax.allreduce(x, op=MPI.SUM, comm=comm))(1.0)
    assert jax.typeof(n).weak_type and n == SIZE
    assert (jnp.ones(2, jnp.bfloat16) / n).dtype == jnp.bfloat16
    kept = run(lambda x: mpijax.bcast(x, root=0, comm=MPI.COMM_SELF))(np.float64(2.5))
    assert isinstance(kept, jax.Array) and kept == 2.5
    reduced = run(lambda x: mpijax.reduce(x, op=MPI.SUM, root=0, comm=comm))(np.float64(2.5))
    assert isinstance(reduced, jax.Array) and reduced == (2.5 * SIZE if RANK == 0 else 2.5)


def test_untested_jax_versions_get_a_warning_that_can_be_silenced(monkeypatch):
    low, high = jax_version.TESTED
    monkeypatch.delenv("MPIJAX_UNTESTED_JAX", raising=False)
    for untested in ("0.7.2", "0.12.1", "0.13.0", "1.0", "unknown"):
        says = rf"tested with JAX {low} to {high}, not with JAX {untested}: .* set MPIJAX_UNTESTED_JAX=1 to silence"
        with pytest.warns(UserWarning, match=says):
            jax_version.warn_if_untested(untested)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tested in (low, "0.10.0", "0.12.0", high):
            jax_version.warn_if_untested(tested)
        monkeypatch.setenv("MPIJAX_UNTESTED_JAX", "1")
        jax_version.warn_if_untested("0.13.0")


def test_pyproject_requires_the_tested_jax_range():
    pyproject = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    low, high = jax_version.TESTED
    assert f'"jax>={low},<={high}"' in pyproject
