# shellcheck shell=bash disable=SC2034  # mpicc, mpirun and venv are for the scripts that source this
# Sourced by the scripts: which MPI (MPIJAX_MPI=mpich picks Debian's MPICH and
# its own virtual environment; otherwise the MPI on PATH), what mpirun needs
# here, and the two helpers for the virtual environments of test.sh and
# gpu_check.sh.
if [ "${MPIJAX_MPI:-}" = mpich ]; then
  mpicc=mpicc.mpich mpirun=mpirun.mpich venv=.venv-mpich
else
  mpicc=mpicc mpirun=mpirun venv=.venv
fi
# The OMPI_ and PRTE_ variables are read by Open MPI only: running as root
# (containers, CI) and more ranks than cores (Open MPI 4, then 5).
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# One XLA thread per rank, so that ranks do not fight over the cores.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false"

# purelib PYTHON: where PYTHON's environment installs packages.
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
# venv_on_top DIR BASE [PIP-ARGS...]: a new virtual environment in DIR that
# also sees the packages of the Python BASE (every site directory of it), with
# what PIP-ARGS name installed on top, without their dependencies.
venv_on_top() {
  local dir=$1 base=$2
  shift 2
  rm -rf "$dir" && "$base" -m venv --without-pip "$dir" \
    && "$base" -c "import sys; print(*(p for p in sys.path if p.endswith('-packages')), sep='\n')" \
      >"$(purelib "$dir/bin/python")/base.pth" \
    && { (($# == 0)) || "$base" -m pip --python "$dir/bin/python" install -q --no-deps "$@"; }
}
