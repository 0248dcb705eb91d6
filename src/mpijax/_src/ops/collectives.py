"""bcast, gather, scatter, allgather, alltoall, barrier and their v-variants:
data movement between all ranks of a communicator.

Each primitive is a linear map with a real output on every rank, so that
its transpose, and the transpose of that, are calls on every rank too. A
result that every rank holds identically (allgather, bcast) counts once: its
adjoint is local (a local_primitive) and the adjoint of that is the
collective again (docs/autodiff.md).

The v-variants are the same primitives with `counts`, rows per rank along
the leading axis (empty for the plain collective, where every rank's block
is x whole). vmap puts the batch axis right after the axis that runs over
ranks (the stacked axis of gather and allgather, the leading axis of a
v-variant's x, of scatter's and alltoall's x) and first everywhere else, so
all ranks lay out their messages alike.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .. import comm as _comm
from .. import dtypes, jax_compat, validation
from ..primitive import batch_operands, cotangent, linear_jvp, local_primitive, mpi_primitive
from . import reductions


def _rank(params):
    return _comm.info(params["comm"]).rank


def _size(params):
    return _comm.info(params["comm"]).size


def is_root(params):
    return _rank(params) == params["root"]


def _stacked(x, counts, params):
    """Every rank's block together: stacked along a new axis, or
    concatenated along the leading one with counts."""
    return x.update(shape=(sum(counts), *x.shape[1:]) if counts else (_size(params), *x.shape))


def _block(x, counts, params):
    """This rank's block of a stacked or concatenated x."""
    return x.update(shape=(counts[_rank(params)], *x.shape[1:]) if counts else x.shape[1:])


def _offset(counts, rank):
    return sum(counts[:rank])


def _batcher(operand_axis, output_axis):
    """vmap: one call on the whole batch, its axis where operand_axis(params)
    and output_axis(params) put it."""

    def rule(prim, args, dims, **params):
        (x,) = batch_operands(args, dims, [operand_axis(params)])
        return prim.bind(x, **params), [output_axis(params)]

    return rule


def _varied(params):
    """1 if the leading axis runs over ranks (a v-variant), else 0."""
    return int(bool(params.get("counts") or params.get("send_counts")))


def root_only(out, x, params):
    """The result of a call whose output only the root needs (reduce, gather):
    off the root the primitive outputs nothing and `x` is returned as it is,
    so XLA never copies `x` to give the call a buffer that it would not
    write."""
    return out if is_root(params) else x


def nothing(x):
    """The output of a rank that needs none: an empty array."""
    return x.update(shape=(0,))


def receive_buffer(cts, x, params):
    """The cotangent of a rooted call's result, as its adjoint's operand: off
    the root, where the result had no cotangent, zeros to receive into."""
    return cotangent(cts) if is_root(params) else jax_compat.transposed_receive_buffer(x.aval)


# bcast: the root sends x and returns it; the others receive in place, so a
# loop carry needs no copy. The root's primitive outputs nothing, so XLA never
# copies an x that stays live to give the call an aliased buffer.
# replicated=1 is the op, whose result counts once; replicated=0 is the
# adjoint of reduce, received into zeros off the root.
def broadcast(x, replicated, **params):
    """bcast_p's call as the op returns it: `x` itself on the root."""
    (out,) = bcast_p.bind(x, **params, replicated=replicated)
    return x if is_root(params) else out


def _bcast_transpose(cts, x, *, comm, root, replicated):
    params = dict(comm=comm, root=root)
    # The root's x reaches its result directly, not through the call, whose
    # adjoint is zeros there: a call still, so that the root makes the
    # collective again when this is transposed again, as the others do.
    ct = jax_compat.transposed_receive_buffer(x.aval) if is_root(params) else cotangent(cts)
    if replicated:
        return [bcast_adjoint_p.bind(ct, **params)]
    (total,) = reductions.reduce_p.bind(ct, **params, op=reductions.SUM)
    return [total if is_root(params) else ad.Zero(x.aval)]


bcast_p = mpi_primitive(
    "bcast",
    lambda x, **p: [nothing(x) if is_root(p) else x],
    lambda x, **p: None if is_root(p) else {0: 0},
    jvp=linear_jvp,
    transpose=_bcast_transpose,
    batch=_batcher(lambda p: 0, lambda p: None if is_root(p) else 0),
    attributes=("comm", "root"),
)
# The root's x alone made the result, so only the root gets its cotangent.
bcast_adjoint_p = local_primitive(
    "bcast_adjoint",
    lambda ct, *, comm, root: ct if is_root(dict(comm=comm, root=root)) else jnp.zeros_like(ct),
    transpose=lambda ct, x, *, comm, root: [broadcast(cotangent(ct), 1, comm=comm, root=root)],
    batch=lambda prim, args, dims, **p: (prim.bind(*args, **p), dims[0]),
)


