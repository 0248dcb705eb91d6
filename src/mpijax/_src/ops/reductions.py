"""allreduce, reduce, reduce_scatter, scan, exscan: element-wise reductions
across ranks.

Derivatives: linear for SUM. For MIN, MAX and PROD the tangent of a
reduction is the sum over ranks of w * dx, with weights w from the primal
values. Linearized programs only ever contain SUM reductions, so only those
have transposes.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, cotangent, linear_jvp, local_primitive, mpi_primitive
from . import collectives

SUM, PROD, MIN, MAX = (dtypes.REDUCTIONS[name] for name in ("SUM", "PROD", "MIN", "MAX"))


def _same(x, **params):
    return [x]


def _in_place(x, **params):
    return {0: 0}


def _linear_only(op, name):
    if op != SUM:
        raise NotImplementedError(f"mpijax: {name} with a reduction other than MPI.SUM is not linear")


def _batch_first(prim, args, dims, **params):
    """vmap of an element-wise call: the batch axis can go anywhere; at 0 on
    every rank."""
    return prim.bind(*batch_operands(args, dims, [0]), **params), [0]


def _allreduce_transpose(cts, x, *, comm, op):
    _linear_only(op, "allreduce")
    return [allreduce_adjoint_p.bind(cotangent(cts), comm=comm)]


def _reduce_transpose(cts, x, *, comm, op, root):
    _linear_only(op, "reduce")
    params = dict(comm=comm, root=root)
    return [collectives.broadcast(collectives.receive_buffer(cts, x, params), 0, **params)]


def _reduce_scatter_transpose(cts, x, *, comm, op):
    _linear_only(op, "reduce_scatter")
    return collectives.allgather_p.bind(cotangent(cts), comm=comm, counts=(), replicated=0)


def _scan_transpose(cts, x, *, comm, op, reverse, exclusive, identity):
    _linear_only(op, "scan")
    if exclusive:  # over the ranks after this one (before, if reverse)
        return [exclusive_scan(cotangent(cts), comm, SUM, not reverse)]
    return scan_p.bind(cotangent(cts), comm=comm, op=op, reverse=1 - reverse, exclusive=0, identity=b"")


def _differentiable(op, name):
    """Only the predefined arithmetic ops have derivatives here (the others
    apply to integers, which have no tangents); a user-defined op's function
    is opaque to JAX. Every floating-point operand has a tangent under
    differentiation (jax_compat.align_with_transformation), so this raises on
    every rank alike, at trace time."""
    if op not in (SUM, PROD, MIN, MAX):
        raise TypeError(
            f"mpijax.{name}: cannot differentiate through op={dtypes.reduction_label(op)}: JAX cannot see "
            "inside a user-defined reduction. Use MPI.SUM, MPI.PROD, MPI.MIN or MPI.MAX, or make this call "
            "outside the function that jax.grad/jax.jvp transforms"
        )


def _weights(x, y, comm, op):
    """w for MIN/MAX (where y, the reduction, is known on every rank) and PROD."""
    if op == PROD:
        # The product of every other rank's value: exact where some are zero.
        return exclusive_scan(x, comm, PROD, False, primal=True) * exclusive_scan(x, comm, PROD, True, primal=True)
    # The derivative follows the arg max; ranks that tie share it equally.
    hit = (x == y).astype(x.dtype)
    return hit / allreduce_p.bind_primal(hit, comm=comm, op=SUM)[0]


def _allreduce_jvp(prim, primals, tangents, *, comm, op):
    _differentiable(op, "allreduce")
    if op == SUM:
        return linear_jvp(prim, primals, tangents, comm=comm, op=op)
    (x,), (t,) = primals, tangents
    y = allreduce_p.bind_primal(x, comm=comm, op=op)
    w = _weights(x, y[0], comm, op)
    return y, allreduce_p.bind(w * ad.instantiate_zeros(t), comm=comm, op=SUM)


def _reduce_jvp(prim, primals, tangents, *, comm, op, root):
    _differentiable(op, "reduce")
    if op == SUM:
        return linear_jvp(prim, primals, tangents, comm=comm, op=op, root=root)
    (x,), (t,) = primals, tangents
    if op == PROD:
        y, everywhere = reduce_p.bind_primal(x, comm=comm, op=op, root=root), None
    else:  # MIN and MAX compare with the result on every rank
        (everywhere,) = allreduce_p.bind_primal(x, comm=comm, op=op)
        y = [everywhere if collectives.is_root(dict(comm=comm, root=root)) else jnp.zeros((0,), x.dtype)]
    w = _weights(x, everywhere, comm, op)
    return y, reduce_p.bind(w * ad.instantiate_zeros(t), comm=comm, op=SUM, root=root)


def _reduce_scatter_jvp(prim, primals, tangents, *, comm, op):
    _differentiable(op, "reduce_scatter")
    if op == SUM:
        return linear_jvp(prim, primals, tangents, comm=comm, op=op)
    (x,), (t,) = primals, tangents
    y = reduce_scatter_p.bind_primal(x, comm=comm, op=op)
    # MIN and MAX compare with the whole result, gathered from its slices.
    everywhere = (
        None if op == PROD else collectives.allgather_p.bind_primal(y[0], comm=comm, counts=(), replicated=1)[0]
    )
    w = _weights(x, everywhere, comm, op)
    return y, reduce_scatter_p.bind(w * ad.instantiate_zeros(t), comm=comm, op=SUM)


def _scan_jvp(prim, primals, tangents, *, comm, op, reverse, exclusive, identity):
    _differentiable(op, "scan")
    params = dict(comm=comm, op=op, reverse=reverse, exclusive=exclusive, identity=identity)
    if op == SUM:
        return linear_jvp(prim, primals, tangents, **params)
    (x,), (t,) = primals, tangents
    y = scan_p.bind_primal(x, **params)
    return y, [_gathered_tangent(x, ad.instantiate_zeros(t), comm, op, reverse, exclusive)]


def _gathered_tangent(x, t, comm, op, reverse, exclusive):
    """The tangent of op over the ranks a scan combines on this rank, from
    every rank's value: exact, ties shared, zeros fine, at the cost of
    gathering communicator-size copies of the array."""
    info = _comm.info(comm)
    ranks = np.arange(info.size)
    members = ranks >= info.rank if reverse else ranks <= info.rank
    if exclusive:
        members &= ranks != info.rank
    members = members.reshape((info.size,) + (1,) * x.ndim)
    (values,) = collectives.allgather_p.bind_primal(x, comm=comm, counts=(), replicated=1)
    if op == PROD:  # the product of the other members' factors, from both sides
        factors = jnp.where(members, values, 1)
        ones = jnp.ones_like(factors[:1])
        before = jnp.cumprod(jnp.concatenate([ones, factors[:-1]]), axis=0)
        after = jnp.flip(jnp.cumprod(jnp.flip(jnp.concatenate([factors[1:], ones]), 0), axis=0), 0)
        weights = jnp.where(members, before * after, 0)
    else:  # MIN/MAX: the members that attain the result share its tangent
        extreme = jnp.max if op == MAX else jnp.min
        result = extreme(jnp.where(members, values, identity(op, x.dtype)), axis=0)
        hit = members & (values == result)
        # No members (the first rank of an exclusive scan): no tangent.
        weights = hit / jnp.maximum(jnp.sum(hit, axis=0), 1)
    # Row s of the alltoall result is rank s's tangent: a linear gather whose
    # transpose (alltoall again) sends each rank exactly its share.
    (tangents,) = collectives.alltoall_p.bind(
        jnp.broadcast_to(t, (info.size, *t.shape)), comm=comm, send_counts=(), recv_counts=()
    )
    return jnp.sum(weights * tangents, axis=0)


allreduce_p = mpi_primitive(
    "allreduce",
    _same,
    _in_place,
    jvp=_allreduce_jvp,
    transpose=_allreduce_transpose,
    batch=_batch_first,
)
# The result is replicated: its adjoint is local (docs/autodiff.md).
allreduce_adjoint_p = local_primitive(
    "allreduce_adjoint",
    lambda ct, *, comm: ct,
    transpose=lambda ct, x, *, comm: allreduce_p.bind(cotangent(ct), comm=comm, op=SUM),
    batch=lambda prim, args, dims, **p: (prim.bind(*args, **p), dims[0]),
)
# Only the root has a result (reduce returns x off the root, as mpi4jax does).
reduce_p = mpi_primitive(
    "reduce",
    lambda x, **p: [x if collectives.is_root(p) else collectives.nothing(x)],
    lambda x, **p: {0: 0} if collectives.is_root(p) else None,
    jvp=_reduce_jvp,
    transpose=_reduce_transpose,
    batch=lambda prim, args, dims, **p: (
        prim.bind(*batch_operands(args, dims, [0]), **p),
        [0 if collectives.is_root(p) else None],
    ),
)
# Rank r gets the reduction of every rank's slice r (x: shape (nproc, ...)).
reduce_scatter_p = mpi_primitive(
    "reduce_scatter",
    lambda x, **p: [x.update(shape=x.shape[1:])],
    jvp=_reduce_scatter_jvp,
    transpose=_reduce_scatter_transpose,
    batch=lambda prim, args, dims, **p: (prim.bind(*batch_operands(args, dims, [1]), **p), [0]),
)
# reverse: over the ranks in reverse order (suffix); exclusive: MPI_Exscan,
# with `identity` (one element's bytes) written on the first rank by the
# handler, in place, where MPI defines nothing (exclusive_scan).
scan_p = mpi_primitive(
    "scan",
    _same,
    _in_place,
    jvp=_scan_jvp,
    transpose=_scan_transpose,
    batch=_batch_first,
)


def _prepare(x, op, comm, name):
    comm = _comm.resolve(comm, name)
    x = dtypes.array(x, name)
    return x, comm, dtypes.reduction_code(op, x.dtype, name)


def allreduce(x, op, *, comm=None, token=validation.NOTSET):
    """Reduce `x` element-wise over all ranks with `op` (an MPI.Op such as
    MPI.SUM); every rank gets the result."""
    validation.no_token(token, "allreduce")
    return _allreduce(x, op, comm, "allreduce")


def _allreduce(x, op, comm, name):
    x, comm, code = _prepare(x, op, comm, name)
    return allreduce_p.bind(x, comm=comm.id, op=code)[0]


def tree_allreduce(tree, op, *, comm=None):
    """allreduce of every leaf of a pytree (the gradients of a model, say) in
    one call per dtype: the leaves of a dtype are flattened into one buffer,
    reduced together and split back into the tree's structure."""
    leaves, structure = jax.tree.flatten(tree)
    leaves = [dtypes.array(leaf, "tree_allreduce", "tree") for leaf in leaves]
    by_dtype = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    reduced = [None] * len(leaves)
    for members in by_dtype.values():
        flat = _allreduce(jnp.concatenate([leaves[i].ravel() for i in members]), op, comm, "tree_allreduce")
        ends = np.cumsum([leaves[i].size for i in members])
        for i, end in zip(members, ends, strict=True):
            reduced[i] = flat[end - leaves[i].size : end].reshape(leaves[i].shape)
    return structure.unflatten(reduced)


