"""The public API is mpi4jax's (>= 0.8): names, signatures, defaults, and
code written for it runs with `import mpijax as mpi4jax`."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpijax

from reference import RANK, SIZE

# Signatures of mpi4jax 0.8 / 0.9 (token-free API; token= is only there to be refused).
MPI4JAX_SIGNATURES = {
    "allgather": "(x, *, comm=None, token=NOTSET)",
    "allreduce": "(x, op, *, comm=None, token=NOTSET)",
    "alltoall": "(x, *, comm=None, token=NOTSET)",
    "barrier": "(*, comm=None, token=NOTSET)",
    "bcast": "(x, root, *, comm=None, token=NOTSET)",
    "gather": "(x, root, *, comm=None, token=NOTSET)",
    "recv": f"(x, source={MPI.ANY_SOURCE}, *, tag={MPI.ANY_TAG}, comm=None, status=None, token=NOTSET)",
    "reduce": "(x, op, root, *, comm=None, token=NOTSET)",
    "scan": "(x, op, *, comm=None, token=NOTSET)",
    "scatter": "(x, root, *, comm=None, token=NOTSET)",
    "send": "(x, dest, *, tag=0, comm=None, token=NOTSET)",
    "sendrecv": f"(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag={MPI.ANY_TAG}, comm=None, status=None, "
    "token=NOTSET)",
    "has_cuda_support": "()",
}
# mpijax's own additions: the reliability switches (docs/failure-modes.md).
MPIJAX_EXTRAS = {
    "call_stats": "(*, reset=False)",
    "set_check": "(enabled=True)",
    "set_timeout": "(seconds)",
}


def test_public_names_and_signatures():
    public = MPI4JAX_SIGNATURES | MPIJAX_EXTRAS
    assert sorted(mpijax.__all__) == sorted(public)
    for name, signature in public.items():
        assert str(inspect.signature(getattr(mpijax, name))) == signature, name


def test_has_cuda_support_is_a_bool():
    assert mpijax.has_cuda_support() is False  # this build has no CUDA handlers


def test_mpi4jax_code_runs_unchanged():
    """The shape of mpi4jax's README example, with only the import changed."""
    import mpijax as mpi4jax

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    @jax.jit
    def foo(arr):
        arr = arr + rank
        arr_sum = mpi4jax.allreduce(arr, op=MPI.SUM, comm=comm)
        return arr_sum

    a = jnp.zeros((3, 3))
    result = foo(a)
    np.testing.assert_array_equal(result, np.full((3, 3), SIZE * (SIZE - 1) / 2))

    # Keyword arguments as mpi4jax's docs use them.
    y = mpi4jax.sendrecv(sendbuf=a + rank, recvbuf=a, source=(rank - 1) % SIZE, dest=(rank + 1) % SIZE, comm=comm)
    np.testing.assert_array_equal(y, np.full((3, 3), (rank - 1) % SIZE))
    assert mpi4jax.bcast(a + rank, root=0, comm=comm).shape == (3, 3)
    gathered = mpi4jax.gather(a + rank, root=0, comm=comm)
    assert gathered.shape == ((SIZE, 3, 3) if RANK == 0 else (3, 3))
