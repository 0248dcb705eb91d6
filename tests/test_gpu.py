"""mpijax on an NVIDIA GPU: every op that moves data, eager and jit, over
every dtype, with jvp, vjp and vmap, and in messages of 8 MiB and 256 MiB,
on arrays that live on the GPU, against NumPy references computed from every
rank's input (derivatives against central differences in float64, as in
test_autodiff.py); staged through pinned host memory and, where the MPI
library moves device memory, CUDA-aware. Run by scripts/gpu_check.sh at 2
ranks sharing one GPU; skipped where JAX sees none.

MPIJAX_GPU_TESTS_ON=cpu runs the module on the CPU device instead, through the
CPU handlers (CUDA-aware needs a GPU), for checking the tests themselves where
no GPU is; scripts/test.sh runs it so against a build whose CPU handlers take
the CUDA policy, staged, with a stand-in CUDA runtime (MPIJAX_CUDA=STAND_IN)."""

import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import (
    BIG,
    DTYPES,
    MODES,
    MPI_FAILURE,
    RANK,
    SIZE,
    assert_equal,
    checkerboard,
    data,
    fresh_job_env,
    np_dtype,
    stencil_loop,
)
from test_autodiff import (
    CASES,
    COUNTS,
    OFFSETS,
    RAGGED_ROWS,
    SENDS,
    _ragged_reference,
    _rows_to,
    assert_close,
    cotangents,
    fd_tangents,
    fold,
    inputs,
    pairing,
    ring,
)

PLATFORM = os.environ.get("MPIJAX_GPU_TESTS_ON", "gpu")
try:
    DEVICE = jax.devices(PLATFORM)[0]
except RuntimeError:
    pytest.skip(
        "needs an NVIDIA GPU: scripts/gpu_check.sh runs these on one (MPIJAX_GPU_TESTS_ON=cpu: on the CPU)",
        allow_module_level=True,
    )

gpu_only = pytest.mark.skipif(PLATFORM != "gpu", reason="MPIJAX_GPU_TESTS_ON=cpu: needs a GPU")
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
ROOT = SIZE - 1  # not 0 where there are two ranks: MPICH's reduce feeds such a root from a copy
CART = MPI.COMM_WORLD.Create_cart([SIZE], periods=[True])  # ranks as in COMM_WORLD (no reordering)


@pytest.fixture(params=["staged", "cuda-aware"] if PLATFORM == "gpu" else ["staged"])
def memory(request):
    """Both memory policies of the CUDA handlers. Staged, the watchdog is on,
    so that a call (or a derivative) that waits for a message that never
    comes fails instead of hanging. CUDA-aware, it is off: under it the
    collectives would be staged (test_every_op_under_the_watchdog), and MPI
    must get device memory; pytest-timeout ends a hang there."""
    if request.param == "cuda-aware":
        # Only where the library says yes: one that cannot tell (-1) might crash the whole run.
        if core.cuda_aware_mpi() != 1:
            pytest.skip(f"{MPI.Get_library_version().splitlines()[0]} does not say it can move device memory")
        mpijax.set_cuda_aware(True)
    else:
        mpijax.set_timeout(60)
    yield request.param
    mpijax.wait()  # the test's calls (x returned off the root may leave some queued) run in its mode
    mpijax.set_cuda_aware(False)
    mpijax.set_timeout(None)


def run(f, *args):
    """f's result with its inputs, and whatever it creates, on DEVICE, as
    NumPy arrays; every output must be there (not fall back to the host)."""
    with jax.default_device(DEVICE):
        out = jax.block_until_ready(f(*jax.device_put(args, DEVICE)))
    for leaf in jax.tree.leaves(out):
        assert {d.platform for d in leaf.devices()} == {PLATFORM}, leaf.devices()
    return jax.tree.map(np.asarray, out)


