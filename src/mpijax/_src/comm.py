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


def _duplicate_world(op):
    """A duplicate of COMM_WORLD with errors returned, so that mpijax's
    messages never match the user's own mpi4py messages. Collective: under
    the watchdog it is nonblocking, and bounded like any other call."""
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
                    "create mpijax's default communicator (each rank does when it imports mpijax)"
                )
            time.sleep(0)  # ranks may share cores
    else:
        comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


# Made when mpijax is imported, as MPI_Init is when mpi4py is: every rank
# imports it, at the same point of an SPMD program. Made at first use, a rank
# whose first use were tracing alone would wait for the others to make it;
# started at import but completed later, it raced Open MPI 4.1's blocking
# communicator constructors (a user's Split_type could hang).
_default = _duplicate_world("import") if MPI.Is_initialized() and not MPI.Is_finalized() else None


def default_comm(op="default_comm"):
    """mpijax's private duplicate of COMM_WORLD."""
    global _default
    if _default is None:  # MPI was initialised after mpijax was imported
        _default = _duplicate_world(op)
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
