# Sourced by the scripts: what mpirun needs here. The OMPI_ variables are read
# by Open MPI only: running as root (containers, CI) and more ranks than cores.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1
# One XLA thread per rank, so that ranks do not fight over the cores.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false"
