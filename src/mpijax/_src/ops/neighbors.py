"""neighbor_exchange: messages to and from any number of neighbours in one
call, one round of MPI (the halo exchanges of stencil, finite-element and
particle codes); and the helpers that build its lists from a Cartesian
communicator and fill an array's ghost cells with it."""

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, cotangent, mpi_primitive
from ..runtime import core
from .point_to_point import _inexact, derivative_messages


def _sequence(values, name, op, length=None, arrays=False):
    """A list of one entry per message. An array of ranks or tags passes
    (`arrays`), but not one of messages, which would pass as one message per
    element (sends=x for sends=[x]); nor a dict or set, whose keys would."""
    refused = (str, dict, set) + (() if arrays else (jax.Array, np.ndarray))
    if isinstance(values, refused) or isinstance(values, jax.core.Tracer) or not hasattr(values, "__len__"):
        raise TypeError(f"mpijax.{op}: {name} must be a list or tuple, got {type(values).__name__}")
    if length is not None and len(values) != length:
        raise ValueError(f"mpijax.{op}: {name} has {len(values)} entries; expected {length}, one per message")
    return list(values)


def _spec(template, op, name):
    """(shape, dtype) of a receive: from an array or a jax.ShapeDtypeStruct."""
    if not hasattr(template, "shape") or not hasattr(template, "dtype"):
        template = dtypes.array(template, op, name)
    dtype = np.dtype(template.dtype)
    dtypes.check_dtype(dtype, op, name)
    return tuple(int(n) for n in template.shape), dtype


def _nbytes(spec):
    shape, dtype = spec
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _check_self_messages(comm, sends, specs, sources, dests, tags, op):
    """Messages to oneself are matched here, at trace time: each needs its
    receive in the same call (no later call could take it), of its size."""
    receives = [j for j, s in enumerate(sources) if s == comm.rank]
    for i, d in enumerate(dests):
        if d != comm.rank:
            continue
        j = next((j for j in receives if tags[j] == tags[i]), None)
        if j is None:
            raise ValueError(
                f"mpijax.{op}: on rank {comm.rank}, message {i} goes to this rank itself with tag {tags[i]}, "
                "but no receive of this call takes it (a source equal to this rank with that tag)"
            )
        receives.remove(j)
        if _nbytes(sends[i]) != _nbytes(specs[j]):
            raise ValueError(
                f"mpijax.{op}: on rank {comm.rank}, message {i} to this rank itself has {_nbytes(sends[i])} bytes "
                f"but its receive (result {j}) has {_nbytes(specs[j])}; a message must fill its receive exactly"
            )


def exchange_lists(sends, sources, dests, recvs, tags, comm, op):
    """The arguments of a neighbor exchange, validated: sends as arrays;
    sources, dests and tags as tuples of ints; recvs as (shape, dtype)."""
    sends = [dtypes.array(x, op, f"sends[{i}]") for i, x in enumerate(_sequence(sends, "sends", op))]
    n = len(sends)
    sources = tuple(
        validation.rank(s, f"sources[{i}]", comm, op, allow=(MPI.PROC_NULL,))
        for i, s in enumerate(_sequence(sources, "sources", op, n, arrays=True))
    )
    dests = tuple(
        validation.rank(d, f"dests[{i}]", comm, op, allow=(MPI.PROC_NULL,))
        for i, d in enumerate(_sequence(dests, "dests", op, n, arrays=True))
    )
    tags = range(n) if tags is None else _sequence(tags, "tags", op, n, arrays=True)
    tags = tuple(validation.tag(t, f"tags[{i}]", op) for i, t in enumerate(tags))
    recvs = sends if recvs is None else _sequence(recvs, "recvs", op, n)
    specs = tuple(_spec(r, op, f"recvs[{i}]") for i, r in enumerate(recvs))
    _check_self_messages(comm, [_spec(x, op, "sends") for x in sends], specs, sources, dests, tags, op)
    return sends, sources, dests, tags, specs


def neighbor_exchange(sends, sources, dests, *, recvs=None, tags=None, comm=None):
    """Send sends[i] to rank dests[i] and receive result i from rank
    sources[i], both under tags[i] (default: i), all messages at once: one
    round of MPI (Isend/Irecv/Waitall) for any number of neighbours.

    recvs[i] gives the shape and dtype of result i, as an array (whose values
    are not used) or a jax.ShapeDtypeStruct; by default those of sends[i].
    Each message must fill its receive exactly. MPI.PROC_NULL as a source
    gives zeros, as a destination sends nothing (domain edges). A rank may be
    its own neighbour, and a neighbour may appear several times (distinct
    tags tell the messages apart). Returns the list of results.
    """
    comm = _comm.resolve(comm, "neighbor_exchange")
    sends, sources, dests, tags, specs = exchange_lists(sends, sources, dests, recvs, tags, comm, "neighbor_exchange")
    if not sends:
        return []
    return exchange_p.bind(
        *sends,
        comm=comm.id,
        sources=sources,
        recvtags=tags,
        dests=dests,
        sendtags=tags,
        recvs=specs,
    )


