"""bcast, gather, scatter, allgather, alltoall, barrier: data movement
between all ranks of a communicator."""

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import mpi_primitive


def _rank(params):
    return _comm.info(params["comm"]).rank


def _size(params):
    return _comm.info(params["comm"]).size


def _empty(x):
    return x.update(shape=(0,))


# A rank that has nothing to return gets an empty placeholder output.
bcast_p = mpi_primitive("bcast", lambda x, **p: [_empty(x) if _rank(p) == p["root"] else x])
gather_p = mpi_primitive(
    "gather", lambda x, **p: [x.update(shape=(_size(p), *x.shape)) if _rank(p) == p["root"] else _empty(x)]
)
scatter_p = mpi_primitive("scatter", lambda x, **p: [x.update(shape=x.shape[1:]) if _rank(p) == p["root"] else x])
allgather_p = mpi_primitive("allgather", lambda x, **p: [x.update(shape=(_size(p), *x.shape))])
alltoall_p = mpi_primitive("alltoall", lambda x, **p: [x])
barrier_p = mpi_primitive("barrier", lambda **p: [])


def _leading_axis(x, comm, message):
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(f"{message} must have shape (nproc, ...) with nproc={comm.size}; got shape {x.shape}")


def _rooted(name, x, root, comm):
    comm = _comm.resolve(comm, name)
    return dtypes.array(x, name), validation.rank(root, "root", comm, name), comm


def bcast(x, root, *, comm=None):
    """Broadcast `x` from `root`. Off the root, `x` only gives the shape and
    dtype of the result; on the root, `x` is returned."""
    x, root, comm = _rooted("bcast", x, root, comm)
    y = bcast_p.bind(x, comm=comm.id, root=root)[0]
    return x if comm.rank == root else y


def gather(x, root, *, comm=None):
    """Stack every rank's `x` on `root` (shape (nproc, *x.shape)). Off the
    root, `x` is returned unchanged."""
    x, root, comm = _rooted("gather", x, root, comm)
    y = gather_p.bind(x, comm=comm.id, root=root)[0]
    return y if comm.rank == root else x


def scatter(x, root, *, comm=None):
    """Send slice i of the root's `x` (shape (nproc, ...)) to rank i. Off the
    root, `x` only gives the shape and dtype of the result."""
    x, root, comm = _rooted("scatter", x, root, comm)
    if comm.rank == root:
        _leading_axis(x, comm, "mpijax.scatter: Scatter input on the root")
    return scatter_p.bind(x, comm=comm.id, root=root)[0]


def allgather(x, *, comm=None):
    """Stack every rank's `x` on every rank (shape (nproc, *x.shape))."""
    comm = _comm.resolve(comm, "allgather")
    x = dtypes.array(x, "allgather")
    return allgather_p.bind(x, comm=comm.id)[0]


def alltoall(x, *, comm=None):
    """Send slice i of `x` (shape (nproc, ...)) to rank i; slice j of the
    result comes from rank j."""
    comm = _comm.resolve(comm, "alltoall")
    x = dtypes.array(x, "alltoall")
    _leading_axis(x, comm, "mpijax.alltoall: Alltoall input")
    return alltoall_p.bind(x, comm=comm.id)[0]


def barrier(*, comm=None):
    """Block until every rank of `comm` has reached the barrier."""
    comm = _comm.resolve(comm, "barrier")
    barrier_p.bind(comm=comm.id)
