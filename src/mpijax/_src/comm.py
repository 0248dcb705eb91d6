"""Communicators: the default one, and the small ids that compiled programs carry."""

import time
from typing import NamedTuple

from mpi4py import MPI

from .runtime import core


class CommInfo(NamedTuple):
    id: int  # key into the C++ registry, baked into the compiled program
    rank: int
    size: int


_infos: dict[int, CommInfo] = {}
_default = None


def default_comm(op="default_comm"):
    """mpijax's private duplicate of COMM_WORLD (collective on first use), so
    that its messages never match the user's own mpi4py messages. Under the
    watchdog the duplication is nonblocking and bounded like any other call."""
    global _default
    if _default is None:
        world = MPI.COMM_WORLD
        timeout = core.timeout()
        if timeout > 0:
            comm, request = world.Idup()
            deadline = time.monotonic() + timeout
            while not request.Test():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"mpijax.{op} on rank {world.Get_rank()} of {world.Get_size()} timed out after "
                        f"{timeout:g} s (MPIJAX_TIMEOUT) waiting for the other ranks of COMM_WORLD to "
                        "create mpijax's default communicator (their first mpijax call)"
                    )
                time.sleep(0)  # ranks may share cores
        else:
            comm = world.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        _default = comm
    return _default


def resolve(comm, op):
    """Validate `comm` (None means the default) and return its CommInfo."""
    if comm is None:
        comm = default_comm(op)
    if not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"mpijax.{op}: comm must be an mpi4py communicator (mpi4py.MPI.Comm), got {type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ValueError(f"mpijax.{op}: comm is MPI.COMM_NULL")
    if comm.Is_inter():
        raise TypeError(
            f"mpijax.{op}: comm must be an intracommunicator; inter-communicators "
            "are not supported (merge it with comm.Merge() first)"
        )
    cid = core.register_comm(comm)
    # Refreshed on every call: a freed handle can come back as another communicator.
    info = _infos[cid] = CommInfo(cid, comm.Get_rank(), comm.Get_size())
    return info


def info(cid):
    return _infos[cid]
