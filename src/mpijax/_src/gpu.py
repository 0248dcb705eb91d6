"""One GPU per rank."""

import os

import jax
from mpi4py import MPI

from . import jax_compat
from .runtime import core, has_cuda_support


def bind_local_gpu(comm=None):
    """Give this rank one GPU of its node and return its index: the rank's
    place among the ranks of `comm` (default COMM_WORLD) on the same node,
    modulo the node's GPUs (those in CUDA_VISIBLE_DEVICES, if set). Ranks that
    end up sharing a GPU each get an equal part of its memory
    (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set), instead of JAX's default of
    75 % for the first one. Call it on every rank before JAX starts (before
    the first array or jax.devices()): mpijax calls need one device per
    process."""
    if jax_compat.backends_initialized():
        raise RuntimeError(
            "mpijax.bind_local_gpu must be called before JAX starts its backends "
            "(before the first JAX array or jax.devices())"
        )
    if not has_cuda_support():
        raise RuntimeError("mpijax.bind_local_gpu: this build of mpijax has no CUDA handlers")
    node = (comm or MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
    rank, ranks = node.Get_rank(), node.Get_size()
    node.Free()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = len(visible.split(",")) if visible else core.cuda_device_count()
    if gpus == 0:
        raise RuntimeError("mpijax.bind_local_gpu: no CUDA device is visible to this process")
    gpu = rank % gpus
    sharing = len(range(gpu, ranks, gpus))
    if sharing > 1:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / sharing:.2f}")
    jax.config.update("jax_cuda_visible_devices", str(gpu))
    return gpu
