"""Bad input raises at trace time on every rank, naming the argument; MPI
failures at run time raise a Python exception and the process carries on."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

from reference import MODES, MPI_FAILURE, RANK, SIZE

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE

x3 = jnp.arange(3.0)


def raises_everywhere(mode, f, exc, match, *args):
    """Every rank (all run this) raises before any MPI call is made."""
    with pytest.raises(exc, match=match):
        MODES[mode](f)(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [SIZE, -1, 10**6])
@pytest.mark.parametrize(
    "op",
    [
        lambda x, r, c: mpijax.bcast(x, r, comm=c),
        lambda x, r, c: mpijax.gather(x, r, comm=c),
        lambda x, r, c: mpijax.scatter(jnp.stack([x] * SIZE), r, comm=c),
        lambda x, r, c: mpijax.reduce(x, MPI.SUM, r, comm=c),
    ],
    ids=["bcast", "gather", "scatter", "reduce"],
)
def test_root_out_of_range(comm, mode, bad, op):
    raises_everywhere(mode, lambda x: op(x, bad, comm), ValueError, rf"root={bad} is out of range .*size {SIZE}", x3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, c: mpijax.send(x, SIZE, comm=c), f"dest={SIZE} is out of range"),
        (lambda x, c: mpijax.send(x, -7, comm=c), "dest=-7 is out of range"),
        (lambda x, c: mpijax.recv(x, SIZE + 3, comm=c), f"source={SIZE + 3} is out of range"),
        (lambda x, c: mpijax.sendrecv(x, x, 0, SIZE, comm=c), f"dest={SIZE} is out of range"),
        (lambda x, c: mpijax.sendrecv(x, x, -9, 0, comm=c), "source=-9 is out of range"),
        (lambda x, c: mpijax.send(x, 0, tag=-2, comm=c), "tag=-2 is out of range"),
        (lambda x, c: mpijax.sendrecv(x, x, 0, 0, sendtag=MPI.ANY_TAG, comm=c), "sendtag=MPI.ANY_TAG is not accepted"),
        (lambda x, c: mpijax.recv(x, 0, tag=-5, comm=c), "tag=-5 is out of range"),
    ],
    ids=["send-dest", "send-negative", "recv-source", "sendrecv-dest", "sendrecv-source", "send-tag",
         "sendtag-any", "recv-tag"],
)  # fmt: skip
def test_peer_and_tag_out_of_range(comm, mode, call, match):
    raises_everywhere(mode, lambda x: call(x, comm), ValueError, match, x3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype,op",
    [("complex64", "MAX"), ("complex128", "MIN"), ("bool", "SUM"), ("bool", "MAX"), ("float32", "BAND"),
     ("float16", "LAND"), ("bfloat16", "BXOR"), ("complex64", "LOR")],
)  # fmt: skip
@pytest.mark.parametrize("name", ["allreduce", "reduce", "scan", "tree_allreduce"])
def test_op_not_defined_for_dtype(comm, mode, dtype, op, name):
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    x = jnp.zeros(3, dt)
    args = (0,) if name == "reduce" else ()
    if name == "tree_allreduce":  # the leaf's dtype among others
        x = {"leaf": x, "other": jnp.zeros(2, jnp.int32)}
    f = lambda x: getattr(mpijax, name)(x, getattr(MPI, op), *args, comm=comm)  # noqa: E731
    raises_everywhere(mode, f, TypeError, rf"mpijax\.{name}: op=MPI.{op} is not defined for dtype {dtype}", x)


@pytest.mark.parametrize("bad", ["sum", 0, None, MPI.MAXLOC, MPI.REPLACE])
def test_op_must_be_a_predefined_reduction(comm, bad):
    """Not an MPI.Op is a TypeError, as in mpi4jax; an MPI.Op that is not a
    reduction a ValueError."""
    if isinstance(bad, MPI.Op):
        error, match = ValueError, r"op must be one of MPI\.SUM, .*; got <mpi4py\.MPI\.Op object .*>, which is not a"
    else:
        error, match = TypeError, rf"op must be an MPI\.Op, one of MPI\.SUM, .*; got {type(bad).__name__} {bad!r}$"
    with pytest.raises(error, match=match):
        mpijax.allreduce(x3, bad, comm=comm)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(), (SIZE + 1, 2), (0,)])
def test_alltoall_leading_axis(comm, mode, shape):
    raises_everywhere(
        mode,
        lambda x: mpijax.alltoall(x, comm=comm),
        ValueError,
        r"must have shape \(nproc, \.\.\.\)",
        jnp.zeros(shape),
    )


@pytest.mark.parametrize("mode", MODES)
def test_scatter_leading_axis_on_root(comm, mode):
    """Only the root knows the shape it scatters (elsewhere x is the result's
    template), so only the root can raise; the others do not call."""
    if RANK == 0:
        with pytest.raises(ValueError, match=r"Scatter input must have shape \(nproc, \.\.\.\) on the root"):
            MODES[mode](lambda x: mpijax.scatter(x, 0, comm=comm))(jnp.zeros((SIZE + 1, 2)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int4", "float8_e5m2"])
@pytest.mark.parametrize("name", ["allreduce", "bcast", "send", "allgather"])
def test_unsupported_dtype(comm, mode, dtype, name):
    x = jnp.zeros(4, getattr(ml_dtypes, dtype))
    calls = {
        "allreduce": lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm),
        "bcast": lambda x: mpijax.bcast(x, 0, comm=comm),
        "send": lambda x: mpijax.send(x, 0, comm=comm),
        "allgather": lambda x: mpijax.allgather(x, comm=comm),
    }
    raises_everywhere(mode, calls[name], TypeError, f"x has dtype {dtype}, which is not supported", x)


@pytest.mark.parametrize(
    "value,got", [(np.array(["a"]), "ndarray of dtype <U1"), ("abc", "str"), (None, "NoneType"), ([1, "x"], "list")]
)
def test_a_value_that_is_no_array_names_the_argument(comm, value, got):
    """Not JAX's words about an internal function ("passed to stage")."""
    with pytest.raises(TypeError, match=rf"^mpijax\.sendrecv: recvbuf must be an array or a number, got {got}$"):
        mpijax.sendrecv(jnp.ones(2), value, RANK, RANK, comm=comm)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda x, r, c: mpijax.bcast(x, r, comm=c), "root"),
        (lambda x, r, c: mpijax.send(x, r, comm=c), "dest"),
        (lambda x, r, c: mpijax.recv(x, r, comm=c), "source"),
        (lambda x, r, c: mpijax.send(x, 0, tag=r, comm=c), "tag"),
        (lambda x, r, c: mpijax.sendrecv(x, x, r, 0, comm=c), "source"),
    ],
)
def test_traced_value_where_static_int_needed(comm, call, name):
    with pytest.raises(TypeError, match=f"{name} must be a static Python int"):
        jax.jit(lambda x, r: call(x, r, comm))(x3, 0)


