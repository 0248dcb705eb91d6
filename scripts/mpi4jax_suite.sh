#!/usr/bin/env bash
# Runs mpi4jax's own test suites against mpijax, switched the way
# docs/migration.md tells its users to: `import mpi4jax` resolves to mpijax
# (to mpijax.tokens for the token API of releases before 0.8), and
# mpi4jax.experimental, .experimental.notoken and .notoken to mpijax's.
#   bash scripts/mpi4jax_suite.sh [-n RANKS] VERSION...
# e.g. 0.9.1 0.6.1. RANKS: 2 by default (mpi4jax's transpose and shallow-water
# tests need a rank count that divides 256). Each release's source package is
# downloaded from PyPI into build/mpi4jax-VERSION once; its tests and examples
# (not its package) run with the venv and MPI of scripts/mpienv.sh
# (MPIJAX_MPI=mpich: MPICH). The output goes to build/mpi4jax-VERSION/pytest.log;
# this prints its summary lines, and exits non-zero if any run failed.
# Left out, each for the reason given below: the tests that use mpi4jax's
# private modules, and two that check a behaviour mpijax changes on purpose.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ranks=2
if [ "${1:-}" = -n ]; then ranks=$2; shift 2; fi
source scripts/mpienv.sh
python=$PWD/$venv/bin/python
ops=tests/collective_ops
left_out=(
  # mpi4jax._src.xla_bridge: its logging switch, its MPI ABI check
  "$ops/test_common.py::test_debug_logging" "$ops/test_common.py::test_set_logging_from_envvar"
  "$ops/test_common.py::test_mpi_abi_info" "$ops/test_common.py::test_mpi_abi_compatibility_check"
  "$ops/test_common.py::test_mpi_abi_skip_check"
  # mpi4jax aborts the job on an MPI error; mpijax raises (docs/failure-modes.md)
  "$ops/test_common.py::test_abort_on_error"
  # mpi4jax cannot take sendrecv's forward-mode derivative and expects an error; mpijax takes it
  "$ops/test_sendrecv.py::test_sendrecv_jacfwd"
)

suite() {  # suite VERSION: prepare build/mpi4jax-VERSION/run, and run it
  local version=$1 dir=build/mpi4jax-$1
  local release=$dir/mpi4jax-$version run=$dir/run
  if [ ! -d "$release/tests" ]; then
    mkdir -p "$dir" && "$python" -m pip download -q --no-deps --no-binary mpi4jax -d "$dir" "mpi4jax==$version" \
      && tar xzf "$dir/mpi4jax-$version.tar.gz" -C "$dir" || return 1
  fi
  local module=mpijax
  [ "$(printf '%s\n' "$version" 0.8 | sort -V | head -n1)" = 0.8 ] || module=mpijax.tokens
  # Its tests, examples and pytest settings (which make it pytest's root), not
  # its package: that would be imported instead.
  rm -rf "$run" && mkdir -p "$run/shim" && cp -r "$release"/{tests,examples,pyproject.toml} "$run"
  cat >"$run/shim/mpi4jax.py" <<EOF
import sys

import mpijax
import $module

sys.modules.update({
    "mpi4jax": $module,
    "mpi4jax.experimental": mpijax.experimental,
    "mpi4jax.experimental.notoken": mpijax.experimental.notoken,
    "mpi4jax.notoken": mpijax.notoken,
})
EOF
  # Two private names only gate whole files on the JAX version (0.3-0.6's
  # experimental tests, 0.7's test_jax_transforms): gates that let them run.
  # (--runxfail, below: 0.3's auto_tokenize tests expect mpi4jax to fail on
  # current JAX; mpijax must pass them.)
  find "$run/tests" -name '*.py' -exec sed -i -E \
    -e 's/^from mpi4jax\._src\.utils import ordered_effect$/ordered_effect = True/' \
    -e 's/^from mpi4jax\._src\.jax_compat import versiontuple.*/def versiontuple(v): return tuple(map(int, v.split(".")[:3]))/' {} +
  # Files that test private modules only, or import one at the top.
  local args=() t
  for t in tests/test_validation.py tests/test_decorators.py tests/test_jax_compat.py tests/test_prefer_notoken.py \
    tests/test_flush.py $(cd "$run" && grep -rlE '^(from|import) mpi4jax\._src' tests); do
    args+=(--ignore "$t")
  done
  for t in "${left_out[@]}"; do args+=(--deselect "$t"); done
  # Before 0.9, test_barrier flushed with mpi4jax._src.flush.
  grep -q _src.flush "$run/$ops/test_barrier.py" && args+=(--deselect "$ops/test_barrier.py::test_barrier")
  echo "== mpi4jax $version's tests, against $module, on $ranks ranks"
  (cd "$run" && PYTHONPATH=$PWD/shim MPIJAX_TIMEOUT=${MPIJAX_TIMEOUT:-120} timeout 900 "$mpirun" -n "$ranks" \
    "$python" -m pytest -q --color=no -p no:cacheprovider --runxfail "${args[@]}" tests) >"$dir/pytest.log" 2>&1
}

failed=0
for version in "$@"; do
  start=$SECONDS
  suite "$version" || failed=1
  echo "   ($((SECONDS - start)) s, build/mpi4jax-$version/pytest.log)"
  # Every rank prints, so a line may begin inside another rank's.
  grep -aoE '[0-9]+ (passed|failed)[a-z0-9, ]* in [0-9.]+s|(FAILED|ERROR) tests[^ ]*' "build/mpi4jax-$version/pytest.log" \
    | tail -n 20
done
exit $failed
