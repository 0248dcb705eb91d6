# mpi4jax's seed-era README example; only the import line differs.
from mpi4py import MPI
import jax
import jax.numpy as jnp
from mpijax import tokens as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
rank = comm.Get_rank()

@jax.jit
def foo(arr):
   arr = arr + rank
   arr_sum, _ = mpi4jax.allreduce(arr, op=MPI.SUM, comm=comm)
   return arr_sum

a = jnp.zeros((3, 3))
result = foo(a)

if rank == 0:
   print(result)
