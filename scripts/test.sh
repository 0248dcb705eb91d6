#!/usr/bin/env bash
# Runs every test, after setting up both MPIs (scripts/setup.sh --no-example,
# plain and with MPIJAX_MPI=mpich):
#   1. the C++ core's GoogleTest suite under mpirun at 1, 2 and 3 ranks (ctest);
#   2. the tests that start their own mpirun (pytest -m launcher);
#   3. the Python suite under mpirun at 1 rank with the oldest supported JAX
#      (scripts/test_jax_versions.sh), then at 3 ranks with .venv's (and at 2
#      where MPICH's stages, which run it at 2, are left out); and
#      tests/test_gpu.py at 2 ranks on the CPU through the CUDA handlers'
#      staged path, against a stand-in CUDA runtime (where the CUDA toolkit
#      is: MPIJAX_CUDA=STAND_IN in CMakeLists.txt); tests/test_xla_gpu.py at
#      2 ranks, .venv's programs compiled by XLA:GPU for a described GPU
#      through JAX's CUDA plugin (from PyPI, in a venv of its own; nothing
#      runs on a GPU); then mpi4jax's own test
#      suites of 0.9.1 and 0.6.1 (the token API) at 2 ranks, with
#      `import mpi4jax` resolving to mpijax (scripts/mpi4jax_suite.sh);
#   4. with MPICH, in .venv-mpich: ctest, the launcher tests but those marked
#      mpi_independent, then the suite at 2 ranks (MPICH polls busily, so
#      more ranks than cores crawl; an Open MPI run at 2 ranks too only
#      repeated this one and the 3-rank run, for a sixth of CI's time);
#   5. ruff (lint and format) on the Python code, clang-format on the C++,
#      and the shell scripts through shellcheck.
# The first three use the MPI on PATH (Open MPI from Debian if there was none).
# Every stage runs; the exit status is non-zero if any failed.
# MPIJAX_TEST_MPICH=0 leaves out the MPICH stages (and runs the suite at 2
# ranks with Open MPI instead).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bash scripts/setup.sh --no-example || exit 1
mpich=${MPIJAX_TEST_MPICH:-1}
if [ "$mpich" != 0 ]; then
  MPIJAX_MPI=mpich bash scripts/setup.sh --no-example || exit 1
fi
source scripts/mpienv.sh
python=.venv/bin/python
logs=build/test-logs
mkdir -p "$logs"
# Three ranks on two cores: a rank that waits in Open MPI gives its core
# away, as Open MPI does by itself where it knows the node is oversubscribed
# (here it does not; test_collectives.py at 3 ranks: 23.1 and 22.6 s, with it
# 16.0 and 15.0 s).
export OMPI_MCA_mpi_yield_when_idle=1
# XLA's executables persist across the pytest runs (tests/conftest.py),
# started afresh by each test.sh.
rm -rf build/test-cache
export MPIJAX_TEST_CACHE=$PWD/build/test-cache

