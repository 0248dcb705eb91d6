# The seed-era token example ("INSTEAD, DO THIS": send, then recv after the
# send's token) inside jax.jit. Apart from the import line, the docs'
# snippet omits the peer rank, which mpi4jax requires: it is added here,
# pairing ranks 0-1, 2-3, ...
from mpi4py import MPI
import jax
import jax.numpy as jnp
from mpijax import tokens as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
other = rank ^ 1

@jax.jit
def swap(arr):
    if rank % 2 == 0:
        token = mpi4jax.send(arr, other, comm=comm)
        new_arr, token = mpi4jax.recv(arr, other, comm=comm, token=token)
    else:
        new_arr, token = mpi4jax.recv(arr, other, comm=comm)
        token = mpi4jax.send(arr, other, comm=comm, token=token)
    return new_arr

print(rank, swap(jnp.full(3, rank)))
