#!/usr/bin/env bash
# tests/test_xla_gpu.py's loops (XLA:GPU compiling for a described H100, no
# GPU needed) with mpijax's barriers as committed, left out, only in front of
# the calls or only behind them, and left out with XLA's dynamic-slice fusion
# at the plugin's default; at 2 ranks, for each Python given (one that has
# JAX's CUDA plugin, such as scripts/test.sh's build/xla-gpu/bin/python):
#   bash docs/benchmarks/gpu/dynamic-slice-fusion/deviceless.sh PYTHON...
cd "$(dirname "$0")/../../../.." || exit 1
source scripts/mpienv.sh
export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 MPIJAX_XLA_GPU_COMPILE=1
# The lowering passes a call's operands to _behind_barrier as a tuple, its
# results as a list.
declare -A barriers=(
  [committed]="primitive._behind_barrier"
  [none]="list"
  [front-only]="lambda v, r=primitive._behind_barrier: r(v) if isinstance(v, tuple) else list(v)"
  [back-only]="lambda v, r=primitive._behind_barrier: list(v) if isinstance(v, tuple) else r(v)"
)
run() {  # run BARRIERS FUSION [TEST]: the module, or one test, at 2 ranks; its outcome
  local fusion=""
  [ "$2" = default ] && fusion="import conftest, test_xla_gpu; test_xla_gpu.OPTIONS.clear()"
  local path=tests/test_xla_gpu.py${3:+::$3}
  echo "\$ barriers $1, dynamic-slice fusion $2: $path"
  timeout 600 mpirun -n 2 "$python" -c "
import sys
sys.path[:0] = ['tests', 'examples']
from mpijax._src import primitive
primitive._behind_barrier = ${barriers[$1]}
$fusion
import pytest
sys.exit(pytest.main(['-q', '--color=no', '-p', 'no:cacheprovider', '--capture=sys', '$path']))" >"$log" 2>&1
  local rc=$?
  grep -a -oE "shape_util.cc:[0-9]+\] Check failed.*|^[0-9]+ (passed|failed)[^[]*" "$log" | sort -u | sed 's/^/  /'
  echo "  exit status $rc"
}
log=$(mktemp)
for python in "$@"; do
  echo "### $python: $("$python" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)')," \
    "PJRT plugin $(sha256sum "$("$python" -c 'import jax_plugins.xla_cuda13 as p, os; print(os.path.dirname(p.__file__))')/xla_cuda_plugin.so" | cut -c1-16)"
  run committed on
  for test in test_a_stencil_loop_with_rows_going_straight_into_the_calls test_the_shallow_water_loop \
    test_the_poisson_solve_and_its_gradient; do
    for b in committed none front-only back-only; do run "$b" on "$test"; done
    run none default "$test"
  done
done
rm -f "$log"
