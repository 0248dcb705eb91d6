"""allreduce, reduce, scan: element-wise reductions across ranks."""

from .. import comm as _comm
from .. import dtypes, validation
from ..primitive import mpi_primitive


def _same(x, **params):
    return [x]


def _in_place(x, **params):
    return {0: 0}


def _is_root(params):
    return _comm.info(params["comm"]).rank == params["root"]


# Off the root, reduce has nothing to return: its output is an empty placeholder.
allreduce_p = mpi_primitive("allreduce", _same, _in_place)
scan_p = mpi_primitive("scan", _same, _in_place)
reduce_p = mpi_primitive(
    "reduce",
    lambda x, **p: [x if _is_root(p) else x.update(shape=(0,))],
    lambda x, **p: {0: 0} if _is_root(p) else None,
)


def _prepare(x, op, comm, name):
    comm = _comm.resolve(comm, name)
    x = dtypes.array(x, name)
    return x, comm, dtypes.reduction_code(op, x.dtype, name)


def allreduce(x, op, *, comm=None):
    """Reduce `x` element-wise over all ranks with `op` (an MPI.Op such as
    MPI.SUM); every rank gets the result."""
    x, comm, code = _prepare(x, op, comm, "allreduce")
    return allreduce_p.bind(x, comm=comm.id, op=code)[0]


def reduce(x, op, root, *, comm=None):
    """Reduce `x` element-wise over all ranks onto `root`. Off the root, `x`
    is returned unchanged."""
    x, comm, code = _prepare(x, op, comm, "reduce")
    root = validation.rank(root, "root", comm, "reduce")
    y = reduce_p.bind(x, comm=comm.id, op=code, root=root)[0]
    return y if comm.rank == root else x


def scan(x, op, *, comm=None):
    """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r)."""
    x, comm, code = _prepare(x, op, comm, "scan")
    return scan_p.bind(x, comm=comm.id, op=code)[0]
