"""The copies in loops that XLA:GPU compiles for a described H100 (no GPU
used), with mpijax's barriers and without: the dynamic-slice fusion at the
plugin's default (off), so that both compile. A barrier that made XLA copy
a buffer it would otherwise update in place would show here. From the
repository root, with JAX's CUDA plugin (scripts/test.sh's build/xla-gpu):
  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
    mpirun -n 2 build/xla-gpu/bin/python docs/benchmarks/gpu/dynamic-slice-fusion/copies.py"""

import re
import sys

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpijax
from mpijax._src import primitive

sys.path[:0] = ["tests", "examples"]
from test_xla_gpu import ON_GPU  # noqa: E402

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
prev, following = (rank - 1) % size, (rank + 1) % size


def loop(body):
    return lambda x: jax.lax.fori_loop(0, 10, lambda i, x: body(x), x)


PROGRAMS = {
    "allreduce": loop(lambda x: mpijax.allreduce(x, MPI.SUM) * 0.5),
    "sendrecv(x, x)": loop(lambda x: mpijax.sendrecv(x, x, prev, following) + 1),
    "sendrecv into zeros_like": loop(lambda x: mpijax.sendrecv(x, jnp.zeros_like(x), prev, following) + 1),
    "bcast": loop(lambda x: mpijax.bcast(x, 0) + 1),
    "row update": loop(lambda x: x.at[2].set(mpijax.allreduce(x[2], MPI.SUM)) * 0.5),
}


def count(f, donate):
    """(barriers in the StableHLO, copies in the compiled HLO)"""
    spec = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=ON_GPU)
    lowered = jax.jit(f, donate_argnums=(0,) if donate else ()).trace(spec).lower()
    barriers = lowered.as_text().count("stablehlo.optimization_barrier")
    return barriers, len(re.findall(r"= \S+ copy(-start)?\(", lowered.compile().as_text()))


with_barriers = primitive._behind_barrier
if rank == 0:
    print(f"{jax.__version__=}, loops of 10 steps on f32[64,256]; barriers/copies, not donated and donated")
for name, f in PROGRAMS.items():
    cells = []
    for shield in (with_barriers, list):
        primitive._behind_barrier = shield
        jax.clear_caches()  # or jit would reuse the other variant's lowering
        cells.append("  ".join("{}/{}".format(*count(f, donate)) for donate in (False, True)))
    if rank == 0:
        print(f"{name:26s} with barriers: {cells[0]:12s} without: {cells[1]}")