class Spec(NamedTuple):
    """An op: this rank's input shape (from the shape of one row), its call
    with a reduction defined on the dtype, and this rank's result in NumPy
    from every rank's input and the reduction's NumPy function."""

    shape: Callable  # (rank, row) -> shape
    call: Callable  # (x, comm, mpi_op) -> result
    want: Callable  # (xs, np_op) -> this rank's result


def same(rank, row):
    return row


def rows(n):
    """n(rank) rows on each rank."""
    return lambda rank, row: (n(rank), *row)


def irecv_isend(x, comm):
    received = mpijax.irecv(jnp.zeros_like(x), PREV, comm=comm)
    return mpijax.wait([received, mpijax.isend(x, NEXT, comm=comm)])[0]


def halo(xs):
    """The 1-d periodic block with its ghost rows from the neighbours."""
    x = xs[RANK].copy()
    x[0], x[-1] = xs[PREV][-2], xs[NEXT][1]
    return x


SPECS = {
    "allreduce": Spec(same, lambda x, c, op: mpijax.allreduce(x, op, comm=c), lambda xs, f: fold(f, xs)),
    "reduce": Spec(
        same,
        lambda x, c, op: mpijax.reduce(x, op, ROOT, comm=c),
        lambda xs, f: fold(f, xs) if RANK == ROOT else xs[RANK],
    ),
    "scan": Spec(same, lambda x, c, op: mpijax.scan(x, op, comm=c), lambda xs, f: fold(f, xs[: RANK + 1])),
    "exscan": Spec(
        same,
        lambda x, c, op: mpijax.exscan(x, op, comm=c),
        lambda xs, f: fold(f, xs[:RANK]) if RANK else np.zeros_like(xs[0]),  # SUM's and LOR's identity
    ),
    "reduce_scatter": Spec(
        rows(lambda r: SIZE),
        lambda x, c, op: mpijax.reduce_scatter(x, op, comm=c),
        lambda xs, f: fold(f, [x[RANK] for x in xs]),
    ),
    "tree_allreduce": Spec(
        same,
        lambda x, c, op: mpijax.tree_allreduce({"a": x, "b": jnp.flip(x)}, op, comm=c),
        lambda xs, f: {"a": fold(f, xs), "b": np.flip(fold(f, xs))},
    ),
    "bcast": Spec(same, lambda x, c, op: mpijax.bcast(x, ROOT, comm=c), lambda xs, f: xs[ROOT]),
    "gather": Spec(
        same,
        lambda x, c, op: mpijax.gather(x, ROOT, comm=c),
        lambda xs, f: np.stack(xs) if RANK == ROOT else xs[RANK],
    ),
    "scatter": Spec(
        lambda rank, row: (SIZE, *row) if rank == ROOT else row,
        lambda x, c, op: mpijax.scatter(x, ROOT, comm=c),
        lambda xs, f: xs[ROOT][RANK],
    ),
    "allgather": Spec(same, lambda x, c, op: mpijax.allgather(x, comm=c), lambda xs, f: np.stack(xs)),
    "alltoall": Spec(
        rows(lambda r: SIZE),
        lambda x, c, op: mpijax.alltoall(x, comm=c),
        lambda xs, f: np.stack([x[RANK] for x in xs]),
    ),
    "allgatherv": Spec(
        rows(lambda r: COUNTS[r]),
        lambda x, c, op: mpijax.allgatherv(x, COUNTS, comm=c),
        lambda xs, f: np.concatenate(xs),
    ),
    "gatherv": Spec(
        rows(lambda r: COUNTS[r]),
        lambda x, c, op: mpijax.gatherv(x, COUNTS, ROOT, comm=c),
        lambda xs, f: np.concatenate(xs) if RANK == ROOT else xs[RANK],
    ),
    "scatterv": Spec(
        rows(lambda r: sum(COUNTS) if r == ROOT else COUNTS[r]),
        lambda x, c, op: mpijax.scatterv(x, COUNTS, ROOT, comm=c),
        lambda xs, f: xs[ROOT][OFFSETS[RANK] : OFFSETS[RANK + 1]],
    ),
    "alltoallv": Spec(
        rows(lambda r: sum(SENDS[r])),
        lambda x, c, op: mpijax.alltoallv(x, SENDS[RANK], [s[RANK] for s in SENDS], comm=c),
        lambda xs, f: _rows_to(xs, RANK),
    ),
    "ragged_alltoall": Spec(
        rows(lambda r: sum(SENDS[r]) + 1),
        lambda x, c, op: mpijax.ragged_alltoall(x, jnp.asarray(SENDS[RANK], jnp.int32), rows=RAGGED_ROWS, comm=c),
        lambda xs, f: (_ragged_reference(xs)[RANK], np.array([s[RANK] for s in SENDS], np.int32)),
    ),
    "sendrecv": Spec(same, lambda x, c, op: mpijax.sendrecv(x, x, PREV, NEXT, comm=c), lambda xs, f: xs[PREV]),
    "send-recv": Spec(same, lambda x, c, op: ring(x, c), lambda xs, f: xs[PREV]),
    "isend-irecv": Spec(same, lambda x, c, op: irecv_isend(x, c), lambda xs, f: xs[PREV]),
    # The message to oneself is copied without MPI.
    "neighbor_exchange": Spec(
        same,
        lambda x, c, op: mpijax.neighbor_exchange([x, jnp.flip(x), x], [PREV, NEXT, RANK], [NEXT, PREV, RANK], comm=c),
        lambda xs, f: [xs[PREV], np.flip(xs[NEXT]), xs[RANK]],
    ),
    "ineighbor_exchange": Spec(
        same,
        lambda x, c, op: mpijax.wait(mpijax.ineighbor_exchange([x, jnp.flip(x)], [PREV, NEXT], [NEXT, PREV], comm=c)),
        lambda xs, f: [xs[PREV], np.flip(xs[NEXT])],
    ),
    "halo_exchange": Spec(rows(lambda r: 4), lambda x, c, op: mpijax.halo_exchange(x, CART), lambda xs, f: halo(xs)),
}