def varying(x, *, comm=None):
    """`x` itself, marked as a value that every rank holds alike (a result of
    allreduce, bcast or allgather) and that feeds work differing by rank:
    reverse-mode derivatives then sum its cotangents over the ranks, where
    they would otherwise count only this rank's (docs/autodiff.md). JAX's
    shard_map does this itself (pvary); an MPI program has to say so."""
    x, comm = dtypes.array(x, "varying"), _comm.resolve(comm, "varying")
    return allreduce_adjoint_p.bind(x, comm=comm.id)


def reduce(x, op, root, *, comm=None, token=validation.NOTSET):
    """Reduce `x` element-wise over all ranks onto `root`. Off the root, `x`
    is returned unchanged."""
    validation.no_token(token, "reduce")
    x, comm, code = _prepare(x, op, comm, "reduce")
    root = validation.rank(root, "root", comm, "reduce")
    params = dict(comm=comm.id, root=root)
    return collectives.root_only(reduce_p.bind(x, op=code, **params)[0], x, params)


def scan(x, op, *, comm=None, token=validation.NOTSET):
    """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r)."""
    validation.no_token(token, "scan")
    x, comm, code = _prepare(x, op, comm, "scan")
    return scan_p.bind(x, comm=comm.id, op=code, reverse=0, exclusive=0, identity=b"")[0]