def _select(params, send_keep, recv_keep):
    """The messages of `params` kept (for derivatives: derivative_messages),
    under derivative tags (csrc/tags.h)."""
    pick = lambda values, keep: tuple(values[i] for i in keep)  # noqa: E731
    derivative = lambda tags: tuple(core.derivative_tag(t) for t in tags)  # noqa: E731
    return dict(
        comm=params["comm"],
        sources=pick(params["sources"], recv_keep),
        recvtags=derivative(pick(params["recvtags"], recv_keep)),
        dests=pick(params["dests"], send_keep),
        sendtags=derivative(pick(params["sendtags"], send_keep)),
        recvs=pick(params["recvs"], recv_keep),
    )


def _jvp(prim, primals, tangents, **params):
    """Linear: the tangents of the floating-point messages travel the same
    way in a second exchange."""
    outs = prim.bind_primal(*primals, **params)
    send_keep, recv_keep = derivative_messages([x.dtype for x in primals], [d for _, d in params["recvs"]])
    moved = prim.bind(*[ad.instantiate_zeros(tangents[i]) for i in send_keep], **_select(params, send_keep, recv_keep))
    out_tangents = [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in outs]
    for j, t in zip(recv_keep, moved, strict=True):
        out_tangents[j] = t
    return outs, out_tangents


def _transpose(cts, *sends, **params):
    """The exchange with sources and destinations swapped: each result's
    cotangent goes back to its source, and each send's arrives from its
    destination."""
    send_avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in sends]
    send_keep, recv_keep = derivative_messages([a.dtype for a in send_avals], [d for _, d in params["recvs"]])
    forward = _select(params, send_keep, recv_keep)
    back = exchange_p.bind(
        *[cotangent(cts[j]) for j in recv_keep],
        comm=params["comm"],
        sources=forward["dests"],
        recvtags=forward["sendtags"],
        dests=forward["sources"],
        sendtags=forward["recvtags"],
        recvs=tuple((send_avals[i].shape, np.dtype(send_avals[i].dtype)) for i in send_keep),
    )
    results = [None] * len(sends)
    for i, ct in zip(send_keep, back, strict=True):
        results[i] = ct
    return results


