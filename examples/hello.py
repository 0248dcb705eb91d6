"""A global sum and a send/recv pair inside one jitted function.

mpirun -n 2 python examples/hello.py
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpijax

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % size, (rank - 1) % size


@jax.jit
def step(x):
    total = mpijax.allreduce(x, op=MPI.SUM)  # every rank gets the sum over ranks
    # Pass x one rank to the right. The calls run in program order on every
    # rank, so even ranks send first and odd ranks receive first: no deadlock.
    if rank % 2 == 0:
        mpijax.send(x, dest=right)
        received = mpijax.recv(x, source=left)
    else:
        received = mpijax.recv(x, source=left)
        mpijax.send(x, dest=right)
    return total, received


total, received = step(jnp.arange(4.0) + 10 * rank)
print(f"rank {rank}/{size}: global sum {total.tolist()}, from rank {left}: {received.tolist()}", flush=True)