# gather: only the root has a result; its adjoint scatters the cotangent.
def _gather_transpose(cts, x, *, comm, root, counts):
    params = dict(comm=comm, root=root, counts=counts)
    return scatter_p.bind(receive_buffer(cts, x, params), **params)


def _scatter_transpose(cts, x, *, comm, root, counts):
    params = dict(comm=comm, root=root, counts=counts)
    (stacked,) = gather_p.bind(cotangent(cts), **params)
    # Off the root x only gave the shape.
    return [stacked if is_root(params) else ad.Zero(x.aval)]


gather_p = mpi_primitive(
    "gather",
    lambda x, **p: [_stacked(x, p["counts"], p) if is_root(p) else nothing(x)],
    jvp=linear_jvp,
    transpose=_gather_transpose,
    batch=_batcher(_varied, lambda p: 1 if is_root(p) else None),
)
# scatter: off the root, x only gives the shape.
scatter_p = mpi_primitive(
    "scatter",
    lambda x, **p: [_block(x, p["counts"], p) if is_root(p) else x],
    jvp=linear_jvp,
    transpose=_scatter_transpose,
    batch=_batcher(lambda p: 1 if is_root(p) else _varied(p), _varied),
)


# allgather: replicated=1 is the op (its result counts once); replicated=0
# is the adjoint of reduce_scatter, whose result is summed over ranks, and
# whose own adjoint is reduce_scatter again.
def _allgather_transpose(cts, x, *, comm, counts, replicated):
    if replicated:
        return [allgather_adjoint_p.bind(cotangent(cts), comm=comm, counts=counts)]
    return reductions.reduce_scatter_p.bind(cotangent(cts), comm=comm, op=reductions.SUM)


allgather_p = mpi_primitive(
    "allgather",
    lambda x, **p: [_stacked(x, p["counts"], p)],
    jvp=linear_jvp,
    transpose=_allgather_transpose,
    batch=_batcher(_varied, lambda p: 1),
    attributes=("comm", "counts"),
)


def _own_block(ct, *, comm, counts):
    rank = _comm.info(comm).rank
    if not counts:
        return ct[rank]
    start = _offset(counts, rank)
    return ct[start : start + counts[rank]]


allgather_adjoint_p = local_primitive(
    "allgather_adjoint",
    _own_block,
    transpose=lambda ct, x, *, comm, counts: allgather_p.bind(cotangent(ct), comm=comm, counts=counts, replicated=1),
    batch=lambda prim, args, dims, **p: (prim.bind(jnp.moveaxis(args[0], dims[0], 1), **p), _varied(p)),
)

alltoall_p = mpi_primitive(
    "alltoall",
    lambda x, **p: [x.update(shape=(sum(p["recv_counts"]), *x.shape[1:])) if p["send_counts"] else x],
    jvp=linear_jvp,
    transpose=lambda cts, x, *, comm, send_counts, recv_counts: alltoall_p.bind(
        cotangent(cts), comm=comm, send_counts=recv_counts, recv_counts=send_counts
    ),
    batch=_batcher(lambda p: 1, lambda p: 1),
)
barrier_p = mpi_primitive("barrier", lambda **p: [])  # no operands: nothing to differentiate or batch


# ragged_alltoall: counts known only at run time, an int32 or int64 operand whose last
# axis runs over ranks and whose axes before it are a batch (vmap), leading x's
# too; `rows` is the result's length along x's rows axis. Its transpose sends
# the rows back along the same counts (reverse=1), and the transpose of that
# is the op again. The counts received are an integer output: no tangent.
def _ragged_outputs(x, counts, *, comm, rows, reverse):
    k = counts.ndim - 1
    return [x.update(shape=(*x.shape[:k], rows, *x.shape[k + 1 :])), counts]


def _ragged_jvp(prim, primals, tangents, **params):
    x, counts = primals
    y, received = prim.bind_primal(x, counts, **params)
    dy, _ = prim.bind(ad.instantiate_zeros(tangents[0]), counts, **params)
    return [y, received], [dy, ad.Zero(jax.typeof(received).to_tangent_aval())]


def _ragged_transpose(cts, x, counts, *, comm, rows, reverse):
    back, _ = ragged_alltoall_p.bind(
        cotangent(cts), counts, comm=comm, rows=x.aval.shape[counts.ndim - 1], reverse=1 - reverse
    )
    return [back, None]


