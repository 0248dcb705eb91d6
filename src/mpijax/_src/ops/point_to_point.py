"""send, recv, sendrecv: messages between two ranks."""

from jax.interpreters import ad, batching
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, mpi_primitive

# Receives write into their template's buffer (aliased): a loop carry then
# needs no copy.
send_p = mpi_primitive("send", lambda x, **p: [])
recv_p = mpi_primitive("recv", lambda x, **p: [x], lambda x, **p: {0: 0})
sendrecv_p = mpi_primitive("sendrecv", lambda sendbuf, recvbuf, **p: [recvbuf], lambda s, r, **p: {1: 0})

# Compiled programs write into these Status objects by address: keep them alive.
_statuses = {}


def _status_address(status, op):
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(f"mpijax.{op}: status must be an mpi4py.MPI.Status or None, got {type(status).__name__}")
    address = MPI._addressof(status)
    _statuses[address] = status
    return address


def _source(source, comm, op):
    return validation.rank(source, "source", comm, op, allow=(MPI.ANY_SOURCE, MPI.PROC_NULL))


def _dest(dest, comm, op):
    return validation.rank(dest, "dest", comm, op, allow=(MPI.PROC_NULL,))


def send(x, dest, *, tag=0, comm=None, token=validation.NOTSET):
    """Send `x` to rank `dest`."""
    validation.no_token(token, "send")
    comm = _comm.resolve(comm, "send")
    x = dtypes.array(x, "send")
    send_p.bind(x, comm=comm.id, dest=_dest(dest, comm, "send"), tag=validation.tag(tag, "tag", "send"))


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
    )
    return recv_p.bind(x, **params)[0]


def sendrecv(
    sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None, status=None, token=validation.NOTSET
):
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf`
    from `source` in one deadlock-free step."""
    validation.no_token(token, "sendrecv")
    comm = _comm.resolve(comm, "sendrecv")
    sendbuf = dtypes.array(sendbuf, "sendrecv", "sendbuf")
    recvbuf = dtypes.array(recvbuf, "sendrecv", "recvbuf")
    params = dict(
        comm=comm.id,
        source=_source(source, comm, "sendrecv"),
        dest=_dest(dest, comm, "sendrecv"),
        sendtag=validation.tag(sendtag, "sendtag", "sendrecv"),
        recvtag=validation.tag(recvtag, "recvtag", "sendrecv", allow_any=True),
        status=_status_address(status, "sendrecv"),
    )
    return sendrecv_p.bind(sendbuf, recvbuf, **params)[0]


def _jvp(prim):
    """Linear: the tangents travel the same way, in a second message that the
    status does not describe."""

    def jvp(primals, tangents, **params):
        if params.get("source") == MPI.ANY_SOURCE:
            raise NotImplementedError(
                f"mpijax.{prim.name[len('mpijax_') :]}: cannot differentiate a receive from "
                "MPI.ANY_SOURCE (the tangent must come from the same rank as the value); "
                "pass the source rank"
            )
        tangent_params = {**params, "status": 0} if "status" in params else params
        return prim.bind(*primals, **params), prim.bind(*map(ad.instantiate_zeros, tangents), **tangent_params)

    return jvp


def _batcher(prim):
    """One message carries the whole batch, batch axis first."""

    def rule(args, dims, **params):
        outs = prim.bind(*batch_operands(args, dims, [0] * len(args)), **params)
        return outs, [0] * len(outs)

    return rule


for _prim in (send_p, recv_p, sendrecv_p):
    ad.primitive_jvps[_prim] = _jvp(_prim)
    batching.primitive_batchers[_prim] = _batcher(_prim)
