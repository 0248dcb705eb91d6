"""Nonblocking messages: isend, irecv and ineighbor_exchange start messages
and return a Request at once; wait completes requests. Computation placed
between the start and the wait can run while the messages move, and
`started` and wait's `after` keep XLA from scheduling it outside that window.

A Request is a pytree whose one leaf is an int32 id, written by the start
and read by the wait, under which the C++ core keeps the started messages
and their buffers (csrc/pending.h): sends are copied when they start (XLA may
reuse their buffers as soon as the start returns), receives land in buffers
of the core's own and are copied out by the wait.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, jax_compat, validation
from ..primitive import batch_operands, drain, mpi_primitive
from .neighbors import _nbytes, exchange_lists
from .point_to_point import _dest

ID = jax.core.ShapedArray((), np.int32)


@jax.tree_util.register_pytree_node_class
class Request:
    """Messages started by isend, irecv or ineighbor_exchange; mpijax.wait
    completes them and returns what they received."""

    def __init__(self, id, comm, recvs, kind):
        self.id = id
        self.comm = comm  # the communicator's id
        self.recvs = recvs  # (shape, dtype) of each receive
        self.kind = kind  # "isend", "irecv" or "ineighbor_exchange": what wait returns

    def tree_flatten(self):
        return (self.id,), (self.comm, self.recvs, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self):
        return f"mpijax.Request({self.kind}, {len(self.recvs)} receive(s))"


def _start(sends, specs, sources, recvtags, dests, sendtags, comm, kind):
    # An empty array per receive: an operand that vmap batches, so that the
    # receives grow with the batch (their shapes are `recvs`).
    specs = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in specs)
    placeholders = [jnp.zeros(0, dtype) for _, dtype in specs]
    (id,) = start_p.bind(
        *sends,
        *placeholders,
        comm=comm.id,
        sources=tuple(sources),
        recvtags=tuple(recvtags),
        dests=tuple(dests),
        sendtags=tuple(sendtags),
        recvs=specs,
        recv_bytes=tuple(_nbytes(s) for s in specs),
    )
    return Request(id, comm.id, specs, kind)


def isend(x, dest, *, tag=0, comm=None):
    """Start sending `x` to rank `dest`; returns a Request for mpijax.wait
    (which returns None for it)."""
    comm = _comm.resolve(comm, "isend")
    x = dtypes.array(x, "isend")
    tag = validation.tag(tag, "tag", "isend")
    return _start([x], [], [], [], [_dest(dest, comm, "isend")], [tag], comm, "isend")


def irecv(x, source, *, tag=0, comm=None):
    """Start receiving an array shaped like `x` (whose values are not used)
    from rank `source` (not MPI.ANY_SOURCE) under `tag` (not MPI.ANY_TAG);
    returns a Request, for which mpijax.wait returns the array. The message
    must fill it exactly."""
    comm = _comm.resolve(comm, "irecv")
    x = dtypes.array(x, "irecv")
    source = validation.rank(source, "source", comm, "irecv", allow=(MPI.PROC_NULL,))
    tag = validation.tag(tag, "tag", "irecv")
    return _start([], [(x.shape, x.dtype)], [source], [tag], [], [], comm, "irecv")


def ineighbor_exchange(sends, sources, dests, *, recvs=None, tags=None, comm=None):
    """mpijax.neighbor_exchange, started: returns a Request, for which
    mpijax.wait returns the list of results."""
    comm = _comm.resolve(comm, "ineighbor_exchange")
    sends, sources, dests, tags, specs = exchange_lists(sends, sources, dests, recvs, tags, comm, "ineighbor_exchange")
    return _start(sends, specs, sources, tags, dests, tags, comm, "ineighbor_exchange")


def _requests(requests, op):
    single = isinstance(requests, Request)
    requests = [requests] if single else list(requests)
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(
                f"mpijax.{op}: expected mpijax Requests (from isend, irecv or ineighbor_exchange), "
                f"got {type(r).__name__}"
            )
    return single, requests


def started(requests, x):
    """`x` (any pytree), available only once `requests` have started, so
    that work on it is not scheduled before the messages are posted. XLA
    drops optimization barriers before it schedules, so the tie is data:
    each array is selected by a condition on the requests' ids that XLA
    cannot evaluate, which costs one elementwise pass over it where XLA does
    not fuse that into the work that reads it."""
    _, requests = _requests(requests, "started")
    posted = functools.reduce(jnp.logical_and, [r.id != 0 for r in requests])
    return jax.tree.map(lambda a: jnp.where(posted, a, jnp.zeros_like(a)), x)


def wait(requests=None, *, after=None):
    """Complete `requests` (a Request or a list of them) and return what they
    received: None for an isend, the array for an irecv, the list of results
    for an ineighbor_exchange (a list of those for a list). With `after` (any
    pytree), the wait is not scheduled before `after` is computed: work
    placed there runs while the messages move.

    With no requests: block until every MPI call dispatched so far, from any
    thread, has run (jax.effects_barrier() does the same)."""
    if requests is None:
        if after is not None:
            raise TypeError("mpijax.wait: after= needs requests to wait for")
        drain()
        return None
    single, requests = _requests(requests, "wait")
    if not requests:
        return []
    ids = [r.id for r in requests]
    # `after` is passed to the wait as operands that it does not read, so XLA
    # computes it first.
    outs = wait_p.bind(
        *ids,
        *jax.tree.leaves(after),
        comm=requests[0].comm,
        requests=len(ids),
        recvs=tuple(s for r in requests for s in r.recvs),
    )
    results = []
    for r in requests:
        mine, outs = outs[: len(r.recvs)], outs[len(r.recvs) :]
        results.append({"isend": None, "irecv": mine[0] if mine else None}.get(r.kind, list(mine)))
    return results[0] if single else results


def _not_differentiable(prim, primals, tangents, **params):
    raise NotImplementedError(
        "mpijax.isend, irecv, ineighbor_exchange and wait are not differentiable yet: use "
        "mpijax.neighbor_exchange (or send/recv/sendrecv), whose derivatives are defined"
    )


def _batch_start(prim, args, dims, *, recvs, **params):
    """One start of the whole batch, batch axis first in every message; its
    id, the same for every element, is batched so that the wait is too."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    recvs = tuple(((size, *shape), dtype) for shape, dtype in recvs)
    params["recv_bytes"] = tuple(_nbytes(s) for s in recvs)
    (id,) = prim.bind(*batch_operands(args, dims, [0] * len(args)), recvs=recvs, **params)
    return [jnp.broadcast_to(id, (size,))], [0]


