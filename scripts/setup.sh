#!/usr/bin/env bash
# Installs mpijax on a Debian machine and runs the shallow-water model,
# examples/shallow_water.py, on 2 ranks: it writes shallow_water.png.
# Installs with apt what is missing (an MPI, a C++ compiler, Python's venv and
# headers), then mpijax, its test tools and matplotlib (for the examples'
# pictures) into a virtual environment, .venv.
#   bash scripts/setup.sh                 set up, then run the example
#   bash scripts/setup.sh --no-example    set up only
# With MPIJAX_MPI=mpich: Debian's MPICH instead of the MPI on PATH, with
# mpi4py built from source against it, in .venv-mpich.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/mpienv.sh

apt_packages=()
if [ "${MPIJAX_MPI:-}" = mpich ]; then
  command -v "$mpicc" >/dev/null || apt_packages+=(mpich libmpich-dev)
else
  command -v mpicc >/dev/null || apt_packages+=(libopenmpi-dev openmpi-bin)
fi
command -v c++ >/dev/null || apt_packages+=(g++)
if ! command -v python3 >/dev/null; then
  apt_packages+=(python3 python3-venv python3-dev)
else
  python3 -c "import ensurepip" 2>/dev/null || apt_packages+=(python3-venv)
  python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || apt_packages+=(python3-dev)
fi
if ((${#apt_packages[@]})); then
  echo "== apt-get install ${apt_packages[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

echo "== installing mpijax into $venv (against $mpicc, $("$mpirun" --version 2>&1 | grep -m1 -iE 'open mpi|version' | tr -s ' '))"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if [ "${MPIJAX_MPI:-}" = mpich ]; then
  # PyPI's mpi4py wheels bring no MPI of their own; build mpi4py on MPICH.
  MPICC=$mpicc "$venv/bin/python" -m pip install -q --no-binary=mpi4py "mpi4py>=4"
  CMAKE_ARGS="${CMAKE_ARGS:-} -DMPI_C_COMPILER=$(command -v "$mpicc")"
  export CMAKE_ARGS
fi
# Built once as a wheel, kept in build/wheel$venv (build/wheel.venv for
# .venv): scripts/test.sh installs the same build under the oldest supported
# JAX. Replaced, not upgraded in place (a wheel of the same version would
# count as installed already).
wheels=build/wheel$venv
rm -rf "$wheels"
"$venv/bin/python" -m pip wheel -q --no-deps -w "$wheels" .
"$venv/bin/python" -m pip uninstall -q -y mpijax 2>/dev/null || true
"$venv/bin/python" -m pip install -q "$(ls "$wheels"/mpijax-*.whl)[test,examples]"

if [ "${1:-}" != "--no-example" ]; then
  echo "== $mpirun -n 2 python examples/shallow_water.py"
  "$mpirun" -n 2 "$venv/bin/python" examples/shallow_water.py
fi
