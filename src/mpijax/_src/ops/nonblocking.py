"""Nonblocking messages: isend, irecv and ineighbor_exchange start messages
and return a Request at once; wait completes requests. Computation placed
between the start and the wait can run while the messages move, and
`started` and wait's `after` keep XLA from scheduling it outside that window.

A Request is a pytree whose one leaf is its id, a float32 scalar written by
the start and read by the wait, under which the C++ core keeps the started
messages and their buffers (csrc/pending.h): sends are copied when they
start (XLA may reuse their buffers as soon as the start returns), receives
land in buffers of the core's own and are copied out by the wait. Id 0 is no
request.

Derivatives: the tangent of a request's id is the id of a second request,
started beside it, that moves the tangents of its floating-point messages
under derivative tags; waiting for the request waits for that one too. In
reverse, the transpose of a wait starts the reversed messages (each result's
cotangent back to its source) and the transpose of the start waits for them,
so the backward pass has the same window, and its ties (`started`, `after`)
keep the transposed work inside it.
"""

import atexit
import functools
import sys
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, jax_compat, validation
from ..primitive import batch_operands, cotangent, drain, mpi_primitive
from ..runtime import core
from .neighbors import _nbytes, _select, exchange_lists
from .point_to_point import _dest, _inexact, derivative_messages

ID = jax.core.ShapedArray((), np.float32)
# The id a batched wait gets where the batch's elements hold different
# requests (the handler names the cause).
MIXED = -1.0


class Route(NamedTuple):
    """Where a request's messages go: receive j from sources[j] under
    recvtags[j], shaped recvs[j]; send i to dests[i] under sendtags[i],
    shaped sends[i] (each a (shape, dtype) pair)."""

    sources: tuple = ()
    recvtags: tuple = ()
    dests: tuple = ()
    sendtags: tuple = ()
    sends: tuple = ()
    recvs: tuple = ()

    def reversed(self):
        """The messages that carry cotangents back: to each source, from each
        destination."""
        return Route(self.dests, self.sendtags, self.sources, self.recvtags, self.recvs, self.sends)

    def derivative(self):
        """The route of the messages that carry derivatives
        (derivative_messages), under derivative tags, and which sends and
        receives those are."""
        send_keep, recv_keep = derivative_messages([d for _, d in self.sends], [d for _, d in self.recvs])
        picked = _select({**self._asdict(), "comm": None}, send_keep, recv_keep)
        del picked["comm"]
        return Route(**picked, sends=tuple(self.sends[i] for i in send_keep)), send_keep, recv_keep

    def batched(self, size):
        grow = lambda specs: tuple(((size, *shape), dtype) for shape, dtype in specs)  # noqa: E731
        return self._replace(sends=grow(self.sends), recvs=grow(self.recvs))

    def moves(self):
        """Whether any message goes anywhere."""
        return bool(self.sources or self.dests)


def _spec(x):
    aval = x.aval if ad.is_undefined_primal(x) else jax.typeof(x)
    return tuple(aval.shape), np.dtype(aval.dtype)


@jax.tree_util.register_pytree_node_class
class Request:
    """Messages started by isend, irecv or ineighbor_exchange; mpijax.wait
    completes them and returns what they received."""

    def __init__(self, id, comm, route, kind):
        self.id = id
        self.comm = comm  # the communicator's id
        self.route = route
        self.kind = kind  # "isend", "irecv" or "ineighbor_exchange": what wait returns

    def tree_flatten(self):
        return (self.id,), (self.comm, self.route, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self):
        return f"mpijax.Request({self.kind}, {len(self.route.recvs)} receive(s))"


