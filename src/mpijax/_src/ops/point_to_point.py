"""send, recv, sendrecv: messages between two ranks.

Every call takes a route operand last: the MPI_Status of an earlier receive,
from which a peer given as ROUTED (and its tag) is read at run time. Every
receive returns its own MPI_Status, its envelope, as data. So the derivatives
of a receive from MPI.ANY_SOURCE or with MPI.ANY_TAG answer whoever actually
sent, under the tag it used, and those of a message shorter than its receive
buffer answer with as many elements as it had.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, jax_compat, validation
from ..primitive import batch_operands, cotangent, mpi_primitive, refusal_p
from ..runtime import core

ROUTED = core.ROUTED
ENVELOPE = jax.core.ShapedArray((core.ENVELOPE_BYTES,), np.uint8)  # csrc/handlers.h


def _inexact(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


def derivative_messages(send_dtypes, recv_dtypes):
    """(send_keep, recv_keep): the messages whose derivatives travel, chosen
    alike at both ends of each. Where one call sends and receives message i
    under one tag (sendrecv, neighbor_exchange), an SPMD program's message i has these
    two dtypes at its two ends: kept where both are inexact (an integer sent
    into a float receive carries no derivative either way). Otherwise (isend,
    irecv) each inexact one."""
    if len(send_dtypes) == len(recv_dtypes):
        keep = [i for i, (s, r) in enumerate(zip(send_dtypes, recv_dtypes, strict=True)) if _inexact(s) and _inexact(r)]
        return keep, keep
    return [i for i, d in enumerate(send_dtypes) if _inexact(d)], [j for j, d in enumerate(recv_dtypes) if _inexact(d)]


def _receive_tag(params):
    """The name of a receive's tag parameter."""
    return "recvtag" if "recvtag" in params else "tag"


def receives_from_anyone(params):
    """Whether a receive's sender is known only once it has run."""
    return "source" in params and (params["source"] == MPI.ANY_SOURCE or params[_receive_tag(params)] == MPI.ANY_TAG)


def _unanswerable(name):
    return (
        f"mpijax.{name}: cannot transpose a receive from MPI.ANY_SOURCE or with MPI.ANY_TAG that has "
        "not run: the transpose answers the rank that sent, under the tag it used, which only the "
        "receive finds out. jax.grad, jax.vjp and jax.jacrev run it first; jax.linear_transpose does "
        "not, nor does JAX where it transposes code itself (a custom_jvp rule's tangent under jax.grad, "
        "lax.custom_linear_solve's matvec under jax.grad, as in jax.scipy's bicgstab and gmres). There, pass "
        "source and tag (recvtag= for sendrecv)"
    )


def check_transposable(name):
    """Raises while linear_transpose stages the call, on every rank alike,
    before any MPI call has run (jax_compat.stage_mpi_calls)."""

    def check(**params):
        if receives_from_anyone(params):
            raise NotImplementedError(_unanswerable(name))

    return check


def derivative(params):
    """A call's parameters for a message of its derivatives, which travels
    under a derivative tag (csrc/tags.h) so that no receive of values takes
    it. Routed tags become derivative tags in C++."""
    return {k: core.derivative_tag(v) if k in ("tag", "sendtag", "recvtag") else v for k, v in params.items()}


@functools.cache
def unrouted():
    """The route operand of a call whose peers are known at trace time, which
    names no message (csrc/handlers.h)."""
    with jax.ensure_compile_time_eval():
        return jnp.asarray(np.frombuffer(core.UNROUTED, ENVELOPE.dtype))


# Compiled programs write into these Status objects by address: keep them alive.
_statuses = {}


def _status_address(status, op):
    """Where a compiled program writes `status`. An eager call writes none:
    Python fills the status in from the call's envelope (_fill), so a fresh
    MPI.Status per call neither compiles the call anew nor stays referenced."""
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(f"mpijax.{op}: status must be an mpi4py.MPI.Status or None, got {type(status).__name__}")
    if jax_compat.is_eager():
        return 0
    address = MPI._addressof(status)
    _statuses[address] = status
    return address


def _fill(status, envelope):
    """After an eager call (which then waits for the receive to finish)."""
    if status is not None and not isinstance(envelope, jax.core.Tracer):
        ctypes.memmove(MPI._addressof(status), np.asarray(envelope).ctypes.data, core.STATUS_BYTES)