@pytest.mark.parametrize("bad", [1.0, "0", True, np.float32(0)])
def test_rank_argument_type(comm, bad):
    with pytest.raises(TypeError, match="root must be an int"):
        mpijax.bcast(x3, bad, comm=comm)


def test_numpy_and_concrete_jax_ints_are_accepted(comm):
    np.testing.assert_array_equal(mpijax.bcast(x3 + RANK, np.int64(0), comm=comm), x3)
    np.testing.assert_array_equal(mpijax.bcast(x3 + RANK, jnp.int32(0), comm=comm), x3)


@pytest.mark.skipif(SIZE < 2, reason="an inter-communicator needs two groups")
def test_intercommunicator(comm):
    local = comm.Split(RANK % 2, RANK)
    inter = local.Create_intercomm(0, comm, 1 - RANK % 2 if SIZE > 1 else 0, tag=7)
    try:
        with pytest.raises(TypeError, match="comm must be an intracommunicator"):
            mpijax.allreduce(x3, MPI.SUM, comm=inter)
    finally:
        inter.Free()
        local.Free()


@pytest.mark.parametrize("bad", [0, "world", MPI.COMM_WORLD.py2f()])
def test_comm_type(bad):
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        mpijax.allreduce(x3, MPI.SUM, comm=bad)


def test_comm_null():
    with pytest.raises(ValueError, match="COMM_NULL"):
        mpijax.barrier(comm=MPI.COMM_NULL)


def test_status_type(comm):
    with pytest.raises(TypeError, match="status must be an mpi4py.MPI.Status"):
        mpijax.recv(x3, 0, comm=comm, status=object())


@pytest.mark.parametrize("mode", MODES)
def test_mpi_failure_is_an_exception_and_the_process_carries_on(comm, mode):
    """Every rank sends 8 elements into a neighbour's 4-element buffer: MPI
    reports truncation, which surfaces naming the op, the rank, MPI's text
    and the messages."""
    f = MODES[mode](lambda s, r: mpijax.sendrecv(s, r, PREV, NEXT, comm=comm))
    match = (
        rf"(?s)mpijax\.sendrecv failed on rank {RANK} of {SIZE}: MPI_ERR_TRUNCATE.*"
        rf"\(receiving from rank {PREV} with tag ANY_TAG and sending to rank {NEXT} with tag 0\)\. "
        r"The message is longer than the array receiving it"
    )
    with pytest.raises(MPI_FAILURE, match=match):
        jax.block_until_ready(f(jnp.ones(8), jnp.zeros(4)))
    # The job lives on: later calls, eager and jitted, work.
    np.testing.assert_array_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm), [SIZE, SIZE])
    np.testing.assert_array_equal(f(jnp.ones(4), jnp.zeros(4)), np.ones(4))
