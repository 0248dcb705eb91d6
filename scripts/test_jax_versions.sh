#!/usr/bin/env bash
# Runs the Python test suite under JAX releases other than .venv's, each in its
# own virtual environment, build/jax-VERSION, where mpijax is built the way pip
# builds it for users (isolated, against the FFI headers of the jaxlib that
# pyproject.toml names), with the Open MPI of scripts/setup.sh:
#   bash scripts/test_jax_versions.sh [-n RANKS] VERSION[@PYTHON]...
# e.g. 0.8.0 0.12.0.1@python3.12: a release needs a Python it has wheels for
# (python3 by default). RANKS: 2 by default. Each run's output goes to
# build/jax-VERSION/pytest.log; this prints its summary lines, and exits
# non-zero if any run failed. scripts/test.sh runs it at 1 rank on the oldest
# supported JAX (src/mpijax/_src/jax_version.py), with MPIJAX_WHEEL set to the
# wheel that scripts/setup.sh built (the same build, not built again).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ranks=2
if [ "${1:-}" = -n ]; then ranks=$2; shift 2; fi
source scripts/mpienv.sh
failed=0
for spec in "$@"; do
  version=${spec%@*}
  python=python3; [ "$spec" != "$version" ] && python=${spec#*@}
  env=build/jax-$version
  start=$SECONDS
  if [ ! -x "$env/bin/python" ]; then
    if ! { "$python" -m venv "$env" && "$env/bin/python" -m pip install -q --upgrade pip; }; then
      failed=1
      continue
    fi
  fi
  "$env/bin/python" -m pip uninstall -q -y mpijax 2>/dev/null
  if ! "$env/bin/python" -m pip install -q "jax==$version" "jaxlib==$version" "${MPIJAX_WHEEL:-.}[test]"; then
    echo "== JAX $version: could not install it with mpijax"; failed=1; continue
  fi
  timeout 1800 "$mpirun" -n "$ranks" "$env/bin/python" -m pytest -m "not launcher" -q --color=no -p no:cacheprovider tests \
    >"$env/pytest.log" 2>&1 || failed=1
  echo "== JAX $version, $("$env/bin/python" --version), $ranks ranks, $((SECONDS - start)) s:"
  grep -aE '^[0-9]+ (passed|failed)|^(FAILED|ERROR) ' "$env/pytest.log" | tail -n 20
done
exit $failed