def _bind_start(sends, placeholders, comm, route, *, derivative=0, guard=None):
    """The start of `route`'s messages; `placeholders` holds an empty array per
    receive, an operand that vmap batches so that the receives grow with the
    batch. derivative=1 marks the id of a start made under differentiation;
    with a `guard` (the id of the request whose wait this start reverses),
    nothing starts unless the guard is marked so (see _wait_transpose)."""
    (id,) = start_p.bind(
        *sends,
        *placeholders,
        *([] if guard is None else [guard]),
        comm=comm,
        sources=route.sources,
        recvtags=route.recvtags,
        dests=route.dests,
        sendtags=route.sendtags,
        recvs=route.recvs,
        recv_bytes=tuple(_nbytes(s) for s in route.recvs),
        derivative=derivative,
        guarded=int(guard is not None),
    )
    return id


def _start(sends, specs, sources, recvtags, dests, sendtags, comm, kind, places=None):
    """`places`: a zero-size array per receive, batched as its results are
    to be (by default, constants: batched only beside batched sends)."""
    specs = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in specs)
    route = Route(tuple(sources), tuple(recvtags), tuple(dests), tuple(sendtags), tuple(map(_spec, sends)), specs)
    places = [jnp.zeros(0, dtype) for _, dtype in specs] if places is None else places
    id = _bind_start(sends, places, comm.id, route)
    return Request(id, comm.id, route, kind)


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
    # The place is cut from x, so that a receive into a batched buffer is
    # batched as recv's is, also in the primal of a JVP under vmap.
    return _start([], [(x.shape, x.dtype)], [source], [tag], [], [], comm, "irecv", places=[x.reshape(-1)[:0]])


def ineighbor_exchange(sends, sources, dests, *, recvs=None, tags=None, comm=None):
    """mpijax.neighbor_exchange, started: returns a Request, for which
    mpijax.wait returns the list of results."""
    comm = _comm.resolve(comm, "ineighbor_exchange")
    sends, sources, dests, tags, specs = exchange_lists(sends, sources, dests, recvs, tags, comm, "ineighbor_exchange")
    return _start(sends, specs, sources, tags, dests, tags, comm, "ineighbor_exchange")


