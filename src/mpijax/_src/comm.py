"""Communicators: the default one, and the small ids that compiled programs carry."""

import atexit
import sys
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


# Every rank starts duplicating COMM_WORLD when it imports mpijax, and the
# first use of the default communicator waits for it: so a rank whose first
# use is tracing alone, while the others are elsewhere, finds their part of
# this collective made already (any MPI call of theirs moves it on), instead
# of waiting for them to make it.
_duplicating = MPI.COMM_WORLD.Idup() if MPI.Is_initialized() and not MPI.Is_finalized() else None


def default_comm(op="default_comm"):
    """mpijax's private duplicate of COMM_WORLD, so that its messages never
    match the user's own mpi4py messages. Under the watchdog the wait for it
    is bounded like any other call."""
    global _default, _duplicating
    if _default is None:
        if _duplicating is None:  # MPI was initialised after mpijax was imported
            _duplicating = MPI.COMM_WORLD.Idup()
        comm, request = _duplicating
        timeout = core.timeout()
        if timeout > 0:
            deadline = time.monotonic() + timeout
            while not request.Test():
                if time.monotonic() > deadline:
                    world = MPI.COMM_WORLD
                    raise TimeoutError(
                        f"mpijax.{op} on rank {world.Get_rank()} of {world.Get_size()} timed out after "
                        f"{timeout:g} s (MPIJAX_TIMEOUT) waiting for the other ranks of COMM_WORLD to "
                        "create mpijax's default communicator (each rank starts it when it imports mpijax)"
                    )
                time.sleep(0)  # ranks may share cores
        else:
            request.Wait()
        _duplicating = None
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        _default = comm
    return _default


@atexit.register
def _finish_duplicating():
    """Open MPI 4.1 crashes in MPI_Finalize (which mpi4py calls after every
    atexit function) while the duplication is still pending."""
    if _duplicating is not None:
        try:
            default_comm("exit")
        except TimeoutError as error:
            print(f"mpijax: {error}", file=sys.stderr)


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
