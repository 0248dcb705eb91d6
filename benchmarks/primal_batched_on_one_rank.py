"""What the case that cannot work in docs/autodiff.md (rule 2) returns without
check mode: under vmap of value_and_grad, rank 0's allreduce operand follows
the batched x and rank 1's is a constant, so the ranks call the collective
with different shapes.

    MPIJAX_ABORT_ON_EXCEPTION=0 mpirun -n 2 python benchmarks/primal_batched_on_one_rank.py

The right values are [3, 6] on both ranks (x = arange(3) and 2 * x summed,
rank 1 adding zeros). With MPIJAX_CHECK=1 both ranks raise instead."""

import jax
import jax.numpy as jnp
from mpi4py import MPI
from worker import mpi_library

import mpijax

RANK = MPI.COMM_WORLD.Get_rank()
if RANK == 0:
    print(mpi_library(), flush=True)


def f(x):
    return mpijax.allreduce(jnp.sum(x if RANK == 0 else jnp.zeros(3)), MPI.SUM)


x = jnp.arange(3.0)
try:
    values, _ = jax.vmap(jax.value_and_grad(f))(jnp.stack([x, 2 * x]))
    print(f"rank {RANK}: values {values.tolist()} (right: [3.0, 6.0])", flush=True)
except Exception as error:  # noqa: BLE001 (reported, as a user would see it)
    print(f"rank {RANK}: raised {type(error).__name__}: {str(error)[:230]}", flush=True)
