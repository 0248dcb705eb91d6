"""Runs under mpirun at any number of ranks: every rank runs the same tests in
the same order. Rank 0 reports as usual; the other ranks print only their
failures and a one-line tally, so a failure on any rank is visible."""

import collections
import os
import pathlib
import sys

import jax
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

jax.config.update("jax_enable_x64", True)
# The whole programs of examples/, importable by their tests (test_example_*.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

# MPIJAX_TEST_CACHE=DIR (scripts/test.sh): XLA's executables persist in DIR,
# so a later run skips compiling the programs an earlier one compiled (the
# same HLO, under the same jaxlib: the other MPI's run, most of all). Each
# rank has a folder of its own, as JAX does not write its entries atomically.
# mpijax's lowering still runs in every test: the key is the lowered program.
if os.environ.get("MPIJAX_TEST_CACHE"):
    jax.config.update("jax_compilation_cache_dir", f"{os.environ['MPIJAX_TEST_CACHE']}/rank-{RANK}")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


class _OtherRankReporter:
    def __init__(self):
        self.tally = collections.Counter()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            sys.stderr.write(f"\n[rank {RANK}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        if report.when == "call" or report.outcome != "passed":
            self.tally[report.outcome] += 1

    def pytest_sessionfinish(self, session, exitstatus):
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.tally.items()))
        sys.stderr.write(f"[rank {RANK} of {SIZE}] {counts}\n")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "launcher: starts mpirun itself; runs only in a process started without mpirun")
    config.addinivalue_line(
        "markers",
        "mpi_independent: checks what no MPI library enters into (JAX's runtimes, the API shims, "
        "the examples' own checks); scripts/test.sh runs it with Open MPI only",
    )
    if RANK != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
        config.pluginmanager.register(_OtherRankReporter(), "mpijax-other-rank")


def pytest_report_header(config):
    return f"MPI: {SIZE} rank(s); {MPI.Get_library_version().splitlines()[0]}"


@pytest.fixture
def watchdog():
    """MPIJAX_TIMEOUT for one test: a call that waits a minute raises (on
    the ranks that wait) instead of hanging the job."""
    mpijax.set_timeout(60)
    yield
    mpijax.set_timeout(None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if (yield).get_result().failed:
        item.mpijax_failed = True  # read by the comm fixture's teardown


_shared = None  # the comm fixture's communicator, while tests leave it clean


def _left_behind(comm, pending_before):
    """What a finished test left on `comm` for the next one to trip over."""
    if comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
        return "a message that no one received"
    if core.pending_requests() > pending_before:
        return "a request that no one waited for"
    if core.abandoned_by(core.register_comm(comm)):
        return "a collective that timed out"
    return None


@pytest.fixture
def comm(request):
    """A duplicate of COMM_WORLD, shared by consecutive tests: compiled
    programs name their communicator, so a shared one lets a test reuse what
    earlier ones compiled (its eager calls most of all). After a test that
    failed on any rank, or left a message unreceived, a request unwaited for
    or a collective timed out on it on any rank, every rank replaces it, so
    no test inherits another's leftovers."""
    global _shared
    if _shared is None:
        _shared = MPI.COMM_WORLD.Dup()
    c, pending_before, drained = _shared, core.pending_requests(), False
    try:
        yield c
        # Off the root, gather and reduce return x at once, so a test may end
        # with its calls still queued: freeing the communicator under them
        # would crash, as the README says of every communicator mpijax uses.
        mpijax.wait()
        drained = True
    finally:
        MPI.COMM_WORLD.Barrier()  # every rank's sends of the test are made: Iprobe sees them
        failed = getattr(request.node, "mpijax_failed", False) or not drained
        dirty = failed or _left_behind(c, pending_before)
        if MPI.COMM_WORLD.allreduce(bool(dirty), op=MPI.LOR):
            _shared = None
            c.Free()
