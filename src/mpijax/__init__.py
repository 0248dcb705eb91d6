"""MPI for JAX: MPI operations inside jax.jit, in program order."""

# tokens: the token API of mpi4jax < 0.8; jpi: JPI's; notoken and experimental.notoken: where mpi4jax
# 0.5-0.7 kept their token-free ops
from . import experimental, jpi, notoken, tokens  # noqa: F401
from ._src.gpu import bind_local_gpu
from ._src.ops.collectives import (
    allgather,
    allgatherv,
    alltoall,
    alltoallv,
    barrier,
    bcast,
    gather,
    gatherv,
    ragged_alltoall,
    scatter,
    scatterv,
)
from ._src.ops.neighbors import cart_neighbors, halo_exchange, neighbor_exchange
from ._src.ops.nonblocking import Request, ineighbor_exchange, irecv, isend, started, wait
from ._src.ops.point_to_point import recv, send, sendrecv
from ._src.ops.reductions import allreduce, exscan, reduce, reduce_scatter, scan, tree_allreduce, varying
from ._src.runtime import call_stats, has_cuda_support, has_sycl_support, set_check, set_cuda_aware, set_timeout
from ._src.seed_api import Allreduce, Recv, Send, Sendrecv  # mpi4jax 0.2

__version__ = "0.1.0"

__all__ = [
    "Allreduce",
    "Recv",
    "Request",
    "Send",
    "Sendrecv",
    "allgather",
    "allgatherv",
    "allreduce",
    "alltoall",
    "alltoallv",
    "barrier",
    "bcast",
    "bind_local_gpu",
    "call_stats",
    "cart_neighbors",
    "exscan",
    "gather",
    "gatherv",
    "halo_exchange",
    "has_cuda_support",
    "has_sycl_support",
    "ineighbor_exchange",
    "irecv",
    "isend",
    "neighbor_exchange",
    "ragged_alltoall",
    "recv",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
    "scatterv",
    "send",
    "sendrecv",
    "set_check",
    "set_cuda_aware",
    "set_timeout",
    "started",
    "tree_allreduce",
    "varying",
    "wait",
]