def _batch_wait(prim, args, dims, *, recvs, requests, **params):
    """One wait for the batch: the ids are the same for every element (see
    _batch_start); what it waits after stays as it is."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    ids = [
        a if d is None else lax.index_in_dim(a, 0, d, keepdims=False)
        for a, d in zip(args[:requests], dims[:requests], strict=True)
    ]
    recvs = tuple(((size, *shape), dtype) for shape, dtype in recvs)
    outs = prim.bind(*ids, *args[requests:], recvs=recvs, requests=requests, **params)
    return outs, [0] * len(outs)


start_p = mpi_primitive(
    "start",
    lambda *args, **p: [ID],
    jvp=_not_differentiable,
    batch=_batch_start,
    attributes=("comm", "sources", "recvtags", "dests", "sendtags", "recv_bytes"),
)
wait_p = mpi_primitive(
    "wait",
    lambda *operands, recvs, **p: [jax.core.ShapedArray(shape, dtype) for shape, dtype in recvs],
    jvp=_not_differentiable,
    batch=_batch_wait,
    attributes=("comm", "requests"),
)


def _every_request_is_used(closed_jaxpr):
    """A request dropped where it is started would never be waited for: its
    messages would stay pending, and a send might keep its receiver, or
    MPI_Finalize, waiting."""
    dropped = jax_compat.unused_results(closed_jaxpr, start_p)
    if dropped:
        raise ValueError(
            f"mpijax: {len(dropped)} request(s) started by isend, irecv or ineighbor_exchange in this function are "
            "never used: pass each Request to mpijax.wait (or return it, or carry it on) where it is started"
        )


jax_compat.program_checks.append(_every_request_is_used)