tools=()
[ -f /usr/include/gtest/gtest.h ] || tools+=(libgtest-dev)
command -v clang-format >/dev/null || tools+=(clang-format)
command -v shellcheck >/dev/null || tools+=(shellcheck)
if ((${#tools[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${tools[@]}" >/dev/null
fi
command -v cmake >/dev/null || "$python" -m pip install -q cmake
cmake=$(command -v cmake || echo .venv/bin/cmake)

failed=()
summary=()
stage() {  # stage NAME COMMAND...: run, log, remember the outcome and time
  local name=$1; shift
  local start=$SECONDS
  echo "== $name"
  if "$@" 2>&1 | tee "$logs/$name.log"; then status=ok; else status=FAILED; failed+=("$name"); fi
  summary+=("$(printf '%-14s %-6s %4ds  %s' "$name" "$status" $((SECONDS - start)) \
    "$(grep -aE '^[0-9]+ (passed|failed)|tests passed' "$logs/$name.log" | tail -n1)")")
}

# XLA's FFI headers, for the C++ tests of the CUDA memory policy.
xla_ffi=$("$python" -c "import jax.ffi; print(jax.ffi.include_dir())")
ctest_stage() {  # ctest_stage NAME CMAKE_ARGS...: build the GoogleTest suite in build/NAME, run it
  local name=$1; shift
  stage "$name" bash -c "'$cmake' -S . -B build/$name -DMPIJAX_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_COMPILE_WARNING_AS_ERROR=ON \
    -DXLA_FFI_INCLUDE_DIR='$xla_ffi' $* >/dev/null \
    && '$cmake' --build build/$name -j >/dev/null && cd build/$name && ctest --output-on-failure"
}

total_start=$SECONDS
ctest_stage ctest
# The launcher tests also import mpijax with the other MPI's mpi4py.
if [ "$mpich" != 0 ]; then
  MPIJAX_OTHER_MPI4PY=$(purelib .venv-mpich/bin/python)
  export MPIJAX_OTHER_MPI4PY
fi
stage launcher timeout 900 "$python" -m pytest -m launcher -q --color=no tests
# At 1 rank, under the oldest JAX that mpijax supports (its own venv, with
# the wheel that setup.sh built); at 3 ranks under .venv's.
oldest_jax=$("$python" -c "from mpijax._src.jax_version import TESTED; print(TESTED[0])")
MPIJAX_WHEEL=$(ls build/wheel.venv/mpijax-*.whl) \
  stage "pytest-1-rank-jax-$oldest_jax" bash scripts/test_jax_versions.sh -n 1 "$oldest_jax"
ranks=(3)
[ "$mpich" != 0 ] || ranks=(2 3)  # the 2-rank run is MPICH's, where it runs
for n in "${ranks[@]}"; do
  stage "pytest-$n-ranks" timeout 1800 mpirun -n "$n" "$python" -m pytest -m "not launcher" -q --color=no tests
done
stand_in_tests() {  # mpijax built with MPIJAX_CUDA=STAND_IN, on top of .venv
  CMAKE_ARGS=-DMPIJAX_CUDA=STAND_IN venv_on_top build/stand-in "$python" . \
    && MPIJAX_GPU_TESTS_ON=cpu timeout 900 mpirun -n 2 build/stand-in/bin/python -m pytest -q --color=no tests/test_gpu.py
}
xla_gpu_tests() {  # .venv's mpijax compiled by XLA:GPU, through JAX's CUDA plugin of .venv's jaxlib (no GPU used)
  local jaxlib
  jaxlib=$("$python" -c "import jaxlib; print(jaxlib.__version__)")
  venv_on_top build/xla-gpu "$python" "jax-cuda13-plugin==$jaxlib" "jax-cuda13-pjrt==$jaxlib" \
    && JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 MPIJAX_XLA_GPU_COMPILE=1 MPIJAX_TEST_CACHE='' \
      timeout 600 mpirun -n 2 build/xla-gpu/bin/python -m pytest -q --color=no tests/test_xla_gpu.py
}
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  stage gpu-stand-in stand_in_tests
  stage xla-gpu-compile xla_gpu_tests
else
  echo "== gpu-stand-in, xla-gpu-compile: left out, no CUDA toolkit (its headers build the CUDA policy and handlers)"
fi
stage mpi4jax-suites bash scripts/mpi4jax_suite.sh 0.9.1 0.6.1
if [ "$mpich" != 0 ]; then
  mpich_python=.venv-mpich/bin/python
  ctest_stage ctest-mpich -DMPI_C_COMPILER="$(command -v mpicc.mpich)" -DMPIEXEC_EXECUTABLE="$(command -v mpiexec.mpich)"
  MPIJAX_OTHER_MPI4PY=$(purelib "$python") MPIJAX_MPIRUN=mpirun.mpich \
    stage mpich-launcher timeout 900 "$mpich_python" -m pytest -m "launcher and not mpi_independent" -q --color=no tests
  stage mpich-2-ranks timeout 1800 mpirun.mpich -n 2 "$mpich_python" -m pytest -m "not launcher" -q --color=no tests
fi
stage lint bash -c ".venv/bin/ruff check src tests examples benchmarks && .venv/bin/ruff format --check src tests examples benchmarks \
  && clang-format --dry-run --Werror csrc/*.cc csrc/*.h csrc/tests/*.cc benchmarks/*.cc \
  && shellcheck .ci/run \$(git ls-files '*.sh')"

echo
echo "== summary (wall time $((SECONDS - total_start))s)"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
