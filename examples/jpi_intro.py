"""The program of JPI's introduction (its README's usage example) on
mpijax.jpi: rank 0's array is scattered, the last rank doubles its block,
the blocks are summed over all ranks, and the total is differentiated.
Only the import line differs from the program written for JPI. Run it with
`mpirun -n 4 python examples/jpi_intro.py`; each rank prints its line."""

import jax
import jax.numpy as jnp
from mpi4py import MPI

from mpijax.jpi import allreduce, gen_token, scatter  # JPI: from jpi import allreduce, scatter, gen_token

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# Two elements for every rank, held by rank 0; elsewhere zeros of that shape.
x = jnp.arange(2 * size, dtype=jnp.float32) if rank == 0 else jnp.zeros(2 * size, dtype=jnp.float32)


def total(x):
    token = gen_token()
    block, token = scatter(x, token, root=0, comm=comm)
    if rank == size - 1:  # ranks may compute differently
        block = block * 2
    summed, token = allreduce(block, token, op=MPI.SUM, comm=comm)
    return jnp.sum(summed)


total_jit = jax.jit(total)
result = total_jit(x)
gradient = jax.grad(total_jit)(x)
print(f"Rank {comm.rank} has result {result} and gradient {gradient}")
