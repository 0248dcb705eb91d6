"""mpi4jax 0.2's capitalised functions (mpijax.Allreduce, Send, Recv,
Sendrecv): that release's signatures, defaults and returns."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax import tokens

from reference import MODES, RANK, SIZE, all_data, assert_equal

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE

# From mpi4jax 0.2.0's mpi4jax/collective_ops/*.py (0.2.7 only adds Allreduce's private _transpose=False).
SIGNATURES = {
    "Allreduce": "(x, op, comm=WORLD, token=None)",
    "Send": "(x, dest, tag=0, comm=WORLD, token=None)",
    "Recv": f"(x, source={MPI.ANY_SOURCE}, tag={MPI.ANY_TAG}, comm=WORLD, status=None, token=None)",
    "Sendrecv": f"(sendbuf, recvbuf, source, dest, sendtag=0, recvtag={MPI.ANY_TAG}, comm=WORLD, status=None, "
    "token=None)",
}


def is_token(t):
    return jnp.shape(t) == () and jnp.result_type(t) == jnp.float32


def test_signatures_and_defaults():
    for name, signature in SIGNATURES.items():
        parameters = inspect.signature(getattr(mpijax, name)).parameters
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters.values()), name
        assert parameters["comm"].default is MPI.COMM_WORLD, name
        shown = str(inspect.signature(getattr(mpijax, name))).replace(repr(MPI.COMM_WORLD), "WORLD")
        assert shown == signature, name


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_positional_and_keyword(comm, mode):
    xs = all_data((3, 2), "float64")
    result, token = MODES[mode](lambda x: mpijax.Allreduce(x, MPI.SUM, comm, tokens.gen_token()))(xs[RANK])
    assert_equal(result, sum(xs))
    assert is_token(token)
    result, token = MODES[mode](lambda x: mpijax.Allreduce(x, op=MPI.MAX))(xs[RANK])  # on COMM_WORLD
    assert_equal(result, np.maximum.reduce(xs))


@pytest.mark.parametrize("mode", MODES)
def test_send_recv_sendrecv(comm, mode):
    xs = all_data((4,), "int32")

    def ring(x):
        # Rank 0 starts the ring; Send returns only the token, Recv the array and a token.
        if RANK == 0:
            token = mpijax.Send(x, NEXT, 3, comm)
            y, token = mpijax.Recv(x, PREV, 3, comm, None, token)
        else:
            y, token = mpijax.Recv(x, PREV, 3, comm)
            token = mpijax.Send(x, NEXT, 3, comm, token)
        z, token = mpijax.Sendrecv(x, x, PREV, NEXT, comm=comm, token=token)
        return y, z, token

    y, z, token = MODES[mode](ring)(xs[RANK])
    assert_equal(y, xs[PREV])
    assert_equal(z, xs[PREV])
    assert is_token(token)


def test_recv_fills_status_and_takes_a_jax_token(comm):
    status = MPI.Status()
    x = jnp.arange(3.0) + RANK
    token = mpijax.Send(x, RANK, tag=5, comm=comm, token=jax.lax.create_token())
    y, _ = mpijax.Recv(jnp.zeros(3), comm=comm, status=status, token=token)  # ANY_SOURCE, ANY_TAG
    jax.block_until_ready(y)
    assert_equal(y, np.arange(3.0) + RANK)
    assert (status.Get_source(), status.Get_tag()) == (RANK, 5)