def reduction(dtype):
    """One defined on every dtype (the MPI standard leaves sums of bools out)."""
    return (MPI.LOR, np.logical_or) if dtype == "bool" else (MPI.SUM, np.add)


def assert_same(actual, expected):
    """assert_equal, but without the copies NumPy's assertion makes (GiBs,
    at 256 MiB per rank) where the arrays are equal."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype or not np.array_equal(actual, expected):
        assert_equal(actual, expected)


def check(comm, mode, name, dtype, row, memory="staged"):
    """The op's result against NumPy's; in CUDA-aware mode, also that MPI
    got device memory."""
    spec = SPECS[name]
    xs = [data(spec.shape(r, row), dtype, r) for r in range(SIZE)]
    mpi_op, np_op = reduction(dtype)
    want, mine = spec.want(xs, np_op), xs[RANK]
    del xs  # the other ranks' inputs: host memory, with 256 MiB each
    before = mpijax.call_stats()["device_pointer_calls"]
    jax.tree.map(assert_same, run(MODES[mode](lambda x: spec.call(x, comm, mpi_op)), mine), want)
    mpijax.wait()  # off the root, reduce, gather and gatherv return x before they have run
    if memory == "cuda-aware":
        assert mpijax.call_stats()["device_pointer_calls"] > before, f"{name} staged its data in CUDA-aware mode"


@checkerboard(name=list(SPECS), dtype=DTYPES)
def test_every_op_and_dtype(comm, memory, mode, name, dtype):
    """Each op over every dtype, each op and each dtype both eager and jitted."""
    check(comm, mode, name, dtype, row=(3, 2), memory=memory)


@checkerboard(name=list(SPECS), row=[(), (0,)])
def test_scalar_and_empty_rows(comm, memory, mode, name, row):
    """Empty arrays have no device memory to point MPI at."""
    check(comm, mode, name, "float32", row)


# Every path a message takes: reductions (in place), rooted, replicated,
# per-peer blocks, point to point; 8 MiB over every dtype, and on a GPU 256 MiB
# in one (on the CPU, the stand-in's pinned memory is plain host memory, which
# 8 MiB grows alike: 19 of the stand-in stage's 75 s went to 256 MiB).
LARGE = [(BIG, dtype) for dtype in DTYPES] + [(32 * BIG, "float32")] * (PLATFORM == "gpu")


@checkerboard(**{"nbytes,dtype": LARGE}, name=["allreduce", "reduce", "bcast", "allgather", "alltoall", "sendrecv"])
def test_large_messages(comm, memory, mode, nbytes, dtype, name):
    """Each rank's input is nbytes: far above any eager (rendezvous) limit;
    at 256 MiB the pinned staging memory also grows far past what the other
    tests left it."""
    blocks = math.prod(SPECS[name].shape(RANK, (1,)))  # the same on every rank for these ops
    check(comm, mode, name, dtype, row=(nbytes // np_dtype(dtype).itemsize // blocks,), memory=memory)


@pytest.mark.parametrize("name", SPECS)
def test_every_op_under_the_watchdog(comm, memory, name):
    """With a timeout, every call runs MPI's nonblocking form: collectives
    then go through host memory also in CUDA-aware mode, since Open MPI's
    CUDA support takes device buffers in blocking collectives only."""
    mpijax.set_timeout(60)
    try:
        check(comm, "jit", name, "float32", row=(3, 2))
    finally:
        mpijax.set_timeout(None)


@pytest.mark.parametrize("mode", MODES)
def test_barrier(comm, memory, mode):
    """A barrier between device computations, returning nothing."""
    xs = [data((3,), "float32", r) for r in range(SIZE)]

    def program(x):
        assert mpijax.barrier(comm=comm) is None
        return mpijax.allreduce(x, MPI.SUM, comm=comm)

    assert_equal(run(MODES[mode](program), xs[RANK]), fold(np.add, xs))


def pulled_back(case, xs, ws):
    """J^T w on this rank, entry by entry: the global pairing of the
    cotangents with the central differences of every rank's result, where
    only this rank's input moves, along one basis vector."""
    x = xs[RANK]
    moved = [
        [np.eye(x.size)[j].reshape(x.shape) if r == RANK else 0 * y for r, y in enumerate(xs)] for j in range(x.size)
    ]
    return np.reshape([pairing(case, ws, fd_tangents(case, xs, vs)) for vs in moved], x.shape)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_value_jvp_and_vjp(comm, memory, case, mode):
    """In float64 (test_autodiff's cases): y against NumPy, jvp and vjp
    against central differences of NumPy's global function."""
    xs, vs, ws = inputs(case), inputs(case, "v"), cotangents(case)

    def program(x, v, w):
        y, ydot = jax.jvp(lambda x: case.call(x, comm), (x,), (v,))
        _, pullback = jax.vjp(lambda x: case.call(x, comm), x)
        return y, ydot, pullback(w)[0]

    y, ydot, xbar = run(MODES[mode](program), xs[RANK], vs[RANK], ws[RANK])
    assert_close(y, case.reference(xs)[RANK], rtol=1e-12)
    assert_close(ydot, fd_tangents(case, xs, vs)[RANK])
    assert_close(xbar, pulled_back(case, xs, ws))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_op_under_vmap(comm, memory, case, mode):
    batch = [inputs(case, f"batch{b}") for b in range(3)]
    got = run(MODES[mode](jax.vmap(lambda x: case.call(x, comm))), np.stack([b[RANK] for b in batch]))
    assert_close(got, np.stack([case.reference(b)[RANK] for b in batch]), rtol=1e-12)


