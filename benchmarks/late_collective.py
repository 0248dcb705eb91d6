"""What a collective that timed out does to the rank it was abandoned on, when
the late rank joins it after all (docs/failure-modes.md). Under Open MPI the
abandoned request completes later, into what mpijax gave MPI: XLA's output
buffer, freed since, until collectives under the watchdog got copies of
mpijax's own (the log has runs before and after).

    MPIJAX_ABORT_ON_EXCEPTION=0 mpirun -n 2 python benchmarks/late_collective.py

Rank 0 calls a jitted 4 MiB allreduce under a 1 s watchdog and times out;
rank 1 joins the same allreduce 3 s later, so rank 0's abandoned request
completes inside MPI. Both ranks then compute with fresh arrays, check them
and leave. The launcher reports how each rank ended."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI
from worker import mpi_library

import mpijax

RANK = MPI.COMM_WORLD.Get_rank()

if RANK == 0:
    print(mpi_library(), flush=True)
mpijax.set_timeout(1)
x = jnp.ones(1 << 20, jnp.float32) * (RANK + 1)
f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM) * 1.0)
if RANK == 1:
    time.sleep(3)
try:
    print(f"rank {RANK}: allreduce gave {float(jax.block_until_ready(f(x))[0])}", flush=True)
except Exception as e:  # the timeout
    print(f"rank {RANK}: allreduce raised {type(e).__name__}: {str(e).splitlines()[0][:90]}...", flush=True)
arrays = [jax.block_until_ready(jnp.full(1 << 20, float(i), jnp.float32) + 0) for i in range(20)]
wrong = sum(bool(np.any(np.asarray(a) != i)) for i, a in enumerate(arrays))
print(f"rank {RANK}: {wrong} of 20 fresh 4 MiB arrays wrong; leaving", flush=True)