def _source(source, comm, op):
    return validation.rank(source, "source", comm, op, allow=(MPI.ANY_SOURCE, MPI.PROC_NULL))


def _dest(dest, comm, op):
    return validation.rank(dest, "dest", comm, op, allow=(MPI.PROC_NULL,))


def send(x, dest, *, tag=0, comm=None, token=validation.NOTSET):
    """Send `x` to rank `dest`."""
    validation.no_token(token, "send")
    comm = _comm.resolve(comm, "send")
    x = dtypes.array(x, "send")
    params = dict(comm=comm.id, dest=_dest(dest, comm, "send"), tag=validation.tag(tag, "tag", "send"), answers=0)
    send_p.bind(x, unrouted(), **params)


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=validation.NOTSET):
    """Receive an array shaped like `x` (whose values are not used) from
    `source`. Elements a shorter message does not fill are zero. `status`, an
    MPI.Status, is filled in when the call has run."""
    validation.no_token(token, "recv")
    comm = _comm.resolve(comm, "recv")
    x = dtypes.array(x, "recv")
    params = dict(
        comm=comm.id,
        source=_source(source, comm, "recv"),
        tag=validation.tag(tag, "tag", "recv", allow_any=True),
        status=_status_address(status, "recv"),
        parts=1,
    )
    y, envelope = recv_p.bind(x, unrouted(), **params)
    _fill(status, envelope)
    return y


