"""neighbor_exchange: messages to and from any number of neighbours in one
call, one round of MPI (the halo exchanges of stencil, finite-element and
particle codes); and the helpers that build its lists from a Cartesian
communicator and fill an array's ghost cells with it."""

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from mpi4py import MPI

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, cotangent, mpi_primitive
from ..runtime import core


def _sequence(values, name, op, length=None):
    if isinstance(values, jax.core.Tracer) or isinstance(values, str) or not hasattr(values, "__len__"):
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
        for i, s in enumerate(_sequence(sources, "sources", op, n))
    )
    dests = tuple(
        validation.rank(d, f"dests[{i}]", comm, op, allow=(MPI.PROC_NULL,))
        for i, d in enumerate(_sequence(dests, "dests", op, n))
    )
    tags = range(n) if tags is None else _sequence(tags, "tags", op, n)
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


def _inexact(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


def _select(params, send_keep, recv_keep):
    """The messages of `params` kept (for derivatives: the inexact ones,
    kept alike on both ends since a message's dtype is the same there), under
    derivative tags (csrc/tags.h)."""
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
    send_keep = [i for i, x in enumerate(primals) if _inexact(x.dtype)]
    recv_keep = [j for j, (_, dtype) in enumerate(params["recvs"]) if _inexact(dtype)]
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
    send_keep = [i for i, a in enumerate(send_avals) if _inexact(a.dtype)]
    recv_keep = [j for j, (_, dtype) in enumerate(params["recvs"]) if _inexact(dtype)]
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


def cart_neighbors(comm, *, corners=True):
    """The neighbours of this rank on `comm`, an mpi4py Cartcomm (from
    Create_cart): the 2 * ndim faces, and with `corners` the edges and
    corners too (3**ndim - 1 in all), in a fixed order that is the same on
    every rank, so that message i is tagged alike on both of its ends."""
    if not isinstance(comm, MPI.Cartcomm):
        raise TypeError(
            "mpijax.cart_neighbors: comm must be a Cartesian communicator (mpi4py.MPI.Cartcomm, from "
            f"comm.Create_cart(dims, periods)), got {type(comm).__name__}"
        )
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
    `corners`, the faces move in one neighbor_exchange. With `corners` (9-
    and 27-point stencils need the diagonal neighbours' cells), the faces move
    one axis after the other, each carrying the ghost cells the axes before
    it filled, so the edges and corners arrive too: 2 messages per axis
    instead of 3**ndim - 1 at once. Ghost cells beyond a non-periodic edge keep
    their values (boundary conditions). `x` may be a pytree of such arrays
    (the fields of a model): they move together, in the same calls. Ghost
    cells a rank fills from itself (alone along a periodic axis) are copied
    without MPI."""
    op = "halo_exchange"
    faces = cart_neighbors(comm, corners=False)
    fields, structure = jax.tree.flatten(x)
    fields = [dtypes.array(field, op) for field in fields]
    width = validation.static_int(width, "width", op)
    dims, periods, coords = comm.Get_topo()
    ndim = len(dims)
    for field in fields:
        if width < 1 or field.ndim < ndim or any(n < 3 * width for n in field.shape[:ndim]):
            raise ValueError(
                f"mpijax.{op}: x must have at least 3 * width = {3 * width} cells (ghosts included) along each of "
                f"its first {ndim} axes, the decomposed ones, with width >= 1; got shape {field.shape} and width "
                f"{width}"
            )
    axis_of = [next(a for a, d in enumerate(offset) if d) for offset in faces.offsets]
    interior = slice(width, -width)
    if not corners:
        return structure.unflatten(_exchange_faces(fields, comm, faces, range(len(axis_of)), [interior] * ndim, width))
    for axis in range(ndim):
        # Along the axes done before, strips reach into the ghost cells, but
        # not beyond a wall: those ghosts stay as they are.
        spans = [
            slice(0 if periodic or c > 0 else width, None if periodic or c < d - 1 else -width)
            if a < axis
            else interior
            for a, (d, periodic, c) in enumerate(zip(dims, periods, coords, strict=True))
        ]
        directions = [i for i, a in enumerate(axis_of) if a == axis]
        fields = _exchange_faces(fields, comm, faces, directions, spans, width)
    return structure.unflatten(fields)


def _exchange_faces(fields, comm, faces, directions, spans, width):
    """One round of halo_exchange: every field's strips in `directions` (of
    faces), as one neighbor_exchange, and copies for those to oneself."""
    me = comm.Get_rank()
    nowhere, oneself = (MPI.PROC_NULL, MPI.PROC_NULL), (me, me)

    def strip(i, sending):
        return _strips(faces.offsets[i], spans, width, sending)

    messages, copies = [], []
    for k in range(len(fields)):
        for i in directions:
            pair = (faces.sources[i], faces.dests[i])
            if pair == oneself:
                copies.append((k, i))
            elif pair != nowhere:  # message (k, i): field k in direction i, tagged apart from every other
                messages.append((k, i))
    sends, recvs = [], []
    for k, i in messages:
        # At a wall one side of a message is MPI.PROC_NULL: it moves nothing,
        # so it is given nothing to slice, copy or zero.
        nothing = jax.ShapeDtypeStruct((0,), fields[k].dtype)
        part = fields[k][strip(i, True)]
        sends.append(part if faces.dests[i] != MPI.PROC_NULL else jnp.zeros(0, nothing.dtype))
        recvs.append(part if faces.sources[i] != MPI.PROC_NULL else nothing)
    received = neighbor_exchange(
        sends,
        [faces.sources[i] for _, i in messages],
        [faces.dests[i] for _, i in messages],
        recvs=recvs,
        tags=[k * len(faces.offsets) + i for k, i in messages],
        comm=comm,
    )
    received += [fields[k][strip(i, True)] for k, i in copies]
    for (k, i), ghost in zip(messages + copies, received, strict=True):
        if faces.sources[i] != MPI.PROC_NULL:
            fields[k] = fields[k].at[strip(i, False)].set(ghost)
    return fields


def _strips(offset, spans, width, sending):
    """The index of what goes in direction `offset` (a face: one axis): the
    interior cells next to that side (sending), or the ghost cells on the
    opposite side, where the neighbour's strip lands (receiving); across the
    other axes, `spans`."""
    index = []
    for d, span in zip(offset, spans, strict=True):
        if d == 0:
            index.append(span)
        elif sending:
            index.append(slice(-2 * width, -width) if d > 0 else slice(width, 2 * width))
        else:
            index.append(slice(0, width) if d > 0 else slice(-width, None))
    return tuple(index)
