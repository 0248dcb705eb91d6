"""Loads the C++ extension: checks that it runs on mpi4py's MPI library,
registers the FFI handlers with XLA, and applies the MPIJAX_* settings."""

import numbers
import os
import sys
import time
import warnings

import jax
import numpy as np
from mpi4py import MPI  # initialises MPI before any handler can run

from . import environment

with warnings.catch_warnings():
    # mpi4py's objects larger than our extension was compiled for are only a
    # warning to Cython's import check; to us, reading MPI handles out of
    # them, they are an error (core.mpi4py_error).
    warnings.simplefilter("error", RuntimeWarning)
    from .. import _core as core


def _first_line(text):
    text = text.replace("\0", "").strip()  # Open MPI counts the terminating NUL in the version's length
    return text.splitlines()[0] if text else "unknown version"


def _same_file(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def check_same_mpi(module_path, module_version):
    """Raise ImportError unless mpijax's extension and the shared object
    `module_path` (mpi4py's extension) run on one MPI library: the same file
    provides MPI_Init to both, and mpi4py's objects have the layout that our
    extension was compiled for."""
    ours, our_version = core.mpi_library()
    theirs = core.mpi_library_of(module_path)
    how = "uses"
    if core.mpi4py_error:
        # Compiled for another layout: MPI's symbols may even resolve to
        # mpi4py's library at run time, so name the one we were built for.
        built, headers = core.built_for
        if theirs and _same_file(built, theirs):
            raise ImportError(
                f"mpijax was compiled against another build of mpi4py ({core.mpi4py_error}); "
                "rebuild it against the mpi4py installed here: in mpijax's source, "
                "`pip install scikit-build-core nanobind cmake ninja` and then "
                "`pip install --no-build-isolation --no-deps --force-reinstall .`"
            )
        ours, our_version, how = built, headers, "was compiled for"
    else:
        differ = bool(theirs) and not _same_file(theirs, ours)
        if not differ and core.mpi_initialized() == MPI.Is_initialized():
            return
    raise ImportError(
        f"mpijax and mpi4py run on different MPI libraries: mpijax's extension {how} "
        f"{ours or 'an unknown library'} ({_first_line(our_version)}), mpi4py uses "
        f"{theirs or 'an unknown library'} ({_first_line(module_version)}). Rebuild one of "
        "them against the other's MPI, e.g. `pip install --no-binary=mpi4py --no-cache-dir --force-reinstall "
        "mpi4py` and then, in mpijax's source, `pip install --no-deps --force-reinstall .`, with the same "
        "mpicc on PATH (or CMAKE_ARGS=-DMPI_C_COMPILER=/path/to/mpicc for mpijax)."
    )


check_same_mpi(MPI.__file__, MPI.Get_library_version())

if not MPI.Is_initialized() or MPI.Is_finalized():
    raise ImportError(
        "mpijax needs MPI initialised when it is imported (it makes its communicator then): with "
        "mpi4py.rc.initialize = False, call MPI.Init_thread() first"
    )
if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
    raise ImportError(
        "mpijax needs MPI initialised with at least MPI_THREAD_SERIALIZED (XLA "
        "runs the MPI calls on its own threads); mpi4py's default, "
        "mpi4py.rc.thread_level = 'multiple', does this."
    )

# Platform ("cpu", and "CUDA" in a CUDA build) -> {target name: handler}.
FFI_TARGETS = core.ffi_targets()
for _platform, _targets in FFI_TARGETS.items():
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def set_check(enabled=True):
    """Check mode: before each MPI call the ranks involved agree on what they
    are about to do (op, dtype, shape, root, tag), and a disagreement raises
    on each of them, saying which rank passed what, instead of hanging or
    corrupting data. Costs one small extra message per call. Takes effect for
    every call dispatched after it, also in compiled functions; it first waits
    until the calls dispatched before it have run (mpijax.wait()). Set it
    alike on every rank (the agreement is itself a message). Same as
    MPIJAX_CHECK=1."""
    if not isinstance(enabled, numbers.Integral | np.bool_):  # bool is an Integral
        raise TypeError(
            f"mpijax.set_check: enabled must be True or False, got {enabled!r}"
            + (" (MPIJAX_CHECK reads words; set_check takes a bool)" if isinstance(enabled, str) else "")
        )
    # A queued call reads the setting when it runs: were it changed under
    # it, one rank could send the agreement's message to a rank that makes
    # the plain call, which takes it for its data.
    jax.effects_barrier()
    core.set_check(bool(enabled))


def set_timeout(seconds):
    """The watchdog: an MPI call that waits longer than `seconds` raises,
    naming the op, the rank and whom it waits for. None or 0 waits forever.
    Takes effect for every call dispatched after it, also in compiled
    functions; it first waits until the calls dispatched before it have run
    (mpijax.wait()). Set it alike on every rank: with a timeout the
    nonblocking forms of the collectives run, and MPI never matches a
    blocking collective with a nonblocking one. Same as
    MPIJAX_TIMEOUT=seconds."""
    if seconds is not None and (isinstance(seconds, bool | np.bool_) or not isinstance(seconds, numbers.Real)):
        raise TypeError(f"mpijax.set_timeout: seconds must be a number or None, got {seconds!r}")
    seconds = 0.0 if seconds is None else float(seconds)
    if not seconds >= 0:
        raise ValueError(f"mpijax.set_timeout: seconds must be >= 0 or None, got {seconds}")
    # A queued call reads the setting when it runs: were it changed under
    # it, one rank could run a collective's blocking form against another
    # rank's nonblocking one (which MPI never matches), and hang.
    jax.effects_barrier()
    core.set_timeout(seconds)


def call_stats(*, reset=False):
    """Counts of MPI calls made by this process's handlers: `calls`,
    `in_flight` (now), `max_in_flight` (the most at once, which program
    order keeps at 1) and `device_pointer_calls` (those that handed MPI
    device memory: CUDA-aware mode; 0 on the CPU). `reset=True` zeroes all
    but in_flight after reading them."""
    stats = core.stats()
    if reset:
        core.reset_stats()
    return stats


def has_cuda_support():
    """Whether this build has the CUDA handlers (built when CMake finds the
    CUDA toolkit), so that MPI calls run on arrays on NVIDIA GPUs."""
    return "CUDA" in FFI_TARGETS


def has_sycl_support():
    """Always False: mpijax has no SYCL (Intel GPU) handlers. Kept for code
    written for mpi4jax, which asks."""
    return False


def set_cuda_aware(enabled=True):
    """CUDA-aware mode: MPI moves device memory itself, instead of mpijax
    staging it through pinned host memory (the default). Needs an MPI library
    built with CUDA support: refused if the library says it has none. Takes
    effect at once, also for compiled functions; set it alike on every rank.
    Same as MPIJAX_CUDA_AWARE=1 (or mpi4jax's MPI4JAX_USE_CUDA_MPI=1)."""
    _set_cuda_aware(bool(enabled), "do not call mpijax.set_cuda_aware(True)")


def _set_cuda_aware(enabled, instead):
    if enabled and not has_cuda_support():
        raise RuntimeError("mpijax.set_cuda_aware: this build of mpijax has no CUDA handlers")
    if enabled and core.cuda_aware_mpi() == 0:
        library = _first_line(MPI.Get_library_version())
        raise RuntimeError(
            f"mpijax: CUDA-aware mode was asked for, but the MPI library ({library}) says it cannot "
            f"move device memory. Use an MPI built with CUDA support, or {instead}: mpijax then stages "
            "device data through pinned host memory."
        )
    if has_cuda_support():
        core.set_cuda_aware(enabled)


def _settings_from_environment():
    core.set_logging(environment.flag("MPIJAX_DEBUG", "MPI4JAX_DEBUG"))
    set_check(environment.flag("MPIJAX_CHECK"))
    names = ("MPIJAX_CUDA_AWARE", "MPI4JAX_USE_CUDA_MPI")
    if has_cuda_support():  # a CPU-only build has no device memory to be aware of
        _set_cuda_aware(environment.flag(*names), f"unset {environment.deciding(*names)}")
    timeout = os.environ.get("MPIJAX_TIMEOUT", "")
    try:
        set_timeout(float(timeout) if timeout else None)
    except ValueError:
        raise ValueError(f"MPIJAX_TIMEOUT must be a number of seconds, got {timeout!r}") from None


def _abort_after(previous_hook):
    """An uncaught exception ends this rank, while the others may wait for it
    forever in an MPI call: after the usual traceback, abort the whole job."""

    def hook(kind, value, traceback):
        previous_hook(kind, value, traceback)
        world = MPI.COMM_WORLD
        if world.Get_size() > 1 and not MPI.Is_finalized():
            sys.stderr.write(
                f"mpijax: rank {world.Get_rank()} of {world.Get_size()} ended with an uncaught "
                f"{kind.__name__}; aborting the job so that the other ranks do not wait for it "
                "(MPIJAX_ABORT_ON_EXCEPTION=0 turns this off)\n"
            )
            sys.stderr.flush()
            # MPICH's launcher drops output it has not forwarded yet when the
            # job aborts: let it forward the traceback and this message first.
            time.sleep(0.5)
            world.Abort(1)

    return hook


_settings_from_environment()
if environment.flag("MPIJAX_ABORT_ON_EXCEPTION", default=True):
    sys.excepthook = _abort_after(sys.excepthook)