def sendrecv(
    sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None, status=None, token=validation.NOTSET
):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf`
    from `source` in one deadlock-free step."""
    validation.no_token(token, "sendrecv")
    comm = _comm.resolve(comm, "sendrecv")
    alias_recvbuf = int(recvbuf is not sendbuf)
    sendbuf = dtypes.array(sendbuf, "sendrecv", "sendbuf")
    recvbuf = dtypes.array(recvbuf, "sendrecv", "recvbuf")
    params = dict(
        comm=comm.id,
        source=_source(source, comm, "sendrecv"),
        dest=_dest(dest, comm, "sendrecv"),
        sendtag=validation.tag(sendtag, "sendtag", "sendrecv"),
        recvtag=validation.tag(recvtag, "recvtag", "sendrecv", allow_any=True),
        status=_status_address(status, "sendrecv"),
        parts=1,
        answers=0,
        alias_recvbuf=alias_recvbuf,
    )
    y, envelope = sendrecv_p.bind(sendbuf, recvbuf, unrouted(), **params)
    _fill(status, envelope)
    return y


def _uses_route(params):
    """Whether a call reads its route: a peer given as ROUTED, or a
    transposed receive's answer (see _recv_transpose)."""
    return ROUTED in (params.get("source"), params.get("dest")) or params.get("answers", 0) > 0


def _jvp(prim, primals, tangents, **params):
    """Linear: the tangents travel the same way, in a derivative message.
    A receive's tangent takes the value's envelope as its route, which its
    transpose answers, and by which a receive from anyone takes its tangent
    from the sender of the value. The status describes the value's message
    only."""
    outs = prim.bind_primal(*primals, **params)
    route, tangent_params = primals[-1], derivative(params)
    if "status" in params:
        tangent_params["status"] = 0
        if not _uses_route(params):
            route = outs[-1]
    if receives_from_anyone(params):
        tangent_params.update({"source": ROUTED, _receive_tag(params): ROUTED})
    tangent_outs = prim.bind(*map(ad.instantiate_zeros, tangents[:-1]), route, **tangent_params)
    return outs, [*tangent_outs[:1], ad.Zero(ENVELOPE.to_tangent_aval())][: len(outs)]


def _sendrecv_jvp(prim, primals, tangents, **params):
    """_jvp, where the message carries a derivative (derivative_messages)."""
    sendbuf, recvbuf, _ = primals
    if derivative_messages([sendbuf.dtype], [recvbuf.dtype])[0]:
        return _jvp(prim, primals, tangents, **params)
    outs = prim.bind_primal(*primals, **params)
    return outs, [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in outs]


def _batch(prim, args, dims, **params):
    """One message carries the whole batch, batch axis first, in as many
    parts as a receive's buffer (a shorter message fills the front of each);
    its route is the status of one such message. So a batched route is the
    same in every element, one route that vmap broadcast (a cond whose
    predicate is batched runs both branches on batched operands, its
    constants included)."""
    *data, route = args
    if dims[-1] is not None:
        route = lax.index_in_dim(route, 0, dims[-1], keepdims=False)
    if all(d is None for d in dims[:-1]):
        outs = prim.bind(*data, route, **params)
        return outs, [None] * len(outs)
    size = next(x.shape[d] for x, d in zip(data, dims[:-1], strict=True) if d is not None)
    params = {**params, **{k: params[k] * size for k in ("parts", "answers") if k in params}}
    outs = prim.bind(*batch_operands(data, dims[:-1], [0] * len(data)), route, **params)
    return outs, [0, None][: len(outs)]


# Cotangents travel back the way the values came, from the receiver to the
# sender (or the routed peer), under the derivative tag of the value's tag.
# A transposed receive answers (answers=parts): it sends back as many
# elements as its message had, read from its route (the value's envelope, see
# _jvp), so a message shorter than its receive buffer gets a cotangent of its
# own size. Transposed again, the answer is such a short message (parts=answers).
def _send_transpose(cts, x, route, *, comm, dest, tag, answers):
    template = jax_compat.transposed_receive_buffer(x.aval)
    params = derivative(dict(comm=comm, source=dest, tag=tag, status=0, parts=max(answers, 1)))
    back, _ = recv_p.bind(template, route, **params)
    return [back, None]


# A receive from anyone is transposed after it ran, routed by its envelope
# (its JVP's tangent receive); one that never did is refused where the
# transpose is compiled or run.
def _recv_transpose(cts, x, route, *, comm, source, tag, status, parts):
    if receives_from_anyone(dict(source=source, tag=tag)):
        refusal_p.bind(cotangent(cts), message=_unanswerable("recv"), outputs=())
    else:
        send_p.bind(cotangent(cts), route, **derivative(dict(comm=comm, dest=source, tag=tag)), answers=parts)
    return [ad.Zero(x.aval), None]


def _sendrecv_transpose(
    cts, sendbuf, recvbuf, route, *, comm, source, dest, sendtag, recvtag, status, parts, answers, alias_recvbuf
):
    if receives_from_anyone(dict(source=source, recvtag=recvtag)):
        (back,) = refusal_p.bind(
            cotangent(cts), message=_unanswerable("sendrecv"), outputs=((sendbuf.aval.shape, sendbuf.aval.dtype),)
        )
        return [back, ad.Zero(recvbuf.aval), None]
    back, _ = sendrecv_p.bind(
        cotangent(cts),
        jax_compat.transposed_receive_buffer(sendbuf.aval),
        route,
        **derivative(dict(comm=comm, source=dest, dest=source, sendtag=recvtag, recvtag=sendtag, status=0)),
        parts=max(answers, 1),
        answers=0 if answers else parts,
        alias_recvbuf=1,
    )
    return [back, ad.Zero(recvbuf.aval), None]


# Receives write into their template's buffer (aliased): a loop carry then
# needs no copy. Not sendrecv(x, x) (alias_recvbuf=0): the call reads x while
# it writes its output, so XLA would copy x to alias it, and in a loop copy
# the result back into the carry as well. Unaliased, the result has a buffer
# of its own: no copy outside a loop, one inside (what any binding needs,
# since a buffer cannot be sent and received over in one step).
send_p = mpi_primitive("send", lambda x, route, **p: [], jvp=_jvp, transpose=_send_transpose, batch=_batch, routed=True)
recv_p = mpi_primitive(
    "recv",
    lambda x, route, **p: [x, ENVELOPE],
    lambda x, route, **p: {0: 0},
    jvp=_jvp,
    transpose=_recv_transpose,
    batch=_batch,
    routed=True,
    check_transposable=check_transposable("recv"),
)
sendrecv_p = mpi_primitive(
    "sendrecv",
    lambda sendbuf, recvbuf, route, **p: [recvbuf, ENVELOPE],
    lambda s, r, route, **p: {1: 0} if p["alias_recvbuf"] else None,
    jvp=_sendrecv_jvp,
    transpose=_sendrecv_transpose,
    batch=_batch,
    attributes=("comm", "source", "dest", "sendtag", "recvtag", "status", "parts", "answers"),
    routed=True,
    check_transposable=check_transposable("sendrecv"),
)
