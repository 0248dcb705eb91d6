#!/usr/bin/env bash
# Runs every test, after setting up (scripts/setup.sh --no-example):
#   1. the C++ core's GoogleTest suite under mpirun at 1, 2 and 3 ranks (ctest);
#   2. the tests that start their own mpirun (pytest -m launcher);
#   3. the Python suite under mpirun at 1, 2 and 3 ranks;
#   4. the same with MPICH (launcher tests, then 1 and 2 ranks: MPICH polls
#      busily, so more ranks than cores crawl), in .venv-mpich;
#   5. ruff (lint and format) on the Python code.
# The first three use the MPI on PATH (Open MPI from Debian if there was none).
# Every stage runs; the exit status is non-zero if any failed.
# MPIJAX_TEST_MPICH=1 adds the MPICH stages.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-example || exit 1
source scripts/mpienv.sh
python=.venv/bin/python
logs=build/test-logs
mkdir -p "$logs"

if [ ! -f /usr/include/gtest/gtest.h ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libgtest-dev >/dev/null
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

total_start=$SECONDS
stage ctest bash -c "'$cmake' -S . -B build/ctest -DMPIJAX_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && '$cmake' --build build/ctest -j >/dev/null && cd build/ctest && ctest --output-on-failure"
stage launcher timeout 900 "$python" -m pytest -m launcher -q --color=no tests
for n in 1 2 3; do
  stage "pytest-$n-ranks" timeout 1800 mpirun -n "$n" "$python" -m pytest -m "not launcher" -q --color=no tests
done
if [ "${MPIJAX_TEST_MPICH:-0}" != 0 ]; then
  if MPIJAX_MPI=mpich bash scripts/setup.sh --no-example; then
    mpich_python=.venv-mpich/bin/python
    stage mpich-launcher env MPIJAX_MPIRUN=mpirun.mpich timeout 900 "$mpich_python" -m pytest -m launcher -q --color=no tests
    for n in 1 2; do
      stage "mpich-$n-ranks" timeout 1800 mpirun.mpich -n "$n" "$mpich_python" -m pytest -m "not launcher" -q --color=no tests
    done
  else
    failed+=(mpich-setup)
  fi
fi
stage lint bash -c ".venv/bin/ruff check src tests examples && .venv/bin/ruff format --check src tests examples"

echo
echo "== summary (wall time $((SECONDS - total_start))s)"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
