"""mpi4jax's token API (before 0.8), on the same primitives as mpijax's.

Every op takes ``token=`` and returns ``(result, token)``; send and barrier
return a token. mpijax orders MPI calls by itself, so tokens are not needed
for order; a token passed in still becomes a data dependency of the call
(every later MPI call waits for what produced it), and the token returned
depends on the call. A token is a float32 scalar, like JPI's (JAX's own
tokens cannot be carried through lax loops and cond); a JAX token from
``jax.lax.create_token()`` is accepted too, and ignored: it holds no value
that a call could wait for.
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

# mpi4jax before 0.8 had experimental.auto_tokenize: token code moved with
# "from mpijax import tokens as mpi4jax" keeps calling it by that name.
from . import experimental  # noqa: F401
from ._src.ops import collectives, point_to_point, reductions
from ._src.primitive import current_token_p, join_p
from ._src.runtime import has_cuda_support, has_sycl_support  # next to the token ops before 0.8 too

__all__ = [
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "create_token", "gather",
    "gen_token", "has_cuda_support", "has_sycl_support", "recv", "reduce", "scan", "scatter", "send", "sendrecv",
]  # fmt: skip


def gen_token():
    """A new token: a float32 scalar, as JPI's gen_token makes."""
    return jnp.zeros((), jnp.float32)


create_token = gen_token


def _after(token, op):
    if token is None:
        return
    try:
        aval = jax.typeof(token)
    except TypeError:
        raise TypeError(
            f"mpijax.{op}: token must be a token (from create_token(), jax.lax.create_token() or an "
            f"earlier call), got {type(token).__name__}"
        ) from None
    # A JAX token as an operand broke every derivative of a jit, loop, cond or
    # checkpoint body that it was passed into (found by a tester; JAX's own
    # lowering of a differentiated checkpoint fails on one too).
    if isinstance(aval, jax.core.ShapedArray):
        join_p.bind(token)


def _token():
    return current_token_p.bind()[0]


def allgather(x, *, comm=None, token=None):
    _after(token, "tokens.allgather")
    return collectives.allgather(x, comm=comm), _token()


def allreduce(x, op, *, comm=None, token=None):
    _after(token, "tokens.allreduce")
    return reductions.allreduce(x, op, comm=comm), _token()


def alltoall(x, *, comm=None, token=None):
    _after(token, "tokens.alltoall")
    return collectives.alltoall(x, comm=comm), _token()


def barrier(*, comm=None, token=None):
    _after(token, "tokens.barrier")
    collectives.barrier(comm=comm)
    return _token()


def bcast(x, root, *, comm=None, token=None):
    _after(token, "tokens.bcast")
    return collectives.bcast(x, root, comm=comm), _token()


def gather(x, root, *, comm=None, token=None):
    _after(token, "tokens.gather")
    return collectives.gather(x, root, comm=comm), _token()


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=None):
    _after(token, "tokens.recv")
    return point_to_point.recv(x, source, tag=tag, comm=comm, status=status), _token()


def reduce(x, op, root, *, comm=None, token=None):
    _after(token, "tokens.reduce")
    return reductions.reduce(x, op, root, comm=comm), _token()


def scan(x, op, *, comm=None, token=None):
    _after(token, "tokens.scan")
    return reductions.scan(x, op, comm=comm), _token()


def scatter(x, root, *, comm=None, token=None):
    _after(token, "tokens.scatter")
    return collectives.scatter(x, root, comm=comm), _token()


def send(x, dest, *, tag=0, comm=None, token=None):
    _after(token, "tokens.send")
    point_to_point.send(x, dest, tag=tag, comm=comm)
    return _token()


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None, status=None, token=None):
    _after(token, "tokens.sendrecv")
    result = point_to_point.sendrecv(
        sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag, comm=comm, status=status
    )
    return result, _token()
