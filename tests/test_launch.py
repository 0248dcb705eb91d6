"""Whole programs under their own mpirun: clean exit with MPI work still
queued, the debug environment variables, and the README's example. These run
in a pytest started without mpirun (`pytest -m launcher`)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from reference import SIZE, fresh_job_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
# More ranks than cores: Open MPI 4 reads the first, Open MPI 5 (PRRTE) the second.
OVERSUBSCRIBE = {"OMPI_MCA_rmaps_base_oversubscribe": "1", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.skipif(
        SIZE > 1 or any(k.startswith(("OMPI_COMM_WORLD", "PMI_RANK", "PMIX_RANK")) for k in os.environ),
        reason="starts its own mpirun: run in a pytest started without mpirun",
    ),
]


def mpirun(tmp_path, source, n=2, env=None, timeout=120):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source))
    clean = fresh_job_env() | OVERSUBSCRIBE | (env or {})
    launcher = os.environ.get("MPIJAX_MPIRUN") or shutil.which("mpirun")  # MPICH: mpirun.mpich
    command = [launcher, "-n", str(n), sys.executable, str(script)]
    return subprocess.run(command, env=clean, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def run_example(tmp_path, path, n=2, args=()):
    """Run the example at `path` unchanged on n ranks, with command-line
    `args`, in tmp_path; return (result, each rank's stdout): mpirun would
    interleave the ranks' output arbitrarily."""
    wrapper = f"""
        import os, runpy, sys
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["PMI_RANK"]
        sys.stdout = open(f"stdout.{{rank}}", "w")
        sys.argv = [{str(path)!r}, *{list(args)!r}]
        runpy.run_path({str(path)!r}, run_name="__main__")
        """
    result = mpirun(tmp_path, wrapper, n=n)
    return result, [(tmp_path / f"stdout.{r}").read_text() if result.returncode == 0 else "" for r in range(n)]


def test_exit_right_after_dispatching_send_and_recv(tmp_path):
    """Both ranks return from Python with their 8 MiB send/recv and a
    collective still queued (rank 1 posts its receive a second late, so rank
    0's send cannot have finished); all must finish before MPI_Finalize."""
    result = mpirun(
        tmp_path,
        """
        import time
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import mpijax
        rank = MPI.COMM_WORLD.Get_rank()
        x = jnp.arange(2 * 2**20, dtype=jnp.float32)
        if rank == 0:
            jax.jit(lambda x: mpijax.send(x, 1))(x)
        else:
            time.sleep(1)
            jax.jit(lambda x: mpijax.recv(x, 0))(x)
        mpijax.allreduce(x, MPI.SUM)
        print(f"rank {rank} leaves", flush=True)
        """,
    )
    assert result.returncode == 0, result.stderr
    # MPICH's hydra may join the ranks' lines ("rank 0 leavesrank 1 leaves")
    assert sorted(re.findall(r"rank (\d) leaves", result.stdout)) == ["0", "1"], result.stdout


def test_requests_never_waited_for_are_reported_at_exit(tmp_path):
    """Requests dropped where trace-time checks cannot see it: by eager
    code, by the branch of a lax.cond that runs, after a loop carried one out
    of a jitted function. Each rank says so when Python exits, and the job
    still ends."""
    result = mpirun(
        tmp_path,
        """
        import jax
        import jax.numpy as jnp
        from jax import lax
        from mpi4py import MPI
        import mpijax
        rank = MPI.COMM_WORLD.Get_rank()
        mpijax.irecv(jnp.zeros(2), 1 - rank, tag=4)  # never sent, never waited for
        mpijax.wait(mpijax.isend(jnp.ones(2), 1 - rank))  # waited for: not reported
        mpijax.irecv(jnp.zeros(2), 1 - rank)  # the message above, never waited for
        started = lambda: mpijax.irecv(jnp.zeros(2), 1 - rank, tag=5)  # never sent
        waits = lambda go: lax.cond(go, mpijax.wait, lambda r: jnp.zeros(2), started())
        jax.jit(waits)(False)  # the branch that runs drops it
        jax.jit(lambda: lax.fori_loop(0, 2, lambda i, r: r, started()))()  # carried out, dropped
        """,
    )
    assert result.returncode == 0, result.stderr
    reports = re.findall(r"mpijax: (\d+) request\(s\) started by .*? never waited for", result.stderr)
    assert reports == ["4", "4"], result.stderr


@pytest.mark.mpi_independent
@pytest.mark.parametrize(
    "env",
    [{"JAX_CPU_ENABLE_ASYNC_DISPATCH": "0"}, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}],
    ids=["synchronous dispatch", "two local devices"],
)
def test_order_and_dispatch_tests_in_other_runtimes(env):
    """The order and dispatch tests again, with the CPU client running each
    execution before dispatch returns, and with two local devices (where the
    seal cannot know which device a program runs on, so programs keep JAX's
    runtime token, and MPI programs on either device stay in order)."""
    launcher = os.environ.get("MPIJAX_MPIRUN") or shutil.which("mpirun")
    tests = [str(ROOT / "tests" / name) for name in ("test_ordering.py", "test_dispatch.py")]
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), env.get("XLA_FLAGS")]))
    job = fresh_job_env() | {"MPIJAX_TIMEOUT": "60"} | env | ({"XLA_FLAGS": flags} if flags else {})
    command = [
        launcher,
        "-n",
        "2",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--color=no",
        "-p",
        "no:cacheprovider",
        *tests,
    ]
    result = subprocess.run(command, env=job, capture_output=True, text=True, timeout=600, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert re.search(r"\d+ passed", result.stdout), result.stdout[-2000:]


def test_mpijax_in_a_program_that_initialises_jax_distributed(tmp_path):
    """A program that also runs JAX's multi-process runtime (gloo, one CPU
    device per process, every process seeing all of them): MPI calls on the
    process's own arrays give NumPy's results, eager, jitted and under jvp,
    and keep the fast path; a jitted MPI call on an array sharded over the
    processes is refused on every rank, naming the call, as on several local
    devices."""
    result = mpirun(
        tmp_path,
        """
        import socket
        import jax
        import numpy as np
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{comm.bcast(port)}", num_processes=size, process_id=rank)
        import jax.numpy as jnp
        from jax._src.interpreters import pxla
        from jax.sharding import NamedSharding, PartitionSpec
        import mpijax

        assert len(jax.devices()) == size and len(jax.local_devices()) == 1
        xs = [np.arange(5.0) * (r + 1) + r for r in range(size)]
        x = jnp.asarray(xs[rank])
        prev, next = (rank - 1) % size, (rank + 1) % size
        np.testing.assert_array_equal(mpijax.allreduce(x, MPI.SUM), sum(xs))
        step = jax.jit(lambda x: (mpijax.allreduce(x, MPI.MAX), mpijax.sendrecv(x, x, prev, next)))
        top, left = step(x)
        np.testing.assert_array_equal(top, np.max(xs, axis=0))
        np.testing.assert_array_equal(left, xs[prev])
        _, tangent = jax.jvp(lambda x: mpijax.allreduce(x, MPI.SUM), (x,), (jnp.full(5, rank + 1.0),))
        np.testing.assert_array_equal(tangent, np.full(5, size * (size + 1) / 2))

        python_path = [0]
        execute = pxla.ExecuteReplicated.__call__
        def counted(self, *args):
            python_path[0] += 1
            return execute(self, *args)
        pxla.ExecuteReplicated.__call__ = counted
        for _ in range(3):
            jax.block_until_ready(step(x))
        assert python_path[0] == 0, python_path

        mesh = jax.make_mesh((size,), ("p",))
        spread = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("p")), xs[rank])
        try:
            jax.jit(lambda a: mpijax.allreduce(a, MPI.SUM))(spread)
            raise AssertionError("an MPI call on an array over several processes' devices ran")
        except ValueError as e:
            assert f"MPI calls (allreduce) would run on {size} devices" in str(e), e
        mpijax.wait()
        jax.distributed.shutdown()
        print(f"rank {rank} ok", flush=True)
        """,
        n=3,
        env={"MPIJAX_TIMEOUT": "60"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert sorted(re.findall(r"rank (\d) ok", result.stdout)) == ["0", "1", "2"], result.stdout


@pytest.mark.parametrize("timeout", ["0", "30"])
def test_one_rank_traces_before_any_mpijax_call(tmp_path, timeout):
    """Printing a function's jaxpr or HLO on rank 0 alone, as its first use of
    mpijax, while the others wait in a barrier: tracing makes no MPI call, and
    the default communicator, which every rank started at import, is there."""
    program = """
        from mpi4py import MPI
        import jax
        import jax.numpy as jnp
        import mpijax
        rank = MPI.COMM_WORLD.Get_rank()
        f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM))
        x = jnp.arange(3.0)
        if rank == 0:
            jax.make_jaxpr(f)(x)
            jax.eval_shape(f, x)
            f.lower(x).compile()
        MPI.COMM_WORLD.Barrier()
        with open(f"total.{rank}", "w") as out:
            out.write(str(f(x).tolist()))
        """
    result = mpirun(tmp_path, program, n=3, env={"MPIJAX_TIMEOUT": timeout}, timeout=120)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert (tmp_path / f"total.{rank}").read_text() == "[0.0, 3.0, 6.0]"


def test_user_communicators_and_world_right_after_import(tmp_path):
    """Right after the import, the user's own communicator constructors and
    mpijax's nonblocking collectives on COMM_WORLD itself (under the
    watchdog): with mpijax's duplication of COMM_WORLD still pending there,
    Open MPI 4.1 hung in the first and corrupted memory in the second, in most
    runs. Three rounds per job, to meet it."""
    program = """
        from mpi4py import MPI
        import jax
        import jax.numpy as jnp
        import mpijax
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        cart = world.Create_cart([world.Get_size()], periods=[True])
        def step(i, x):
            return mpijax.allreduce(x, MPI.SUM, comm=world) / 3
        steps = jax.jit(lambda x: jax.lax.fori_loop(0, 200, step, x))
        total = [float(steps(jnp.ones(())).block_until_ready()) for _ in range(3)]
        with open(f"total.{world.Get_rank()}", "w") as out:
            out.write(str(total))
        node.Free()
        cart.Free()
        """
    for _ in range(3):
        result = mpirun(tmp_path, program, n=3, env={"MPIJAX_TIMEOUT": "30"}, timeout=120)
        assert result.returncode == 0, result.stderr
        for rank in range(3):
            assert (tmp_path / f"total.{rank}").read_text() == str([1.0] * 3)


def test_an_export_loaded_where_its_communicator_id_names_other_ranks_raises(tmp_path):
    """An exported program names a communicator by the order in which the
    process first used it. A job that loads it after first using a
    communicator of another size in that place must raise, not run on that
    one (it summed over both ranks instead of one); one that uses the same
    communicators in the same order runs it."""
    program = """
        import os
        from mpi4py import MPI
        import jax
        import jax.numpy as jnp
        from jax import export
        import mpijax
        world = MPI.COMM_WORLD
        rank = world.Get_rank()
        alone, everyone = world.Split(rank), world.Dup()
        role = os.environ["ROLE"]
        x = jnp.ones(3)
        for comm in (everyone, alone) if role == "other order" else (alone, everyone):
            mpijax.allreduce(x, MPI.SUM, comm=comm)
        if role == "export":
            checks = [export.DisabledSafetyCheck.custom_call("mpijax_allreduce")]
            f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=alone))
            exported = export.export(f, disabled_checks=checks)(x)
            if rank == 0:
                open("exported", "wb").write(exported.serialize())
        else:
            try:
                out = str(export.deserialize(open("exported", "rb").read()).call(x).tolist())
            except Exception as e:
                out = str(e)
            open(f"out.{rank}", "w").write(out)
        """
    for role in ("export", "same order", "other order"):
        result = mpirun(tmp_path, program, env={"ROLE": role, "MPIJAX_TIMEOUT": "30"})
        assert result.returncode == 0, result.stderr
        if role != "export":
            outs = [(tmp_path / f"out.{rank}").read_text() for rank in range(2)]
            if role == "same order":
                assert outs == [str([1.0] * 3)] * 2
            else:
                for out in outs:
                    assert "made for a communicator of size 1, and its id names one of size 2 here" in out, out
                    assert "use the same communicators in the same order" in out, out


@pytest.mark.parametrize("variable,on,off", [("MPIJAX_DEBUG", "1", "0"), ("MPI4JAX_DEBUG", "True", "off")])
def test_debug_environment_variable(tmp_path, variable, on, off):
    program = """
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        import mpijax
        jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM))(jnp.ones(3, jnp.float32)).block_until_ready()
        """
    result = mpirun(tmp_path, program, env={variable: on})
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        # not anchored to line ends: MPICH's hydra may join the ranks' lines
        assert re.search(rf"mpijax r{rank} \| allreduce \| op SUM \| 3 x float32 \| 12 B \| [\d.]+ us", result.stderr)
    quiet = mpirun(tmp_path, program, env={variable: off})
    assert quiet.returncode == 0, quiet.stderr
    assert "mpijax r" not in quiet.stderr


def test_readme_example(tmp_path):
    result, out = run_example(tmp_path, ROOT / "examples" / "hello.py")
    assert result.returncode == 0, result.stderr
    assert out == [
        "rank 0/2: global sum [10.0, 12.0, 14.0, 16.0], from rank 1: [10.0, 11.0, 12.0, 13.0]\n",
        "rank 1/2: global sum [10.0, 12.0, 14.0, 16.0], from rank 0: [0.0, 1.0, 2.0, 3.0]\n",
    ]


@pytest.mark.mpi_independent
def test_the_shallow_water_example_writes_its_pictures(tmp_path):
    """The job of the README's first command, small: rank 0 reports the
    decomposition, progress and steps per second and writes the picture and
    the animation; the other rank prints nothing. --every longer than --days
    runs --days."""
    args = ["--n", "32", "--days", "0.5", "--every", "1", "--animate"]
    result, out = run_example(tmp_path, ROOT / "examples" / "shallow_water.py", args=args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.match(r"32 x 32 cells on 2 x 1 ranks \(cpu\), \d+ steps of \d+ s\n", out[0]), out[0]
    assert re.search(r"^day  0\.\d+ +\d+ steps/s  energy change [-+]\d\.\de-\d+  mass change", out[0], re.M), out[0]
    assert re.search(r"^day  0\.50 .*\n.* steps/s \(", out[0], re.M), out[0]
    assert "wrote shallow_water.png\nwrote shallow_water.gif\n" in out[0], out[0]
    assert out[1] == ""
    assert (tmp_path / "shallow_water.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "shallow_water.gif").read_bytes()[:4] == b"GIF8"


@pytest.mark.mpi_independent
def test_the_poisson_example_refuses_a_grid_smaller_than_the_ranks(tmp_path):
    result, _ = run_example(tmp_path, ROOT / "examples" / "poisson_cg.py", n=3, args=["--n", "2"])
    assert result.returncode != 0
    assert "--n 2 leaves some of the 3 x 1 blocks without cells" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in MPI library")
def test_import_check_names_both_mpi_libraries(tmp_path):
    """A module that resolves MPI_Init to another library (a stand-in built
    here) is reported with both libraries named."""
    import ctypes

    from mpijax._src import runtime

    (tmp_path / "fakempi.c").write_text("int MPI_Init(int *c, char ***v) { return 0; }\n")
    (tmp_path / "module.c").write_text("int MPI_Init(int *c, char ***v);\nint touch(void) { return MPI_Init(0, 0); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", "libfakempi.so", "fakempi.c"], cwd=tmp_path, check=True)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", "module.so", "module.c", "-L.", "-lfakempi", "-Wl,-rpath," + str(tmp_path)],
        cwd=tmp_path,
        check=True,
    )
    module = str(tmp_path / "module.so")
    ctypes.CDLL(module)
    ours, _ = runtime.core.mpi_library()
    with pytest.raises(ImportError) as error:
        runtime.check_same_mpi(module, "Stand-in MPI 9.9\nsecond line")
    message = str(error.value)
    assert str(tmp_path / "libfakempi.so") in message and "Stand-in MPI 9.9" in message
    assert ours in message and "second line" not in message
    runtime.check_same_mpi(runtime.MPI.__file__, runtime.MPI.Get_library_version())  # the real pair agrees


def test_import_check_of_an_extension_compiled_against_another_mpi4py(monkeypatch):
    """mpi4py's objects of another layout than the extension was compiled
    for, on the same MPI library (another mpi4py version): the ImportError
    says to rebuild mpijax against the mpi4py installed. No second mpi4py
    build is at hand, so the extension's own report of the failed
    import_mpi4py() is stood in for; the libraries are the real ones."""
    import types

    from mpijax._src import runtime

    library, headers = runtime.core.mpi_library()
    core = types.SimpleNamespace(
        mpi_library=runtime.core.mpi_library,
        mpi_library_of=runtime.core.mpi_library_of,
        mpi4py_error="mpi4py.MPI.Comm size changed, may indicate binary incompatibility",
        built_for=(library, headers),
    )
    monkeypatch.setattr(runtime, "core", core)
    with pytest.raises(ImportError, match=r"compiled against another build of mpi4py \(mpi4py\.MPI\.Comm size changed"):
        runtime.check_same_mpi(runtime.MPI.__file__, runtime.MPI.Get_library_version())
    core.built_for = ("/elsewhere/libmpi.so", "Other MPI 1.0")  # compiled for another library: named
    named = r"mpijax's extension was compiled for /elsewhere/libmpi\.so \(Other MPI 1\.0\)"
    with pytest.raises(ImportError, match=named):
        runtime.check_same_mpi(runtime.MPI.__file__, runtime.MPI.Get_library_version())


@pytest.mark.skipif(
    not os.environ.get("MPIJAX_OTHER_MPI4PY"),
    reason="needs MPIJAX_OTHER_MPI4PY: site-packages holding an mpi4py built on another MPI (scripts/test.sh sets it)",
)
def test_import_check_with_mpi4py_built_on_another_mpi(tmp_path):
    """This mpijax with an mpi4py built on the other MPI library (the one the
    test script installed for the other stage): a clear ImportError naming
    both library files, not a crash or a binary-layout error."""
    other = pathlib.Path(os.environ["MPIJAX_OTHER_MPI4PY"]) / "mpi4py"
    (tmp_path / "mpi4py").symlink_to(other)
    env = fresh_job_env()
    env["PYTHONPATH"] = str(tmp_path)
    code = "import mpi4py, mpijax._src.runtime as r; print(mpi4py.__file__)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: mpijax and mpi4py run on different MPI libraries"), result.stderr
    libraries = re.findall(r"(?:uses|compiled for) (/\S+) \(", message)
    assert len(libraries) == 2 and libraries[0] != libraries[1], message


def test_import_before_mpi_is_initialised_raises():
    """mpi4py.rc.initialize = False leaves MPI uninitialised: an ImportError
    saying what to do, not Open MPI's abort of the process."""
    code = "import mpi4py; mpi4py.rc.initialize = False; import mpijax"
    result = subprocess.run(
        [sys.executable, "-c", code], env=fresh_job_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("ImportError: mpijax needs MPI initialised when it is imported")
    ), result.stderr[-2000:]


def test_import_under_mpi_thread_funneled_raises():
    """XLA makes the MPI calls on threads of its own: an MPI initialised at
    MPI_THREAD_FUNNELED (which mpi4jax accepts) gets an ImportError that says
    what to set."""
    code = "import mpi4py; mpi4py.rc.thread_level = 'funneled'; import mpijax"
    result = subprocess.run(
        [sys.executable, "-c", code], env=fresh_job_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mpijax needs MPI initialised with at least MPI_THREAD_SERIALIZED"), last
    assert "mpi4py.rc.thread_level = 'multiple'" in result.stderr


@pytest.mark.parametrize("variable", ["MPIJAX_CUDA_AWARE", "MPI4JAX_USE_CUDA_MPI"])
def test_cuda_aware_mode_from_the_environment(tmp_path, variable):
    """Asked for with an MPI that says it cannot move device memory, CUDA-aware
    mode is refused at import with the reason; a CPU-only build ignores it."""
    from mpijax._src import runtime

    env = fresh_job_env()
    env[variable] = "1"
    code = "import mpijax; print(mpijax._src.runtime.core.cuda_aware() if mpijax.has_cuda_support() else 'cpu')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if not runtime.has_cuda_support():
        assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr
    elif runtime.core.cuda_aware_mpi() == 0:
        assert result.returncode != 0
        refusal = result.stderr.strip().splitlines()[-1]
        assert "says it cannot move device memory" in refusal and f"or unset {variable}:" in refusal, result.stderr
    else:
        assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr


# Which GPU of two each of 3 ranks gets, and the memory fraction that a shared
# one's ranks get, binding over COMM_WORLD or over a communicator of ranks {0, 2}
# and {1}.
BINDINGS = {"world": ([0, 1, 0], ["0.45", None, "0.45"]), "split": ([0, 0, 1], [None] * 3)}


@pytest.mark.parametrize("over", BINDINGS)
def test_bind_local_gpu_spreads_the_ranks_over_the_visible_gpus(tmp_path, over):
    """The choice of GPU, without one: JAX is told the GPU's index among
    CUDA_VISIBLE_DEVICES (here two), and the CPU backend runs the rest."""
    from mpijax._src import runtime

    if not runtime.has_cuda_support():
        pytest.skip("bind_local_gpu needs a build with CUDA handlers")
    comm = "MPI.COMM_WORLD" if over == "world" else "MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() % 2)"
    program = """
        import os
        os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        from mpi4py import MPI
        import mpijax
        gpu = mpijax.bind_local_gpu(BIND_OVER)
        import jax
        import jax.numpy as jnp
        total = mpijax.allreduce(jnp.ones(()), MPI.SUM)
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        with open(f"bound.{MPI.COMM_WORLD.Get_rank()}", "w") as f:  # mpirun may interleave stdout
            f.write(f"{gpu} {jax.config.values['jax_cuda_visible_devices']} {fraction} {int(total)}")
        """.replace("BIND_OVER", comm)
    result = mpirun(tmp_path, program, n=3, env={"CUDA_VISIBLE_DEVICES": "4,6", "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    gpus, fractions = BINDINGS[over]
    for rank, (gpu, fraction) in enumerate(zip(gpus, fractions, strict=True)):
        assert (tmp_path / f"bound.{rank}").read_text() == f"{gpu} {gpu} {fraction} 3", rank


@pytest.mark.mpi_independent
@pytest.mark.parametrize("n", [4, 3])
def test_jpi_intro_example(tmp_path, n):
    """JPI's README example on mpijax.jpi: each rank's line against the math.
    Rank 0 holds 0..2n-1, rank r gets block [2r, 2r+1] and the last rank
    doubles its block, so the total counts the last block twice; the gradient
    reaches rank 0's array only, 2 on the last block."""
    result, out = run_example(tmp_path, ROOT / "examples" / "jpi_intro.py", n)
    assert result.returncode == 0, result.stderr
    total = sum(range(2 * n)) + (2 * n - 2) + (2 * n - 1)
    gradient = [np.r_[np.ones(2 * n - 2), 2, 2] if r == 0 else np.zeros(2 * n) for r in range(n)]
    expected = [
        f"Rank {r} has result {np.float32(total)} and gradient {gradient[r].astype(np.float32)}\n" for r in range(n)
    ]
    assert out == expected
    if n == 4:  # what JPI's README says it prints
        assert out[0] == "Rank 0 has result 41.0 and gradient [1. 1. 1. 1. 1. 1. 2. 2.]\n"
        assert out[3] == "Rank 3 has result 41.0 and gradient [0. 0. 0. 0. 0. 0. 0. 0.]\n"


@pytest.mark.mpi_independent
def test_jpi_module_leaves_x64_alone():
    """JPI's import turns on jax_enable_x64; mpijax.jpi's does not."""
    code = "import jax, mpijax.jpi; print(jax.config.jax_enable_x64)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=fresh_job_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


@pytest.mark.mpi_independent
@pytest.mark.parametrize(
    "fake_version,silence,warns",
    [(None, "", False), ("0.99.0", "", True), ("0.99.0", "1", False)],
    ids=["this_jax", "untested", "untested_silenced"],
)
def test_import_warns_about_an_untested_jax(fake_version, silence, warns):
    """`import mpijax` warns under a JAX outside the tested range (faked
    here), not under this one, and not with MPIJAX_UNTESTED_JAX=1."""
    fake = f"jax.__version__ = {fake_version!r}; " if fake_version else ""
    code = f"import jax; {fake}import mpijax"
    env = fresh_job_env() | {"MPIJAX_UNTESTED_JAX": silence}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("UserWarning: mpijax was tested with JAX" in result.stderr) == warns, result.stderr


SEED = ROOT / "examples" / "seed"


@pytest.mark.mpi_independent
@pytest.mark.parametrize("n", [2, 4])
def test_seed_global_sum(tmp_path, n):
    """mpi4jax's README example on the token API: rank 0 prints the sum of ranks."""
    result, out = run_example(tmp_path, SEED / "global_sum.py", n)
    assert result.returncode == 0, result.stderr
    assert [float(v) for v in re.findall(r"[\d.]+", out[0])] == [n * (n - 1) / 2] * 9  # 6s on 4 ranks
    assert out[1:] == [""] * (n - 1)


@pytest.mark.mpi_independent
@pytest.mark.parametrize("n", [2, 4])
def test_seed_send_recv_with_tokens(tmp_path, n):
    result, out = run_example(tmp_path, SEED / "send_recv_tokens.py", n)
    assert result.returncode == 0, result.stderr
    assert out == [f"{r} [{r ^ 1} {r ^ 1} {r ^ 1}]\n" for r in range(n)]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("n", [2, 4])
def test_seed_capitalised_api(tmp_path, n):
    """mpi4jax 0.2's README example with `import mpijax as mpi4jax`."""
    result, out = run_example(tmp_path, SEED / "capitalised_api.py", n)
    assert result.returncode == 0, result.stderr
    assert out == [f"rank {r}: Allreduce {float(n)}, jitted {float(n)}\n" for r in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_seed_mpi4py_and_mpijax_on_separate_communicators(tmp_path, n):
    """Each odd rank checks what it received (the example asserts) and says so."""
    result, out = run_example(tmp_path, SEED / "mpi4py_and_mpijax.py", n)
    assert result.returncode == 0, result.stderr
    assert out == [
        "" if r % 2 == 0 else f"rank {r}: received from rank {r - 1} what it sent, through mpijax and mpi4py\n"
        for r in range(n)
    ]


# Faults: a job whose rank fails must end, with a message, never hang. -------

FAULT_PREAMBLE = """
    import os, signal, sys, time
    import jax, jax.numpy as jnp
    from mpi4py import MPI
    import mpijax
    rank = MPI.COMM_WORLD.Get_rank()
    """

FAULTS = {
    # rank 1 raises while rank 0 waits for it in an allreduce
    "uncaught exception": (
        "if rank == 1: raise RuntimeError('boom')\nmpijax.allreduce(jnp.ones(2), MPI.SUM)",
        {},
        r"mpijax: rank 1 of 2 ended with an uncaught RuntimeError; aborting the job",
    ),
    # rank 1 is killed while rank 0 waits for its message
    "killed rank": (
        "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\nmpijax.recv(jnp.ones(2), 1)",
        {},
        r"signal 9|Killed|KILLED",
    ),
    # rank 1 leaves cleanly before a barrier: rank 0's watchdog ends the wait
    "rank that leaves early": (
        "if rank == 1: sys.exit(0)\nmpijax.barrier()",
        {"MPIJAX_TIMEOUT": "3"},
        r"mpijax\.barrier on rank 0 of 2 timed out after 3 s",
    ),
    # a recv that no rank sends to, under the watchdog
    "receive without a sender": (
        "mpijax.recv(jnp.ones(2), 1 - rank, tag=5)",
        {"MPIJAX_TIMEOUT": "3"},
        r"mpijax\.recv on rank \d of 2 timed out after 3 s .* from rank \d with tag 5",
    ),
    # ranks disagree on a shape: check mode raises on both, nothing hangs
    "mismatched shapes in check mode": (
        "mpijax.allreduce(jnp.ones(2 + rank), MPI.SUM)",
        {"MPIJAX_CHECK": "1"},
        r"rank 0 called allreduce\(SUM\) of float32\[2\]; rank 1 called allreduce\(SUM\) of float32\[3\]",
    ),
    # a collective over arrays of different sizes, without the watchdog (an
    # erroneous program: a test in the pytest of the ranks could hang there)
    "mismatched sizes": (
        "mpijax.bcast(jnp.ones(4 if rank == 0 else 2), 0)",
        {},
        r"(?s)mpijax\.bcast failed on rank 1 of 2: MPI_ERR_TRUNCATE.*The ranks' arrays differ in size \(under "
        r"jax\.vmap of a derivative.*\), or the ranks called different collectives "
        r"\(MPIJAX_CHECK=1 names the difference\)",
    ),
    # the same under the watchdog, whose nonblocking collectives MPI does not
    # fail so (Open MPI never completes them, MPICH may return garbage)
    "mismatched shapes in check mode under the watchdog": (
        "mpijax.allreduce(jnp.ones(2 + rank), MPI.SUM)",
        {"MPIJAX_CHECK": "1", "MPIJAX_TIMEOUT": "3"},
        r"rank 0 called allreduce\(SUM\) of float32\[2\]; rank 1 called allreduce\(SUM\) of float32\[3\]",
    ),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_ends_the_job_with_a_message(tmp_path, fault):
    body, env, says = FAULTS[fault]
    started = time.monotonic()
    result = mpirun(tmp_path, textwrap.dedent(FAULT_PREAMBLE) + body + "\n", env=env, timeout=90)
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    assert re.search(says, result.stdout + result.stderr), result.stderr


def test_an_uncaught_exception_aborts_no_job_where_told_not_to(tmp_path):
    """MPIJAX_ABORT_ON_EXCEPTION=0: the rank's exception is reported as
    Python reports it, and mpijax aborts nothing (the launcher still ends
    the job, as the rank ended without MPI_Finalize)."""
    program = textwrap.dedent(FAULT_PREAMBLE) + "if rank == 1: raise RuntimeError('boom')\n"
    result = mpirun(tmp_path, program, env={"MPIJAX_ABORT_ON_EXCEPTION": "0"}, timeout=90)
    assert result.returncode != 0
    assert "RuntimeError: boom" in result.stderr, result.stderr
    assert "aborting the job" not in result.stdout + result.stderr


def test_a_collective_abandoned_by_the_watchdog_completes_into_memory_of_its_own(tmp_path):
    """Rank 0's allreduce times out; rank 1 joins it two seconds later, and
    Open MPI completes it on rank 0 inside a later MPI call. It wrote into
    the output buffer that XLA had freed, and rank 0 crashed at exit with its
    heap corrupted (benchmarks/late_collective.py); now into mpijax's own
    copy, left to MPI. MPICH lets rank 1 time out as well."""
    body = """
        mpijax.set_timeout(1)
        x = jnp.ones(1 << 20, jnp.float32) * (rank + 1)
        if rank == 1:
            time.sleep(2)
        try:
            print(f"rank {rank} got {float(jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM))(x)[0])}", flush=True)
        except jax.errors.JaxRuntimeError as e:
            assert "timed out" in str(e), e
            print(f"rank {rank} timed out", flush=True)
        arrays = [jnp.full(1 << 20, float(i), jnp.float32) + 0 for i in range(20)]
        assert all(bool((a == i).all()) for i, a in enumerate(arrays))
        """
    result = mpirun(tmp_path, textwrap.dedent(FAULT_PREAMBLE) + textwrap.dedent(body), timeout=90)
    assert result.returncode == 0, result.stderr
    assert "rank 0 timed out" in result.stdout, result.stdout
    assert re.search(r"rank 1 (got 3\.0|timed out)", result.stdout), result.stdout
