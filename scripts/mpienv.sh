# Sourced by the scripts: which MPI (MPIJAX_MPI=mpich picks Debian's MPICH and
# its own virtual environment; otherwise the MPI on PATH), and what mpirun
# needs here.
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
