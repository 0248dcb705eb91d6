# The usage example of mpi4jax 0.2's README (its first API: Allreduce, Send,
# Recv, Sendrecv), with the import line changed. One more change is JAX's, not
# mpijax's: the README's `jax.numpy.ones(5,4)` reads 4 as a dtype, which JAX
# refuses today, so the shape is written as the tuple it meant.
from mpi4py import MPI
import jax
import mpijax as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
a = jax.numpy.ones((5, 4))  # was: jax.numpy.ones(5,4)
b = mpi4jax.Allreduce(a, op=MPI.SUM, comm=comm)
b_jit = jax.jit(lambda x: mpi4jax.Allreduce(x, op=MPI.SUM, comm=comm))(a)

# Not in the README: check the results. Allreduce returns (result, token).
size = comm.Get_size()
for result, _token in (b, b_jit):
    assert result.shape == (5, 4) and bool((result == size).all()), result
print(f"rank {comm.Get_rank()}: Allreduce {float(b[0][0, 0])}, jitted {float(b_jit[0][0, 0])}")
