"""What MPI makes of a collective whose ranks pass arrays of different sizes,
in the nonblocking form that mpijax's watchdog (MPIJAX_TIMEOUT) runs: rank r
passes 3 + r elements to an allreduce, or rank 0 broadcasts 4 elements into
the others' 2. Each rank prints what it got, a result or its error (on one
line, cut at 400 characters), waits twice the time-out for the others to print theirs, and leaves
without MPI_Finalize (the ranks are out of step).

    MPIJAX_TIMEOUT=3 mpirun -n 2 python benchmarks/watchdog_mismatch.py allreduce|bcast

docs/failure-modes.md ("Waiting forever") cites its log,
docs/benchmarks/watchdog_mismatch.log."""

import os
import sys
import time

import jax.numpy as jnp
from mpi4py import MPI

import mpijax

rank = MPI.COMM_WORLD.Get_rank()
try:
    if sys.argv[1] == "bcast":
        result = mpijax.bcast(jnp.ones(4 if rank == 0 else 2), 0)
    else:
        result = mpijax.allreduce(jnp.arange(3.0 + rank), MPI.SUM)
    print(f"rank {rank}: returned {result.block_until_ready()}", flush=True)
except Exception as e:  # noqa: BLE001  (what MPI reported is the point)
    print(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())[:400]}", flush=True)
time.sleep(2 * float(os.environ["MPIJAX_TIMEOUT"]))
os._exit(0)
