"""Loads the C++ extension: checks that it runs on mpi4py's MPI library and
registers the FFI handlers with XLA."""

import os

import jax
from mpi4py import MPI  # initialises MPI before any handler can run

from .. import _core as core


def _first_line(text):
    return text.strip().splitlines()[0] if text.strip() else "unknown version"


def check_same_mpi(module_path, module_version):
    """Raise ImportError unless the shared object `module_path` (mpi4py's
    extension) resolves MPI to the same library file as mpijax's extension."""
    ours, our_version = core.mpi_library()
    theirs = core.mpi_library_of(module_path)
    differ = bool(theirs) and os.path.realpath(theirs) != os.path.realpath(ours)
    if differ or (MPI.Is_initialized() and not core.mpi_initialized()):
        raise ImportError(
            "mpijax and mpi4py run on different MPI libraries: mpijax's extension "
            f"uses {ours or 'an unknown library'} ({_first_line(our_version)}), "
            f"mpi4py uses {theirs or 'an unknown library'} "
            f"({_first_line(module_version)}). Rebuild one of them against the "
            "other's MPI, e.g. `pip install --no-binary=mpi4py --force-reinstall "
            "mpi4py` and then `pip install --force-reinstall mpijax` with the same "
            "mpicc on PATH."
        )


check_same_mpi(MPI.__file__, MPI.Get_library_version())

if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
    raise ImportError(
        "mpijax needs MPI initialised with at least MPI_THREAD_SERIALIZED (XLA "
        "runs the MPI calls on its own threads); mpi4py's default, "
        "mpi4py.rc.thread_level = 'multiple', does this."
    )

# Exit needs no hook of ours: JAX's atexit function waits for the runtime
# tokens of ordered effects, and mpi4py calls MPI_Finalize from Py_AtExit,
# which runs after every atexit function.
for _name, _capsule in core.ffi_targets().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def has_cuda_support():
    """Whether this build has the CUDA handlers (not yet: CPU only)."""
    return False
