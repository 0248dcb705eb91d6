"""mpi4jax 0.5 and 0.6 kept their token-free operations here, before they
became the top-level API (0.8): the same functions as mpijax's own."""

from .._src.ops.collectives import allgather, alltoall, barrier, bcast, gather, scatter
from .._src.ops.point_to_point import recv, send, sendrecv
from .._src.ops.reductions import allreduce, reduce, scan

__all__ = [
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather",
    "recv", "reduce", "scan", "scatter", "send", "sendrecv",
]  # fmt: skip