def reduce_scatter(x, op, *, comm=None):
    """Reduce `x` (shape (nproc, ...)) element-wise over all ranks with `op`;
    rank r gets slice r of the result (MPI_Reduce_scatter_block)."""
    x, comm, code = _prepare(x, op, comm, "reduce_scatter")
    validation.leading(x, comm.size, "reduce_scatter", f"(one slice per rank: nproc={comm.size})")
    return reduce_scatter_p.bind(x, comm=comm.id, op=code)[0]


def exscan(x, op, *, comm=None):
    """Exclusive prefix reduction: rank r gets op(x_0, ..., x_{r-1}). Rank 0,
    where MPI leaves the result undefined, gets the identity of `op` (0 for
    SUM, 1 for PROD, the largest value of the dtype for MIN (inf for floats),
    the smallest for MAX, all bits set for BAND, ...), and zeros for a
    user-defined op."""
    x, comm, code = _prepare(x, op, comm, "exscan")
    return exclusive_scan(x, comm.id, code, False)


def identity(op, dtype):
    """The identity element of predefined reduction `op` on `dtype`, or zero
    for a user-defined op (which has none that mpijax knows)."""
    dtype = np.dtype(dtype)
    if op == PROD or op == dtypes.REDUCTIONS["LAND"]:
        return np.ones((), dtype)
    if op == dtypes.REDUCTIONS["BAND"]:
        return np.array(-1).astype(dtype) if dtype != np.bool_ else np.ones((), dtype)
    if op in (MIN, MAX):
        info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
        big = np.inf if jnp.issubdtype(dtype, jnp.floating) else info.max
        small = -np.inf if jnp.issubdtype(dtype, jnp.floating) else info.min
        return np.array(big if op == MIN else small).astype(dtype)
    return np.zeros((), dtype)


def exclusive_scan(x, comm, op, reverse, primal=False):
    """op over the ranks before this one (after it, if reverse): the
    identity of op on the first rank, where MPI_Exscan defines nothing.
    primal: a call of a JVP rule on primal values (bind_primal)."""
    fill = identity(op, x.dtype).tobytes()
    bind = scan_p.bind_primal if primal else scan_p.bind
    return bind(x, comm=comm, op=op, reverse=int(reverse), exclusive=1, identity=fill)[0]
