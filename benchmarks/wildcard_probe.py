"""The cost of a receive from MPI.ANY_SOURCE with MPI.ANY_TAG, which probes
(MPI_Mprobe/MPI_Mrecv) so that it can set derivative messages aside
(docs/autodiff.md, rule 3), against a receive with a fixed source and tag.

    mpirun -n 2 python benchmarks/wildcard_probe.py

Each rank runs a jitted loop of 2,000 sendrecvs with the other rank, best of
five timed runs after a warm-up, in the order fixed, wildcards, fixed,
wildcards (so that a slow phase of the machine shows as a disagreement
between the two runs of one variant). Pin XLA to one thread per rank."""

import time

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI
from worker import mpi_library

import mpijax

WORLD = MPI.COMM_WORLD
OTHER = 1 - WORLD.rank
CALLS = 2000


def loop(source, tag):
    def body(i, x):
        return mpijax.sendrecv(x, x, source, OTHER, recvtag=tag) + 1

    return jax.jit(lambda x: lax.fori_loop(0, CALLS, body, x))


def best(f, x):
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        WORLD.Barrier()
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times) / CALLS * 1e6


if WORLD.rank == 0:
    print(mpi_library())
for nbytes in (4, 2**19):
    x = jnp.zeros(nbytes // 4, jnp.float32)
    variants = [("fixed source and tag", OTHER, 0), ("ANY_SOURCE, ANY_TAG", MPI.ANY_SOURCE, MPI.ANY_TAG)] * 2
    for name, source, tag in variants:
        us = best(loop(source, tag), x)
        if WORLD.rank == 0:
            print(f"{nbytes:>8} B  {name:22s} {us:8.2f} us per sendrecv", flush=True)