def test_grad_of_a_jitted_training_step(comm, memory):
    """A data-parallel step with matmuls around the MPI call: the gradient of
    the loss summed over ranks (a replicated result, counted once) in this
    rank's weights is that of this rank's own loss."""
    rng = np.random.default_rng(RANK)
    w, x = rng.normal(size=(8, 4)), rng.normal(size=(16, 8))

    @jax.jit
    def step(w, x):
        loss = lambda w: mpijax.allreduce(jnp.sum(jnp.tanh(x @ w) ** 2), MPI.SUM, comm=comm)  # noqa: E731
        return jax.grad(loss)(w)

    t = np.tanh(x @ w)
    assert_close(run(step, w, x), x.T @ (2 * t * (1 - t**2)), rtol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_reverse_mode_through_short_messages(comm, memory, mode):
    """A message shorter than its receive buffer answers a cotangent of its
    own length, each batch element's part packed from device memory under
    vmap (test_point_to_point's test, on DEVICE): the global loss is the sum
    over ranks of sum(w_r * y_r**2), y_r the previous rank's x padded."""
    w = lambda r: np.arange(5.0) + 10 * r + 1  # noqa: E731

    def loss(x):
        return jnp.sum(w(RANK) * mpijax.sendrecv(x, jnp.zeros(5), PREV, NEXT, comm=comm) ** 2)

    x = np.arange(3.0) + RANK + 1
    xs = np.stack([x, 2 * x, -x])
    assert_close(run(MODES[mode](jax.grad(loss)), x), 2 * w(NEXT)[:3] * x, rtol=1e-12)
    assert_close(run(MODES[mode](jax.vmap(jax.grad(loss))), xs), 2 * w(NEXT)[:3] * xs, rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_a_message_that_ends_inside_an_element_raises(comm, memory, mode):
    """test_point_to_point's test_a_message_of_another_dtype, on DEVICE:
    three float32 into jnp.zeros(3), float64 here."""
    f = MODES[mode](lambda x: mpijax.sendrecv(x, jnp.zeros(3), PREV, NEXT, comm=comm))
    with pytest.raises(MPI_FAILURE, match="the message ends inside an element of the float64 array"):
        run(f, np.arange(3, dtype=np.float32))


def test_rows_of_a_field_go_straight_into_the_calls_of_a_loop(memory):
    """reference.stencil_loop, whose slices XLA:GPU's dynamic-slice fusion
    folds into a fusion around the calls, token and all, which its priority
    fusion then cannot cost (the shallow-water example aborted so on an
    H200), at the example's block size; against NumPy."""
    start = [np.arange(130 * 258, dtype=np.float32).reshape(130, 258) + 1000 * r for r in range(SIZE)]
    want = start
    for _ in range(2):
        before, want = want, [x.copy() for x in want]
        for r, x in enumerate(want):
            x[0, 1:-1], x[-1, 1:-1] = before[(r - 1) % SIZE][-2, 1:-1], before[(r + 1) % SIZE][1, 1:-1]
        total = sum(x[2, 1:-1] for x in want)
        for x in want:
            x[2, 1:-1] = total
    assert_equal(run(jax.jit(lambda x: stencil_loop(x, CART)), start[RANK]), want[RANK])


@gpu_only
def test_the_build_has_cuda_handlers():
    assert mpijax.has_cuda_support()


def test_cuda_aware_mode_is_refused_where_the_mpi_cannot_move_device_memory(comm):
    """Refused on every rank alike, and the ops go on, staged."""
    if not mpijax.has_cuda_support() or core.cuda_aware_mpi() != 0:
        pytest.skip("needs CUDA handlers and an MPI that says it cannot move device memory")
    with pytest.raises(RuntimeError, match="says it cannot move device memory"):
        mpijax.set_cuda_aware(True)
    assert not core.cuda_aware()
    check(comm, "jit", "sendrecv", "float32", row=(3,))


@gpu_only
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
