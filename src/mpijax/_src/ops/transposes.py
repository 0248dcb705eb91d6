"""The adjoint of every linear MPI operation (the table is in docs/autodiff.md).

A result that every rank holds identically (allreduce, allgather, bcast) has
an identical cotangent on every rank that counts once: its adjoint is local,
and the adjoint of that is the collective again. Every other op's adjoint is
its exact transpose. Each adjoint is a call on every rank (MPI calls must
match), made whether or not the cotangent is symbolically zero.
"""

import jax.numpy as jnp
from jax.interpreters import ad, batching

from .. import comm as _comm
from .. import jax_compat
from ..primitive import linear_jvp, local_primitive
from .collectives import allgather_p, alltoall_p, bcast_p, gather_p, scatter_p
from .point_to_point import derivative, recv_p, send_p, sendrecv_p
from .reductions import SUM, allreduce_p, exclusive_scan, reduce_p, scan_p


def _ct(cts):
    """The cotangent, instantiated, and batched under vmap (jacrev): it can be
    a symbolic zero here and batched on the rank it is exchanged with."""
    return jax_compat.batched_if_vmapped(ad.instantiate_zeros(cts[0] if isinstance(cts, list) else cts))


def _rank(comm):
    return _comm.info(comm).rank


# The local adjoints of replicated results.
allreduce_adjoint_p = local_primitive("allreduce_adjoint", lambda ct, *, comm: ct)
allgather_adjoint_p = local_primitive("allgather_adjoint", lambda ct, *, comm: ct[_rank(comm)])
# bcast: the root's x alone made the result, so only the root gets its cotangent.
bcast_adjoint_p = local_primitive(
    "bcast_adjoint", lambda ct, *, comm, root: ct if _rank(comm) == root else jnp.zeros_like(ct)
)

for _prim in (allreduce_adjoint_p, allgather_adjoint_p, bcast_adjoint_p):
    ad.primitive_jvps[_prim] = linear_jvp(_prim)
batching.defvectorized(allreduce_adjoint_p)
batching.defvectorized(bcast_adjoint_p)
batching.primitive_batchers[allgather_adjoint_p] = lambda args, dims, **p: (
    allgather_adjoint_p.bind(jnp.moveaxis(args[0], dims[0], 1), **p),
    0,
)


def _linear_only(op, name):
    if op != SUM:  # linearized programs only ever contain SUM reductions
        raise NotImplementedError(f"mpijax: {name} with a reduction other than MPI.SUM is not linear")


def _allreduce(cts, x, *, comm, op):
    _linear_only(op, "allreduce")
    return [allreduce_adjoint_p.bind(_ct(cts), comm=comm)]


def _reduce(cts, x, *, comm, op, root):
    _linear_only(op, "reduce")
    return bcast_p.bind(_ct(cts), comm=comm, root=root, accumulate=1)


def _bcast(cts, x, *, comm, root, accumulate):
    if accumulate:
        return reduce_p.bind(_ct(cts), comm=comm, op=SUM, root=root)
    return [bcast_adjoint_p.bind(_ct(cts), comm=comm, root=root)]


def _scan(cts, x, *, comm, op, reverse, exclusive):
    _linear_only(op, "scan")
    if exclusive:  # over the ranks after this one (before, if reverse)
        return [exclusive_scan(_ct(cts), comm, SUM, not reverse)]
    return scan_p.bind(_ct(cts), comm=comm, op=op, reverse=1 - reverse, exclusive=0)


# Cotangents travel back the way the values came, from the receiver to the
# sender (or the routed peer), under the derivative tag of the value's tag.
def _send(cts, x, route, *, comm, dest, tag):
    template = jax_compat.transposed_receive_buffer(x.aval)
    back, _ = recv_p.bind(template, route, **derivative(dict(comm=comm, source=dest, tag=tag, status=0)))
    return [back, None]


# A receive from anyone is transposed only after it ran, routed by its
# envelope (its JVP's tangent receive): this one never did.
def _recv(cts, x, route, *, comm, source, tag, status):
    recv_p.check_transposable(source=source, tag=tag)
    send_p.bind(_ct(cts), route, **derivative(dict(comm=comm, dest=source, tag=tag)))
    return [ad.Zero(x.aval), None]


def _sendrecv(cts, sendbuf, recvbuf, route, *, comm, source, dest, sendtag, recvtag, status, alias_recvbuf):
    sendrecv_p.check_transposable(source=source, recvtag=recvtag)
    back, _ = sendrecv_p.bind(
        _ct(cts),
        jax_compat.transposed_receive_buffer(sendbuf.aval),
        route,
        **derivative(dict(comm=comm, source=dest, dest=source, sendtag=recvtag, recvtag=sendtag, status=0)),
        alias_recvbuf=1,
    )
    return [back, ad.Zero(recvbuf.aval), None]


ad.primitive_transposes.update(
    {
        allreduce_p: _allreduce,
        allreduce_adjoint_p: lambda ct, x, *, comm: allreduce_p.bind(_ct(ct), comm=comm, op=SUM),
        allgather_p: lambda cts, x, *, comm: [allgather_adjoint_p.bind(_ct(cts), comm=comm)],
        allgather_adjoint_p: lambda ct, x, *, comm: allgather_p.bind(_ct(ct), comm=comm),
        bcast_p: _bcast,
        bcast_adjoint_p: lambda ct, x, *, comm, root: bcast_p.bind(_ct(ct), comm=comm, root=root, accumulate=0),
        reduce_p: _reduce,
        gather_p: lambda cts, x, *, comm, root, identity: scatter_p.bind(
            _ct(cts), comm=comm, root=root, accumulate=identity
        ),
        scatter_p: lambda cts, x, *, comm, root, accumulate: gather_p.bind(
            _ct(cts), comm=comm, root=root, identity=accumulate
        ),
        alltoall_p: lambda cts, x, *, comm: alltoall_p.bind(_ct(cts), comm=comm),
        scan_p: _scan,
        send_p: _send,
        recv_p: _recv,
        sendrecv_p: _sendrecv,
    }
)