def _requests(requests, op):
    single = isinstance(requests, Request)
    requests = list(requests) if isinstance(requests, Iterable) and not single else [requests]
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(
                f"mpijax.{op}: expected mpijax Requests (from isend, irecv or ineighbor_exchange), "
                f"got {type(r).__name__}"
            )
        if jnp.shape(r.id) != ():  # vmap returned it batched: one request, not one per entry
            raise ValueError(
                f"mpijax.{op}: this request was started under jax.vmap and left it; wait for it under the same vmap"
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
    if not requests:  # as wait([]): a rank without neighbours has nothing to tie x to
        return x
    leaves, tree = jax.tree.flatten(x)
    tied = tie_p.bind(*[r.id for r in requests], *leaves, requests=len(requests), comm=requests[0].comm)
    return jax.tree.unflatten(tree, tied)


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
    routes = tuple(r.route for r in requests)
    # `after` is passed to the wait as operands that it does not read, so XLA
    # computes it first.
    outs = _bind_wait([r.id for r in requests], jax.tree.leaves(after), requests[0].comm, routes)
    results = []
    for r in requests:
        mine, outs = outs[: len(r.route.recvs)], outs[len(r.route.recvs) :]
        results.append({"isend": None, "irecv": mine[0] if mine else None}.get(r.kind, list(mine)))
    return results[0] if single else results


def _bind_wait(ids, after, comm, routes, guards=(), batch=None):
    """The wait for requests `ids`; `guards`, one id per request or none, go
    unread to the wait's transpose (see _wait_transpose); `batch`: the size
    of the batch that vmap gave each request's results (see _batch_wait)."""
    return wait_p.bind(
        *ids,
        *guards,
        *after,
        comm=comm,
        requests=len(ids),
        guarded=int(bool(guards)),
        batch=batch or (1,) * len(ids),
        routes=tuple(routes),
        counts=tuple(len(r.recvs) for r in routes),
    )


def _route(params, operands):
    n = len(params["dests"])
    keys = ("sources", "recvtags", "dests", "sendtags", "recvs")
    return Route(**{k: params[k] for k in keys}, sends=tuple(_spec(x) for x in operands[:n]))


def _start_jvp(prim, primals, tangents, **params):
    """The tangents of the floating-point messages start beside them, and
    that request's id is the tangent of this one's. The id is marked as
    having derivative messages; a start that is guarded guards its tangents'
    start alike."""
    n = len(params["dests"])
    route, send_keep, recv_keep = _route(params, primals).derivative()
    if not route.moves():
        return prim.bind_primal(*primals, **params), [ad.Zero(ID)]
    (id,) = prim.bind_primal(*primals, **{**params, "derivative": 1})
    # The placeholders' tangents, not new constants: under linearize these are
    # unknown, so that the start of the tangents is staged with them.
    moved = [ad.instantiate_zeros(tangents[i]) for i in send_keep]
    places = [ad.instantiate_zeros(tangents[n + j]) for j in recv_keep]
    guard = primals[-1] if params["guarded"] else None
    return [id], [_bind_start(moved, places, params["comm"], route, guard=guard)]


def _start_transpose(cts, *operands, **params):
    """Wait for the reversed messages that the wait's transpose started
    (under the id that is this id's cotangent): each send's cotangent, from
    its destination."""
    route, send_keep, _ = _route(params, operands).derivative()
    results = [None] * len(operands)
    if route.moves():
        back = _bind_wait([cotangent(cts)], [], params["comm"], [route.reversed()])
        for i, ct in zip(send_keep, back, strict=True):
            results[i] = ct
    return results


def _wait_jvp(prim, primals, tangents, *, comm, requests, guarded, batch, routes, counts):
    """Wait for the requests that move the tangents too (those whose id has
    a tangent: started under this differentiation), after `after`'s
    tangents; each guarded by its request's id."""
    outs = prim.bind_primal(
        *primals, comm=comm, requests=requests, guarded=guarded, batch=batch, routes=routes, counts=counts
    )
    out_tangents = [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in outs]
    ids, guards, batches, moving, places = [], [], [], [], []
    for k, offset in enumerate(np.cumsum((0, *counts[:-1]))):
        route, _, recv_keep = routes[k].derivative()
        if type(tangents[k]) is not ad.Zero and route.moves():
            ids.append(tangents[k])
            guards.append(primals[k])
            batches.append(batch[k])
            moving.append(route)
            places += [int(offset) + j for j in recv_keep]
    if ids:
        after = [
            t for t in tangents[requests * (1 + guarded) :] if type(t) is not ad.Zero and _inexact(jax.typeof(t).dtype)
        ]
        for i, t in zip(places, _bind_wait(ids, after, comm, moving, guards, tuple(batches)), strict=True):
            out_tangents[i] = t
    return outs, out_tangents


def _wait_transpose(cts, *operands, comm, requests, guarded, batch, routes, counts):
    """Start the reversed messages, each result's cotangent back to its
    source; their id is the cotangent of the request's. Each start is
    guarded by the request's id: a loop that carries a request started
    outside the differentiation into iterations that start theirs inside
    waits for it with the same transposed wait, which must start nothing
    then (on its peers too), since nothing would wait for it. The cotangents
    of `after` are zeros that XLA cannot know for zeros until that start has
    run, so the transposed work comes after it."""
    results = [None] * len(operands)
    guards = operands[requests : 2 * requests] if guarded else [None] * requests
    for k, offset in enumerate(np.cumsum((0, *counts[:-1]))):
        route, _, recv_keep = routes[k].derivative()
        if ad.is_undefined_primal(operands[k]) and route.moves():
            back = route.reversed()
            places = [jax_compat.transposed_receive_buffer(jax.core.ShapedArray((0,), d)) for _, d in back.recvs]
            sent = [cotangent(cts[int(offset) + j]) for j in recv_keep]
            results[k] = _bind_start(sent, places, comm, back, guard=guards[k])
    started_ids = [id for id in results[:requests] if id is not None]
    for i in range(requests * (1 + guarded), len(operands)):
        aval = operands[i].aval if ad.is_undefined_primal(operands[i]) else None
        if started_ids and aval is not None and _inexact(aval.dtype):
            (results[i],) = zeros_after_p.bind(started_ids[0], shape=aval.shape, dtype=np.dtype(aval.dtype))
    return results


def _batch_start(prim, args, dims, *, recvs, **params):
    """One start of the whole batch, batch axis first in every message; its
    id, the same for every element, is batched so that the wait is too."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    recvs = tuple(((size, *shape), dtype) for shape, dtype in recvs)
    params["recv_bytes"] = tuple(_nbytes(s) for s in recvs)
    (id,) = prim.bind(*batch_operands(args, dims, [0] * len(args)), recvs=recvs, **params)
    return [jnp.broadcast_to(id, (size,))], [0]


def _batch_wait(prim, args, dims, *, routes, requests, guarded, batch, **params):
    """One wait for the batch: a batched id (or guard) is the same for every
    element (see _batch_start), and its results are batched; what it waits
    after stays as it is. A batched id may be one that vmap broadcast: a
    request started outside the vmap and carried into a loop whose later
    iterations start batched ones. Its messages are then one element's, and
    the handler gives them to every element of the batch (`batch`).
    Elements that hold different ids (a request carried through a while_loop
    whose elements stop at different steps, or through a cond on a batched
    predicate, keeps each element's own) wait for MIXED, which raises."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    batched = [d is not None for d in dims[:requests]]
    n = requests * (1 + guarded)
    ids = [a if d is None else _one_id(jnp.moveaxis(a, d, 0)) for a, d in zip(args[:n], dims[:n], strict=True)]
    routes = tuple(r.batched(size) if b else r for r, b in zip(routes, batched, strict=True))
    batch = tuple(m * size if b else m for m, b in zip(batch, batched, strict=True))
    outs = prim.bind(*ids, *args[n:], routes=routes, requests=requests, guarded=guarded, batch=batch, **params)
    return outs, [0 if b else None for r, b in zip(routes, batched, strict=True) for _ in r.recvs]


def _one_id(ids):
    return jnp.where(jnp.all(ids == ids[0]), ids[0], jnp.float32(MIXED))


start_p = mpi_primitive(
    "start",
    lambda *args, **p: [ID],
    jvp=_start_jvp,
    transpose=_start_transpose,
    batch=_batch_start,
    attributes=("comm", "sources", "recvtags", "dests", "sendtags", "recv_bytes", "derivative", "guarded"),
)
# Not aligned: an id has a tangent only where its start was differentiated
# (alike on every rank), and a wait for a request started elsewhere must not
# be transposed into messages that nothing waits for.
wait_p = mpi_primitive(
    "wait",
    lambda *operands, routes, **p: [jax.core.ShapedArray(shape, dtype) for r in routes for shape, dtype in r.recvs],
    jvp=_wait_jvp,
    transpose=_wait_transpose,
    batch=_batch_wait,
    attributes=("comm", "requests", "counts", "batch"),
    aligned=False,
)


def _tie(*args, requests, comm):
    ids, xs = args[:requests], args[requests:]
    posted = functools.reduce(jnp.logical_and, [jnp.all(id >= 0) for id in ids])  # always true
    return [jnp.where(posted, x, jnp.zeros_like(x)) for x in xs]


def _tie_jvp(primals, tangents, *, requests, comm):
    """The tangents are tied to the requests that move the tangents (the
    ids' tangents), where there are such."""
    outs = tie_p.bind(*primals, requests=requests, comm=comm)
    ids = [t for t in tangents[:requests] if type(t) is not ad.Zero]
    out_tangents = list(tangents[requests:])
    moving = [i for i, t in enumerate(out_tangents) if type(t) is not ad.Zero]
    if ids and moving:
        tied = tie_p.bind(*ids, *[out_tangents[i] for i in moving], requests=len(ids), comm=comm)
        for i, t in zip(moving, tied, strict=True):
            out_tangents[i] = t
    return outs, out_tangents


def _tie_transpose(cts, *args, requests, comm):
    """The cotangents pass; when the ids are the tangents' requests, a wait
    for no request after them (an MPI call, so ordered before the start's
    transpose, which waits for the reversed messages) keeps that wait after
    the work that computes them."""
    cts = [None if type(ct) is ad.Zero else ct for ct in cts]
    if any(ad.is_undefined_primal(id) for id in args[:requests]):
        computed = [ct for ct in cts if ct is not None and _inexact(ct.dtype)]
        _bind_wait([jnp.float32(0)], computed, comm, [Route()])
    return [None] * requests + [
        ct if ad.is_undefined_primal(x) else None for x, ct in zip(args[requests:], cts, strict=True)
    ]


def _zeros_after(id, *, shape, dtype):
    return [jnp.broadcast_to(jnp.minimum(jnp.min(id), 0).astype(dtype), shape)]  # ids are never negative


# zeros_after_p(id) -> zeros of `shape`, which XLA computes after the start of
# request `id`. A linear map of the id (to zero), so that it transposes.
zeros_after_p = jax_compat.Primitive("mpijax_zeros_after")
zeros_after_p.multiple_results = True
zeros_after_p.def_impl(_zeros_after)
zeros_after_p.def_abstract_eval(lambda id, *, shape, dtype: [jax.core.ShapedArray(shape, dtype)])
mlir.register_lowering(zeros_after_p, mlir.lower_fun(_zeros_after, multiple_results=True))
ad.deflinear2(zeros_after_p, lambda cts, id, **params: [None])
batching.primitive_batchers[zeros_after_p] = lambda args, dims, **p: (zeros_after_p.bind(*args, **p), [None])

# tie_p(*ids, *xs) -> xs, tied to the start of the requests `ids`.
tie_p = jax_compat.Primitive("mpijax_started")
tie_p.multiple_results = True
tie_p.def_impl(_tie)
tie_p.def_abstract_eval(lambda *avals, requests, comm: list(avals[requests:]))
mlir.register_lowering(tie_p, mlir.lower_fun(_tie, multiple_results=True))
ad.primitive_jvps[tie_p] = _tie_jvp
ad.primitive_transposes[tie_p] = _tie_transpose
batching.primitive_batchers[tie_p] = lambda args, dims, **params: (
    tie_p.bind(*args, **params),
    dims[params["requests"] :],
)


def _every_request_is_used(closed_jaxpr, num_devices):
    """A request dropped where it is started would never be waited for: its
    messages would stay pending, and a send might keep its receiver, or
    MPI_Finalize, waiting. Passing it to `started` alone drops it too (found
    by a tester)."""
    dropped = jax_compat.unused_results(
        closed_jaxpr, (start_p, start_p.primal), lambda e: e.params["requests"] if e.primitive is tie_p else 0
    )
    if dropped:
        raise ValueError(
            f"mpijax: {len(dropped)} request(s) started by isend, irecv or ineighbor_exchange in this function are "
            "never used: pass each Request to mpijax.wait (or return it, or carry it on) where it is started"
        )


jax_compat.program_checks.append(_every_request_is_used)


def _none_left_at_exit():
    """Requests that eager code dropped, or that a program dropped after
    carrying them through a loop, are not seen at trace time: say so when
    Python exits (atexit runs this before primitive.py's drain, so it
    drains first)."""
    drain()
    left = core.pending_requests()
    if left:
        print(
            f"mpijax: {left} request(s) started by isend, irecv or ineighbor_exchange were never waited for; "
            "their messages may be left unmatched (pass each Request to mpijax.wait)",
            file=sys.stderr,
        )


atexit.register(_none_left_at_exit)