def _batch(prim, args, dims, *, recvs, **params):
    """One exchange of the whole batch, batch axis first in every message."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    outs = prim.bind(
        *batch_operands(args, dims, [0] * len(args)),
        recvs=tuple(((size, *shape), dtype) for shape, dtype in recvs),
        **params,
    )
    return outs, [0] * len(outs)


exchange_p = mpi_primitive(
    "neighbor_exchange",
    lambda *sends, recvs, **p: [jax.core.ShapedArray(shape, dtype) for shape, dtype in recvs],
    jvp=_jvp,
    transpose=_transpose,
    batch=_batch,
    attributes=("comm", "sources", "recvtags", "dests", "sendtags"),
)


class Neighbors(NamedTuple):
    """The messages of a halo exchange on a Cartesian communicator: message i
    goes in direction offsets[i] (one -1, 0 or 1 per dimension) to dests[i],
    and comes from the opposite side, sources[i]; MPI.PROC_NULL beyond a
    non-periodic edge."""

    offsets: tuple
    sources: tuple
    dests: tuple


def _cartesian(comm, op):
    if not isinstance(comm, MPI.Cartcomm):
        raise TypeError(
            f"mpijax.{op}: comm must be a Cartesian communicator (mpi4py.MPI.Cartcomm, from "
            f"comm.Create_cart(dims, periods)), got {type(comm).__name__}"
        )


def cart_neighbors(comm, *, corners=True):
    """The neighbours of this rank on `comm`, an mpi4py Cartcomm (from
    Create_cart): the 2 * ndim faces, and with `corners` the edges and
    corners too (3**ndim - 1 in all), in a fixed order that is the same on
    every rank, so that message i is tagged alike on both of its ends."""
    _cartesian(comm, "cart_neighbors")
    corners = validation.static_bool(corners, "corners", "cart_neighbors")
    dims, periods, coords = comm.Get_topo()

    def rank_at(offset):
        at = []
        for c, d, n, periodic in zip(coords, offset, dims, periods, strict=True):
            if not periodic and not 0 <= c + d < n:
                return MPI.PROC_NULL
            at.append((c + d) % n)
        return comm.Get_cart_rank(at)

    offsets = tuple(
        d for d in itertools.product((-1, 0, 1), repeat=len(dims)) if any(d) and (corners or sum(map(abs, d)) == 1)
    )
    return Neighbors(offsets, tuple(rank_at(tuple(-c for c in d)) for d in offsets), tuple(map(rank_at, offsets)))


def halo_exchange(x, comm, *, width=1, corners=True):
    """Fill the ghost cells of `x` from the neighbouring ranks on the
    Cartesian communicator `comm`.

    The first comm.ndim axes of `x` are the decomposed ones; along each, `x`
    holds `width` ghost cells on both sides of this rank's interior. Without
    `corners`, the faces move in one round of messages. With `corners` (9-
    and 27-point stencils need the diagonal neighbours' cells), the faces move
    one axis after the other, each carrying the ghost cells the axes before
    it filled, so the edges and corners arrive too: 2 messages per axis
    instead of 3**ndim - 1 at once. Ghost cells beyond a non-periodic edge keep
    their values (boundary conditions). `x` may be a pytree of such arrays
    (the fields of a model): they move together, in one call. On the CPU the
    call works in place: it packs the strips straight from the arrays and
    unpacks the ghost cells into them, and copies without MPI the ghost cells
    a rank fills from itself (alone along a periodic axis)."""
    op = "halo_exchange"
    fields, structure = jax.tree.flatten(x)
    fields = [dtypes.array(field, op) for field in fields]
    _cartesian(comm, op)
    corners = validation.static_bool(corners, "corners", op)
    width = validation.static_int(width, "width", op)
    if width < 1:
        raise ValueError(f"mpijax.{op}: width must be at least 1 (ghost cells per side), got {width}")
    faces = cart_neighbors(comm, corners=False)
    ndim = comm.Get_dim()
    for field in fields:
        if field.ndim < ndim or any(n < 3 * width for n in field.shape[:ndim]):
            raise ValueError(
                f"mpijax.{op}: x must have at least 3 * width = {3 * width} cells (ghosts included) along each of "
                f"its first {ndim} axes, the decomposed ones; got shape {field.shape} and width {width}"
            )
    plan = _plan(comm, faces, [f.shape[:ndim] for f in fields], width, corners)
    if not plan["field"]:
        return structure.unflatten(fields)
    return structure.unflatten(halo_p.bind(*fields, comm=_comm.resolve(comm, op).id, axes=ndim, **plan))


def _plan(comm, faces, shapes, width, corners):
    """halo_p's messages: each field's strip in each face direction, in one
    round, or with `corners` in one round per axis, whose strips reach into
    the ghost cells of the axes before (not beyond a wall: those stay)."""
    dims, periods, coords = comm.Get_topo()
    ndim = len(dims)
    axis_of = [next(a for a, d in enumerate(offset) if d) for offset in faces.offsets]
    plan = {key: [] for key in ("field", "rounds", "sources", "dests", "tags", "send_starts", "recv_starts", "extents")}
    for r in range(ndim) if corners else [None]:
        for k, shape in enumerate(shapes):
            for i, offset in enumerate(faces.offsets):
                if r is not None and axis_of[i] != r or faces.sources[i] == faces.dests[i] == MPI.PROC_NULL:
                    continue
                for a, (d, n, periodic, c, o) in enumerate(zip(dims, shape, periods, coords, offset, strict=True)):
                    if o:  # the interior cells next to that side go; the ghosts on the other side fill
                        send, recv, extent = (n - 2 * width if o > 0 else width), (0 if o > 0 else n - width), width
                    elif r is not None and a < r:
                        send = recv = 0 if periodic or c > 0 else width
                        extent = (n if periodic or c < d - 1 else n - width) - send
                    else:
                        send, recv, extent = width, width, n - 2 * width
                    plan["send_starts"].append(send)
                    plan["recv_starts"].append(recv)
                    plan["extents"].append(extent)
                plan["field"].append(k)
                plan["rounds"].append(r or 0)
                plan["sources"].append(faces.sources[i])
                plan["dests"].append(faces.dests[i])
                plan["tags"].append(k * len(faces.offsets) + i)
    return {key: tuple(values) for key, values in plan.items()}


def _box(p, i, starts):
    k = p["axes"]
    at = slice(i * k, (i + 1) * k)
    return tuple(slice(s, s + e) for s, e in zip(p[starts][at], p["extents"][at], strict=True))


def _rounds(p):
    """The messages of each round, in order."""
    return [list(g) for _, g in itertools.groupby(range(len(p["field"])), key=lambda i: p["rounds"][i])]


def _exchange_boxes(xs, p, msgs, take, backwards):
    """One round of messages by neighbor_exchange: box `take` of each field
    goes out (to the source, backwards), and what arrives has its shape;
    returns what each message received (None from nowhere)."""
    sources, dests = (p["dests"], p["sources"]) if backwards else (p["sources"], p["dests"])
    sends, recvs = [], []
    for i in msgs:
        x = xs[p["field"][i]]
        part = x[_box(p, i, take)]
        sends.append(part if dests[i] != MPI.PROC_NULL else jnp.zeros(0, x.dtype))
        recvs.append((part.shape if sources[i] != MPI.PROC_NULL else (0,), np.dtype(x.dtype)))
    got = exchange_p.bind(
        *sends,
        comm=p["comm"],
        sources=tuple(sources[i] for i in msgs),
        recvtags=tuple(p["tags"][i] for i in msgs),
        dests=tuple(dests[i] for i in msgs),
        sendtags=tuple(p["tags"][i] for i in msgs),
        recvs=tuple(recvs),
    )
    return [g if sources[i] != MPI.PROC_NULL else None for i, g in zip(msgs, got, strict=True)]


def _by_slices(*xs, **p):
    """halo_p as XLA slices of the fields and a neighbor_exchange of the
    strips per round: its lowering on GPUs, where only the strips, not the
    fields, should cross to the host (staged mode)."""
    xs = list(xs)
    for msgs in _rounds(p):
        for i, got in zip(msgs, _exchange_boxes(xs, p, msgs, "send_starts", False), strict=True):
            if got is not None:
                xs[p["field"][i]] = xs[p["field"][i]].at[_box(p, i, "recv_starts")].set(got)
    return xs


def _restricted(p, keep):
    """p for the fields in `keep` alone (renumbered), under derivative tags."""
    msgs = [i for i, f in enumerate(p["field"]) if f in keep]
    k = p["axes"]
    out = {key: tuple(p[key][i] for i in msgs) for key in ("rounds", "sources", "dests")}
    out["field"] = tuple(keep.index(p["field"][i]) for i in msgs)
    out["tags"] = tuple(core.derivative_tag(p["tags"][i]) for i in msgs)
    for key in ("send_starts", "recv_starts", "extents"):
        out[key] = tuple(v for i in msgs for v in p[key][i * k : (i + 1) * k])
    return dict(p, **out)


def _halo_jvp(prim, primals, tangents, **p):
    """Linear: the floating-point fields' tangents move the same way."""
    outs = prim.bind_primal(*primals, **p)
    keep = [f for f, x in enumerate(primals) if _inexact(x.dtype)]
    out_tangents = [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in outs]
    if keep:
        moved = prim.bind(*[ad.instantiate_zeros(tangents[f]) for f in keep], **_restricted(p, keep))
        for f, t in zip(keep, moved, strict=True):
            out_tangents[f] = t
    return outs, out_tangents


def _halo_transpose(cts, *xs, **p):
    """The rounds backwards, each reversed: the ghost cells' cotangents go
    back to where they came from and add to the strips sent there; the
    ghost cells a message filled get none of their own."""
    avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in xs]
    keep = [f for f, a in enumerate(avals) if _inexact(a.dtype)]
    p = _restricted(p, keep)
    ct = [jnp.asarray(cotangent(cts[f])) for f in keep]
    for msgs in reversed(_rounds(p)):
        got = _exchange_boxes(ct, p, msgs, "recv_starts", True)
        for i in msgs:
            if p["sources"][i] != MPI.PROC_NULL:
                ct[p["field"][i]] = ct[p["field"][i]].at[_box(p, i, "recv_starts")].set(0)
        for i, g in zip(msgs, got, strict=True):
            if g is not None:
                ct[p["field"][i]] = ct[p["field"][i]].at[_box(p, i, "send_starts")].add(g)
    results = [None] * len(xs)
    for f, c in zip(keep, ct, strict=True):
        results[f] = c
    return results


def _halo_batch(prim, args, dims, **p):
    """The batch axis last in every field: the boxes take it whole."""
    xs = batch_operands(args, dims, [-1] * len(args))
    outs = prim.bind(*xs, **p)
    return outs, [y.ndim - 1 for y in outs]


halo_p = mpi_primitive(
    "halo_exchange",
    lambda *xs, **p: list(xs),
    lambda *xs, **p: {f: f for f in range(len(xs))},
    jvp=_halo_jvp,
    transpose=_halo_transpose,
    batch=_halo_batch,
)
mlir.register_lowering(halo_p, mlir.lower_fun(_by_slices, multiple_results=True), platform="cuda")
