"""Tries JAX's own MPI collectives (jax_cpu_collectives_implementation="mpi")
as a benchmark peer: a psum under shard_map over 2 processes.
    MPITRAMPOLINE_LIB=... mpirun -n 2 -x MPITRAMPOLINE_LIB python benchmarks/jax_mpi_collectives.py
JAX reaches MPI through MPItrampoline, which loads the library that
MPITRAMPOLINE_LIB names: an MPIwrapper build for the MPI in use."""

import socket

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
jax.config.update("jax_cpu_collectives_implementation", "mpi")
port = None
if WORLD.Get_rank() == 0:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
port = WORLD.bcast(port)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=WORLD.Get_size(), process_id=WORLD.Get_rank())
mesh = Mesh(np.array(jax.devices()), ("i",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), np.full(4, WORLD.Get_rank() + 1.0, np.float32))
psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
print(f"rank {WORLD.Get_rank()}: psum {psum(x).addressable_shards[0].data}", flush=True)