def _ragged_batch(prim, args, dims, **params):
    return prim.bind(*batch_operands(args, dims, [0, 0]), **params), [0, 0]


ragged_alltoall_p = mpi_primitive(
    "ragged_alltoall",
    _ragged_outputs,
    jvp=_ragged_jvp,
    transpose=_ragged_transpose,
    batch=_ragged_batch,
    attributes=("comm", "reverse"),
)


def _leading_axis(x, comm, message, detail=""):
    # `message` starts with mpi4jax's own words, which code written for it matches.
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(f"{message} must have shape (nproc, ...){detail} with nproc={comm.size}; got shape {x.shape}")


def _rooted(name, x, root, comm):
    comm = _comm.resolve(comm, name)
    return dtypes.array(x, name), validation.rank(root, "root", comm, name), comm


def _varied_call(name, x, counts, comm):
    """The arguments of a v-variant: comm, x and counts, validated."""
    comm = _comm.resolve(comm, name)
    return comm, dtypes.array(x, name), validation.counts(counts, "counts", comm, name)


def bcast(x, root, *, comm=None, token=validation.NOTSET):
    """Broadcast `x` from `root`. Off the root, `x` only gives the shape and
    dtype of the result; on the root, `x` is returned."""
    validation.no_token(token, "bcast")
    x, root, comm = _rooted("bcast", x, root, comm)
    return broadcast(x, 1, comm=comm.id, root=root)


def gather(x, root, *, comm=None, token=validation.NOTSET):
    """Stack every rank's `x` on `root` (shape (nproc, *x.shape)). Off the
    root, `x` is returned unchanged."""
    validation.no_token(token, "gather")
    x, root, comm = _rooted("gather", x, root, comm)
    params = dict(comm=comm.id, root=root, counts=())
    return root_only(gather_p.bind(x, **params)[0], x, params)


def scatter(x, root, *, comm=None, token=validation.NOTSET):
    """Send slice i of the root's `x` (shape (nproc, ...)) to rank i. Off the
    root, `x` only gives the shape and dtype of the result."""
    validation.no_token(token, "scatter")
    x, root, comm = _rooted("scatter", x, root, comm)
    if comm.rank == root:
        _leading_axis(x, comm, "mpijax.scatter: Scatter input", " on the root")
    return scatter_p.bind(x, comm=comm.id, root=root, counts=())[0]


def allgather(x, *, comm=None, token=validation.NOTSET):
    """Stack every rank's `x` on every rank (shape (nproc, *x.shape))."""
    validation.no_token(token, "allgather")
    comm = _comm.resolve(comm, "allgather")
    x = dtypes.array(x, "allgather")
    return allgather_p.bind(x, comm=comm.id, counts=(), replicated=1)[0]


def alltoall(x, *, comm=None, token=validation.NOTSET):
    """Send slice i of `x` (shape (nproc, ...)) to rank i; slice j of the
    result comes from rank j."""
    validation.no_token(token, "alltoall")
    comm = _comm.resolve(comm, "alltoall")
    x = dtypes.array(x, "alltoall")
    _leading_axis(x, comm, "mpijax.alltoall: Alltoall input")
    return alltoall_p.bind(x, comm=comm.id, send_counts=(), recv_counts=())[0]


def barrier(*, comm=None, token=validation.NOTSET):
    """Block until every rank of `comm` has reached the barrier."""
    validation.no_token(token, "barrier")
    comm = _comm.resolve(comm, "barrier")
    barrier_p.bind(comm=comm.id)


def allgatherv(x, counts, *, comm=None):
    """Concatenate every rank's `x` along the leading axis, on every rank:
    rank r passes counts[r] rows (x.shape[0] == counts[rank]); the result has
    sum(counts) rows."""
    comm, x, counts = _varied_call("allgatherv", x, counts, comm)
    validation.leading(x, counts[comm.rank], "allgatherv", f"(counts[{comm.rank}] rows on rank {comm.rank})")
    return allgather_p.bind(x, comm=comm.id, counts=counts, replicated=1)[0]


def gatherv(x, counts, root, *, comm=None):
    """Concatenate every rank's `x` along the leading axis on `root` (rank r
    passes counts[r] rows). Off the root, `x` is returned unchanged."""
    comm, x, counts = _varied_call("gatherv", x, counts, comm)
    root = validation.rank(root, "root", comm, "gatherv")
    validation.leading(x, counts[comm.rank], "gatherv", f"(counts[{comm.rank}] rows on rank {comm.rank})")
    params = dict(comm=comm.id, root=root, counts=counts)
    return root_only(gather_p.bind(x, **params)[0], x, params)


