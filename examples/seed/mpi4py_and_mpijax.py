# The seed-era "do not use mpi4jax and mpi4py with the same communicator"
# example (the version that uses comm.Clone()). Apart from the import line,
# the docs' snippet omits the peer ranks, which mpi4jax and mpi4py both
# require: they are added here, pairing ranks 0-1, 2-3, ... Each receiver
# checks what it got against what its sender made, and every rank waits for
# its queued mpijax calls before it frees their communicator.
import numpy as np
import jax.numpy as jnp

from mpi4py import MPI
import mpijax
from mpijax import tokens as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
rank = comm.Get_rank()

# create a new communicator for mpi4jax
comm_jax = comm.Clone()


def made_by(r):
    """The arrays rank r sends: every rank can make them again."""
    arr_np = np.random.default_rng(r).random((10, 10))
    arr_jax = jnp.arange(100.0).reshape(10, 10) + r
    return arr_np, arr_jax


arr_np, arr_jax = made_by(rank)

if rank % 2 == 0:
    mpi4jax.send(arr_jax, rank + 1, comm=comm_jax)
    comm.send(arr_np, rank + 1)
else:
    arr_jax, token = mpi4jax.recv(jnp.zeros((10, 10)), rank - 1, comm=comm_jax)
    arr = comm.recv(source=rank - 1)
    sent_np, sent_jax = made_by(rank - 1)
    assert np.array_equal(np.asarray(arr_jax), np.asarray(sent_jax)), "mpijax received other data"
    assert np.array_equal(arr, sent_np), "mpi4py received other data"
    print(f"rank {rank}: received from rank {rank - 1} what it sent, through mpijax and mpi4py")

mpijax.wait()  # added: the send may still be queued
comm_jax.Free()
