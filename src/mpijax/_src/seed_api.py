"""mpi4jax 0.2's capitalised functions, with that release's signatures and
defaults: every argument positional or keyword, and MPI.COMM_WORLD itself as
the default communicator. Each returns what mpijax.tokens returns (the
result and a token; Send the token)."""

from mpi4py import MPI

from .. import tokens


def Allreduce(x, op, comm=MPI.COMM_WORLD, token=None):
    return tokens.allreduce(x, op, comm=comm, token=token)


def Send(x, dest, tag=0, comm=MPI.COMM_WORLD, token=None):
    return tokens.send(x, dest, tag=tag, comm=comm, token=token)


def Recv(x, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, comm=MPI.COMM_WORLD, status=None, token=None):
    return tokens.recv(x, source, tag=tag, comm=comm, status=status, token=token)


def Sendrecv(
    sendbuf, recvbuf, source, dest, sendtag=0, recvtag=MPI.ANY_TAG, comm=MPI.COMM_WORLD, status=None, token=None
):
    return tokens.sendrecv(
        sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag, comm=comm, status=status, token=token
    )
