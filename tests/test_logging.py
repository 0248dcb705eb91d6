"""MPIJAX_DEBUG: one line per MPI call per rank, written by C++ (the
environment variables themselves are tested in test_launch.py)."""

import re

import jax
import jax.numpy as jnp
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src.runtime import core

from reference import MPI_FAILURE, RANK, SIZE

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE


@pytest.fixture
def log(capfd):
    core.set_logging(True)
    capfd.readouterr()

    def lines():
        jax.effects_barrier()
        return [line for line in capfd.readouterr().err.splitlines() if line.startswith("mpijax ")]

    yield lines
    core.set_logging(False)


def test_one_line_per_call_with_every_field(comm, log):
    @jax.jit
    def f(x):
        y = mpijax.allreduce(x, MPI.SUM, comm=comm)
        z = mpijax.sendrecv(x, x, PREV, NEXT, sendtag=4, recvtag=4, comm=comm)
        w = mpijax.bcast(x[:2], SIZE - 1, comm=comm)
        mpijax.barrier(comm=comm)
        return y, z, w

    f(jnp.ones(5, jnp.float32))
    f(jnp.ones(5, jnp.float32))
    lines = log()
    assert len(lines) == 8, lines
    number = r"\d+\.\d+ us"
    expected = [
        rf"mpijax r{RANK} \| allreduce \| op SUM \| 5 x float32 \| 20 B \| {number}",
        rf"mpijax r{RANK} \| sendrecv \| dest {NEXT} \| source {PREV} \| sendtag 4 \| recvtag 4 "
        rf"\| 5 x float32 \| 20 B \| {number}",
        rf"mpijax r{RANK} \| bcast \| root {SIZE - 1} \| 2 x float32 \| 8 B \| {number}",
        rf"mpijax r{RANK} \| barrier \| 0 x - \| 0 B \| {number}",
    ]
    for line, pattern in zip(lines, expected * 2, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_send_recv_and_dtype_names(comm, log):
    x = jnp.zeros((2, 3), jnp.bfloat16)
    mpijax.send(x, RANK, tag=9, comm=comm)
    mpijax.recv(x, RANK, tag=9, comm=comm)
    send, recv = log()
    assert re.fullmatch(rf"mpijax r{RANK} \| send \| dest {RANK} \| sendtag 9 \| 6 x bfloat16 \| 12 B \| .* us", send)
    assert re.fullmatch(rf"mpijax r{RANK} \| recv \| source {RANK} \| recvtag 9 \| 6 x bfloat16 \| 12 B \| .* us", recv)


def test_calls_of_several_messages_list_their_peers(comm, log):
    """neighbor_exchange, and the start and wait of isend and irecv: `to` and
    `from` list the peers in order, MPI_PROC_NULL as null; a wait counts the
    bytes it received."""
    x = jnp.ones(5, jnp.float32)
    mpijax.neighbor_exchange([x, x], [PREV, MPI.PROC_NULL], [NEXT, MPI.PROC_NULL], comm=comm)
    send = mpijax.isend(x, NEXT, tag=3, comm=comm)
    recv = mpijax.irecv(x, PREV, tag=3, comm=comm)
    mpijax.wait([send, recv])
    exchange, start_send, start_recv, wait = log()
    number = r"\d+\.\d+ us"
    assert re.fullmatch(
        rf"mpijax r{RANK} \| neighbor_exchange \| to {NEXT} null \| from {PREV} null "
        rf"\| 10 x float32 \| 40 B \| {number}",
        exchange,
    )
    assert re.fullmatch(rf"mpijax r{RANK} \| start \| to {NEXT} \| 5 x float32 \| 20 B \| {number}", start_send)
    assert re.fullmatch(rf"mpijax r{RANK} \| start \| from {PREV} \| 0 x - \| 0 B \| {number}", start_recv)
    assert re.fullmatch(rf"mpijax r{RANK} \| wait \| from {PREV} \| 20 x byte \| 20 B \| {number}", wait)


def test_reductions_name_their_op(comm, log):
    """Predefined ops by their mpi4py name, user-defined ones by registry id."""
    user = MPI.Op.Create(lambda a, b, datatype: None, commute=True)  # leaves b: the result is x
    x = jnp.ones(3, jnp.int32)
    mpijax.reduce(x, MPI.BXOR, 0, comm=comm)
    mpijax.scan(x, user, comm=comm)
    mpijax.allreduce(x, user, comm=comm)
    reduce, scan, allreduce = log()
    user.Free()
    assert re.fullmatch(rf"mpijax r{RANK} \| reduce \| root 0 \| op BXOR \| 3 x int32 \| 12 B \| .* us", reduce)
    assert re.fullmatch(rf"mpijax r{RANK} \| scan \| op user-defined #\d+ \| 3 x int32 \| 12 B \| .* us", scan)
    assert allreduce.split(" | ")[2] == scan.split(" | ")[2]


def test_failed_call_is_marked(comm, log):
    with pytest.raises(MPI_FAILURE):
        jax.block_until_ready(mpijax.sendrecv(jnp.ones(4), jnp.zeros(2), PREV, NEXT, comm=comm))
    (line,) = log()
    assert line.endswith("| FAILED")


def test_special_ranks_and_tags_by_name(comm, log):
    """MPI.PROC_NULL as null, MPI.ANY_SOURCE and MPI.ANY_TAG as any: their
    numbers differ between MPI libraries."""
    x = jnp.ones(2, jnp.float32)
    mpijax.sendrecv(x, x, MPI.PROC_NULL, MPI.PROC_NULL, comm=comm)
    mpijax.sendrecv(x, x, MPI.ANY_SOURCE, NEXT, sendtag=3, comm=comm)
    nulls, anys = log()
    assert " | dest null | source null | sendtag 0 | recvtag any | " in nulls
    assert f" | dest {NEXT} | source any | sendtag 3 | recvtag any | " in anys


@pytest.mark.skipif(SIZE < 2, reason="check mode compares ranks")
def test_a_call_that_check_mode_refuses_is_marked_with_its_peers(comm, log, watchdog):
    """The ranks' own peers, not the null that check mode puts in place of
    the message it refuses."""
    x = jnp.ones(2, jnp.float32)
    mpijax.set_check(True)
    try:
        with pytest.raises(MPI_FAILURE, match="check mode"):
            jax.block_until_ready(mpijax.allreduce(jnp.ones(2 + (RANK == 0)), MPI.SUM, comm=comm))
        with pytest.raises(MPI_FAILURE, match="check mode"):
            jax.block_until_ready(mpijax.sendrecv(x, x, PREV, NEXT, sendtag=RANK, recvtag=RANK, comm=comm))
        jax.block_until_ready(mpijax.allreduce(x, MPI.SUM, comm=comm))
    finally:
        mpijax.set_check(False)
    refused_allreduce, refused_sendrecv, allreduce = log()
    assert refused_allreduce.endswith(" us | REFUSED by check mode")
    assert f" | dest {NEXT} | source {PREV} | sendtag {RANK} | recvtag {RANK} | " in refused_sendrecv
    assert refused_sendrecv.endswith(" us | REFUSED by check mode")
    assert allreduce.endswith(" us")


def test_off_by_default_and_when_disabled(comm, capfd):
    assert not core.logging()
    jax.block_until_ready(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=comm))
    jax.effects_barrier()
    assert "mpijax r" not in capfd.readouterr().err
