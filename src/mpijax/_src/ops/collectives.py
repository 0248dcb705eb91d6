"""bcast, gather, scatter, allgather, alltoall, barrier: data movement
between all ranks of a communicator."""

from jax.interpreters import ad, batching

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import batch_operands, linear_jvp, mpi_primitive


def _rank(params):
    return _comm.info(params["comm"]).rank


def _size(params):
    return _comm.info(params["comm"]).size


def _is_root(params):
    return _rank(params) == params["root"]


# Each primitive is a linear map with a real output on every rank, so that
# its transpose, and the transpose of that, are calls on every rank too.
# bcast: the root returns x; the others what they receive, plus their own x
# with accumulate=1 (the adjoint of reduce). In place everywhere: a loop
# carry then needs no copy.
bcast_p = mpi_primitive("bcast", lambda x, **p: [x], lambda x, **p: {0: 0})
# gather: off the root, x (identity=1, what mpi4jax returns) or zeros
# (identity=0, the adjoint of scatter).
gather_p = mpi_primitive(
    "gather",
    lambda x, **p: [x.update(shape=(_size(p), *x.shape)) if _is_root(p) else x],
    lambda x, **p: {0: 0} if not _is_root(p) and p["identity"] else None,
)
# scatter: off the root, x gives the shape, or is added to what is received
# with accumulate=1 (the adjoint of gather).
scatter_p = mpi_primitive(
    "scatter",
    lambda x, **p: [x.update(shape=x.shape[1:]) if _is_root(p) else x],
    lambda x, **p: {0: 0} if not _is_root(p) and p["accumulate"] else None,
)
allgather_p = mpi_primitive("allgather", lambda x, **p: [x.update(shape=(_size(p), *x.shape))])
alltoall_p = mpi_primitive("alltoall", lambda x, **p: [x])
barrier_p = mpi_primitive("barrier", lambda **p: [])


def _leading_axis(x, comm, message, detail=""):
    # `message` starts with mpi4jax's own words, which code written for it matches.
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(f"{message} must have shape (nproc, ...){detail} with nproc={comm.size}; got shape {x.shape}")


def _rooted(name, x, root, comm):
    comm = _comm.resolve(comm, name)
    return dtypes.array(x, name), validation.rank(root, "root", comm, name), comm


def bcast(x, root, *, comm=None, token=validation.NOTSET):
    """Broadcast `x` from `root`. Off the root, `x` only gives the shape and
    dtype of the result; on the root, `x` is returned."""
    validation.no_token(token, "bcast")
    x, root, comm = _rooted("bcast", x, root, comm)
    return bcast_p.bind(x, comm=comm.id, root=root, accumulate=0)[0]


def gather(x, root, *, comm=None, token=validation.NOTSET):
    """Stack every rank's `x` on `root` (shape (nproc, *x.shape)). Off the
    root, `x` is returned unchanged."""
    validation.no_token(token, "gather")
    x, root, comm = _rooted("gather", x, root, comm)
    return gather_p.bind(x, comm=comm.id, root=root, identity=1)[0]


def scatter(x, root, *, comm=None, token=validation.NOTSET):
    """Send slice i of the root's `x` (shape (nproc, ...)) to rank i. Off the
    root, `x` only gives the shape and dtype of the result."""
    validation.no_token(token, "scatter")
    x, root, comm = _rooted("scatter", x, root, comm)
    if comm.rank == root:
        _leading_axis(x, comm, "mpijax.scatter: Scatter input", " on the root")
    return scatter_p.bind(x, comm=comm.id, root=root, accumulate=0)[0]


def allgather(x, *, comm=None, token=validation.NOTSET):
    """Stack every rank's `x` on every rank (shape (nproc, *x.shape))."""
    validation.no_token(token, "allgather")
    comm = _comm.resolve(comm, "allgather")
    x = dtypes.array(x, "allgather")
    return allgather_p.bind(x, comm=comm.id)[0]


def alltoall(x, *, comm=None, token=validation.NOTSET):
    """Send slice i of `x` (shape (nproc, ...)) to rank i; slice j of the
    result comes from rank j."""
    validation.no_token(token, "alltoall")
    comm = _comm.resolve(comm, "alltoall")
    x = dtypes.array(x, "alltoall")
    _leading_axis(x, comm, "mpijax.alltoall: Alltoall input")
    return alltoall_p.bind(x, comm=comm.id)[0]


def barrier(*, comm=None, token=validation.NOTSET):
    """Block until every rank of `comm` has reached the barrier."""
    validation.no_token(token, "barrier")
    comm = _comm.resolve(comm, "barrier")
    barrier_p.bind(comm=comm.id)


for _prim in (bcast_p, gather_p, scatter_p, allgather_p, alltoall_p):
    ad.primitive_jvps[_prim] = linear_jvp(_prim)


# vmap: one call on the batch. The batch axis goes right after the rank axis
# of stacked arrays (gather/allgather results, scatter/alltoall inputs) and
# first everywhere else, so all ranks lay out their messages alike.
def _batcher(prim, operand_axis, output_axis):
    def rule(args, dims, **params):
        (x,) = batch_operands(args, dims, [operand_axis(params)])
        return prim.bind(x, **params), [output_axis(params)]

    return rule


def _stacked_here(params):
    return 1 if _is_root(params) else 0


batching.primitive_batchers[bcast_p] = _batcher(bcast_p, lambda p: 0, lambda p: 0)
batching.primitive_batchers[gather_p] = _batcher(gather_p, lambda p: 0, _stacked_here)
batching.primitive_batchers[scatter_p] = _batcher(scatter_p, _stacked_here, lambda p: 0)
batching.primitive_batchers[allgather_p] = _batcher(allgather_p, lambda p: 0, lambda p: 1)
batching.primitive_batchers[alltoall_p] = _batcher(alltoall_p, lambda p: 1, lambda p: 1)
