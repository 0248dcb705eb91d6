# The seed-era "do not use mpi4jax and mpi4py with the same communicator"
# example (the version that uses comm.Clone()). Apart from the import line,
# the docs' snippet omits the peer ranks, which mpi4jax and mpi4py both
# require: they are added here, pairing ranks 0-1, 2-3, ...
import numpy as np
import jax.numpy as jnp

from mpi4py import MPI
from mpijax import tokens as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
rank = comm.Get_rank()

# create a new communicator for mpi4jax
comm_jax = comm.Clone()

arr_np = np.random.rand(10, 10)
arr_jax = jnp.zeros((10, 10))

if rank % 2 == 0:
    mpi4jax.send(arr_jax, rank + 1, comm=comm_jax)
    comm.send(arr_np, rank + 1)
else:
    arr_jax = mpi4jax.recv(arr_jax, rank - 1, comm=comm_jax)
    arr = comm.recv(source=rank - 1)

comm_jax.Free()
