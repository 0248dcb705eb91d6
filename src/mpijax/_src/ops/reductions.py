"""allreduce, reduce, scan: element-wise reductions across ranks."""

import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, linear_jvp, mpi_primitive
from .collectives import allgather_p, alltoall_p

SUM, PROD, MIN, MAX = (dtypes.REDUCTIONS[name] for name in ("SUM", "PROD", "MIN", "MAX"))


def _same(x, **params):
    return [x]


def _in_place(x, **params):
    return {0: 0}


allreduce_p = mpi_primitive("allreduce", _same, _in_place)
# Off the root, reduce returns x (what mpi4jax returns), in place.
reduce_p = mpi_primitive("reduce", _same, _in_place)
# reverse: over the ranks in reverse order (suffix); exclusive: MPI_Exscan.
scan_p = mpi_primitive("scan", _same, _in_place)


def _prepare(x, op, comm, name):
    comm = _comm.resolve(comm, name)
    x = dtypes.array(x, name)
    return x, comm, dtypes.reduction_code(op, x.dtype, name)


def allreduce(x, op, *, comm=None, token=validation.NOTSET):
    """Reduce `x` element-wise over all ranks with `op` (an MPI.Op such as
    MPI.SUM); every rank gets the result."""
    validation.no_token(token, "allreduce")
    x, comm, code = _prepare(x, op, comm, "allreduce")
    return allreduce_p.bind(x, comm=comm.id, op=code)[0]


def reduce(x, op, root, *, comm=None, token=validation.NOTSET):
    """Reduce `x` element-wise over all ranks onto `root`. Off the root, `x`
    is returned unchanged."""
    validation.no_token(token, "reduce")
    x, comm, code = _prepare(x, op, comm, "reduce")
    root = validation.rank(root, "root", comm, "reduce")
    return reduce_p.bind(x, comm=comm.id, op=code, root=root)[0]


def scan(x, op, *, comm=None, token=validation.NOTSET):
    """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r)."""
    validation.no_token(token, "scan")
    x, comm, code = _prepare(x, op, comm, "scan")
    return scan_p.bind(x, comm=comm.id, op=code, reverse=0, exclusive=0)[0]


def exclusive_scan(x, comm, op, reverse):
    """op over the ranks before this one (after it, if reverse): the identity
    on the first rank, where MPI_Exscan defines nothing. SUM and PROD only."""
    (y,) = scan_p.bind(x, comm=comm, op=op, reverse=int(reverse), exclusive=1)
    info = _comm.info(comm)
    first = info.size - 1 if reverse else 0
    return jnp.full_like(x, 1 if op == PROD else 0) if info.rank == first else y


# Derivatives. Linear for SUM. For MIN, MAX and PROD the tangent of the
# reduction is sum over ranks of w * dx, with weights w from the primal values.


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
        return exclusive_scan(x, comm, PROD, False) * exclusive_scan(x, comm, PROD, True)
    # The derivative follows the arg max; ranks that tie share it equally.
    hit = (x == y).astype(x.dtype)
    return hit / allreduce_p.bind(hit, comm=comm, op=SUM)[0]


def _allreduce_jvp(primals, tangents, *, comm, op):
    _differentiable(op, "allreduce")
    if op == SUM:
        return linear_jvp(allreduce_p)(primals, tangents, comm=comm, op=op)
    (x,), (t,) = primals, tangents
    y = allreduce_p.bind_primal(x, comm=comm, op=op)
    w = _weights(x, y[0], comm, op)
    return y, allreduce_p.bind(w * ad.instantiate_zeros(t), comm=comm, op=SUM)


def _reduce_jvp(primals, tangents, *, comm, op, root):
    _differentiable(op, "reduce")
    if op == SUM:
        return linear_jvp(reduce_p)(primals, tangents, comm=comm, op=op, root=root)
    (x,), (t,) = primals, tangents
    t = ad.instantiate_zeros(t)
    root_here = _comm.info(comm).rank == root
    if op == PROD:
        y, everywhere = reduce_p.bind_primal(x, comm=comm, op=op, root=root), None
    else:  # MIN and MAX compare with the result on every rank
        (everywhere,) = allreduce_p.bind_primal(x, comm=comm, op=op)
        y = [everywhere if root_here else x]
    # Off the root the result is x, whose tangent is t.
    w = _weights(x, everywhere, comm, op)
    (total,) = reduce_p.bind(w * t, comm=comm, op=SUM, root=root)
    return y, [total if root_here else t]


def _scan_jvp(primals, tangents, *, comm, op, reverse, exclusive):
    _differentiable(op, "scan")
    if op == SUM:
        return linear_jvp(scan_p)(primals, tangents, comm=comm, op=op, reverse=reverse, exclusive=exclusive)
    (x,), (t,) = primals, tangents
    y = scan_p.bind_primal(x, comm=comm, op=op, reverse=reverse, exclusive=exclusive)
    return y, [_gathered_tangent(x, ad.instantiate_zeros(t), comm, op, reverse, exclusive)]


def _gathered_tangent(x, t, comm, op, reverse, exclusive):
    """The tangent of op over the ranks a scan combines on this rank, from
    every rank's value: exact, ties shared, zeros fine, at the cost of
    gathering communicator-size copies of the array."""
    if exclusive and op != PROD:
        raise NotImplementedError("mpijax: derivatives of exclusive MIN/MAX scans are not implemented")
    info = _comm.info(comm)
    ranks = np.arange(info.size)
    members = ranks >= info.rank if reverse else ranks <= info.rank
    if exclusive:
        members &= ranks != info.rank
    members = members.reshape((info.size,) + (1,) * x.ndim)
    (values,) = allgather_p.bind(x, comm=comm)
    if op == PROD:  # the product of the other members' factors, from both sides
        factors = jnp.where(members, values, 1)
        ones = jnp.ones_like(factors[:1])
        before = jnp.cumprod(jnp.concatenate([ones, factors[:-1]]), axis=0)
        after = jnp.flip(jnp.cumprod(jnp.flip(jnp.concatenate([factors[1:], ones]), 0), axis=0), 0)
        weights = jnp.where(members, before * after, 0)
    else:  # MIN/MAX: the members that attain the result share its tangent
        extreme = jnp.max if op == MAX else jnp.min
        result = extreme(jnp.where(members, values, values[info.rank]), axis=0)
        hit = members & (values == result)
        weights = hit / jnp.sum(hit, axis=0)
    # Row s of the alltoall result is rank s's tangent: a linear gather whose
    # transpose (alltoall again) sends each rank exactly its share.
    (tangents,) = alltoall_p.bind(jnp.broadcast_to(t, (info.size, *t.shape)), comm=comm)
    return jnp.sum(weights * tangents, axis=0)


ad.primitive_jvps[allreduce_p] = _allreduce_jvp
ad.primitive_jvps[reduce_p] = _reduce_jvp
ad.primitive_jvps[scan_p] = _scan_jvp


# vmap: element-wise, so the batch axis can go anywhere; at 0 on every rank.
def _elementwise_batcher(prim):
    def rule(args, dims, **params):
        return prim.bind(*batch_operands(args, dims, [0]), **params), [0]

    return rule


batching.primitive_batchers[allreduce_p] = _elementwise_batcher(allreduce_p)
batching.primitive_batchers[scan_p] = _elementwise_batcher(scan_p)
batching.primitive_batchers[reduce_p] = _elementwise_batcher(reduce_p)