def scatterv(x, counts, root, *, comm=None):
    """Split the root's `x` (sum(counts) rows) along the leading axis: rank r
    gets counts[r] rows. Off the root, `x` only gives the shape and dtype of
    the result (counts[rank] rows)."""
    comm, x, counts = _varied_call("scatterv", x, counts, comm)
    root = validation.rank(root, "root", comm, "scatterv")
    if comm.rank == root:
        validation.leading(x, sum(counts), "scatterv", "(sum(counts) rows on the root)")
    else:
        validation.leading(x, counts[comm.rank], "scatterv", f"(counts[{comm.rank}] rows on rank {comm.rank})")
    return scatter_p.bind(x, comm=comm.id, root=root, counts=counts)[0]


def alltoallv(x, send_counts, recv_counts, *, comm=None):
    """Send rows of `x` to every rank: the first send_counts[0] rows to rank
    0, the next send_counts[1] to rank 1, and so on; the result holds
    recv_counts[j] rows from each rank j, in rank order. Each rank passes its
    own counts: send_counts[j] here must equal recv_counts[rank] on rank j."""
    comm, x, send_counts = _varied_call("alltoallv", x, send_counts, comm)
    recv_counts = validation.counts(recv_counts, "recv_counts", comm, "alltoallv")
    validation.leading(x, sum(send_counts), "alltoallv", "(sum(send_counts) rows)")
    return alltoall_p.bind(x, comm=comm.id, send_counts=send_counts, recv_counts=recv_counts)[0]


def ragged_alltoall(x, send_counts, *, rows=None, comm=None):
    """alltoallv with counts known only when the call runs: the first
    send_counts[0] rows of `x` go to rank 0, the next send_counts[1] to rank 1,
    and so on (`send_counts`: an integer array of one entry per rank, traced
    or not, with sum(send_counts) <= x.shape[0]). Returns (y, recv_counts): y
    has `rows` rows (default x.shape[0]), the rows received packed at its front
    in rank order and zeros after them; recv_counts[j] rows came from rank j
    (int64 where send_counts are 64-bit or uint32, with x64; int32 otherwise).
    Where a rank would receive more than `rows` rows, or its send_counts do
    not fit x, no rows move and every rank raises when the call runs."""
    comm = _comm.resolve(comm, "ragged_alltoall")
    x = dtypes.array(x, "ragged_alltoall")
    if x.ndim == 0:
        raise ValueError("mpijax.ragged_alltoall: x must have a leading axis of rows; got a scalar")
    expected = f"an integer array of shape ({comm.size},), one entry per rank"
    try:  # counts from the host stay NumPy's until _count_type, which saturates them
        counts = send_counts if isinstance(send_counts, jax.Array) else np.asarray(send_counts)
    except ValueError:
        raise TypeError(f"mpijax.ragged_alltoall: send_counts must be {expected}") from None
    if not jnp.issubdtype(counts.dtype, jnp.integer) or counts.shape != (comm.size,):
        raise ValueError(
            f"mpijax.ragged_alltoall: send_counts must be {expected}; got {counts.dtype}{list(counts.shape)}"
        )
    rows = x.shape[0] if rows is None else validation.static_int(rows, "rows", "ragged_alltoall")
    if rows < 0:
        raise ValueError(f"mpijax.ragged_alltoall: rows must be non-negative, got {rows}")
    y, received = ragged_alltoall_p.bind(x, _count_type(counts), comm=comm.id, rows=rows, reverse=0)
    return y, received


def _count_type(counts):
    """Counts (a JAX or NumPy array) as the handler takes them: int64 where
    they can exceed int32 (with x64), else int32; a count past the type
    saturates, so that it is refused quoting a value beyond any rows, never
    wraps into another count (as jnp.asarray would, without x64)."""
    wide = jax.config.jax_enable_x64 and np.iinfo(counts.dtype).max > np.iinfo(np.int32).max
    kind = np.dtype(np.int64 if wide else np.int32)
    xp = np if isinstance(counts, np.ndarray) else jnp
    have, fit = np.iinfo(counts.dtype), np.iinfo(kind)
    if have.max > fit.max:
        counts = xp.minimum(counts, xp.asarray(fit.max, counts.dtype))
    if have.min < fit.min:
        counts = xp.maximum(counts, xp.asarray(fit.min, counts.dtype))
    return jnp.asarray(counts.astype(kind))
