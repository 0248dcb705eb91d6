"""Communicators: the private default, any intracommunicator, small ids in
the compiled program."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpijax
from mpijax._src import comm as mpijax_comm

from reference import MODES, MPI_FAILURE, RANK, SIZE, all_data, assert_equal

NEXT = (RANK + 1) % SIZE
PREV = (RANK - 1) % SIZE


def test_default_is_a_private_duplicate_of_world():
    default = mpijax_comm.default_comm()
    assert default != MPI.COMM_WORLD
    assert MPI.Comm.Compare(default, MPI.COMM_WORLD) == MPI.CONGRUENT


def test_default_does_not_see_user_messages_on_world():
    """A user's mpi4py message on COMM_WORLD must not be taken by mpijax's recv."""
    world = MPI.COMM_WORLD
    request = world.isend("from mpi4py", NEXT, tag=3)
    got = mpijax.sendrecv(jnp.full(2, RANK, jnp.int32), jnp.zeros(2, jnp.int32), PREV, NEXT, recvtag=MPI.ANY_TAG)
    assert_equal(got, np.full(2, PREV, np.int32))
    assert world.recv(source=PREV, tag=3) == "from mpi4py"
    request.wait()


# Two ways to group the ranks: at 2 ranks only "blocks" gives a group of two.
GROUPINGS = {"interleaved": lambda r: r % 2, "blocks": lambda r: r // 2}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_split(comm, mode, grouping):
    color = GROUPINGS[grouping]
    sub = comm.Split(color(RANK), key=-RANK)  # reversed order inside each group
    members = sorted((r for r in range(SIZE) if color(r) == color(RANK)), reverse=True)
    xs = all_data((3,), "int32")
    try:
        total = MODES[mode](lambda x: mpijax.allreduce(x, MPI.SUM, comm=sub))(xs[RANK])
        stacked = MODES[mode](lambda x: mpijax.allgather(x, comm=sub))(xs[RANK])
    finally:
        sub.Free()
    assert_equal(total, sum(xs[r] for r in members))
    assert_equal(stacked, np.stack([xs[r] for r in members]))


@pytest.mark.parametrize("mode", MODES)
def test_cartesian_shift(comm, mode):
    cart = comm.Create_cart([SIZE], periods=[True])
    source, dest = cart.Shift(0, 1)
    x = jnp.arange(4) + 10 * cart.Get_rank()
    try:
        got = MODES[mode](lambda x: mpijax.sendrecv(x, x, source, dest, comm=cart))(x)
    finally:
        cart.Free()
    assert_equal(got, np.arange(4) + 10 * source)


def test_jit_takes_a_comm_by_closure_or_partial_not_as_static_argument(comm):
    def total(x, comm):
        return mpijax.allreduce(x, MPI.SUM, comm=comm)

    x = jnp.arange(3) + RANK
    expected = sum(np.arange(3) + r for r in range(SIZE))
    assert_equal(jax.jit(lambda x: total(x, comm))(x), expected)
    assert_equal(jax.jit(functools.partial(total, comm=comm))(x), expected)
    with pytest.raises(ValueError, match="hash"):  # mpi4py's communicators are unhashable
        jax.jit(total, static_argnames="comm")(x, comm=comm)


def test_comm_self():
    assert_equal(mpijax.allreduce(jnp.arange(3) + RANK, MPI.SUM, comm=MPI.COMM_SELF), np.arange(3) + RANK)


def test_program_carries_a_small_id_not_a_handle(comm):
    text = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=comm)).lower(jnp.ones(2)).as_text()
    (cid,) = re.findall(r"comm = (-?\d+) : i64", text)
    # An index into the registry, which grows by one per communicator used
    # (every test makes one), and above it the communicator's size.
    assert 0 <= int(cid) % 2**24 < 2**20 and int(cid) >> 24 == SIZE
    assert str(MPI._handleof(comm)) not in text.replace(f"comm = {cid}", "")


def test_ids_are_stable_and_distinct(comm):
    other = comm.Dup()
    try:
        a, b = mpijax_comm.resolve(comm, "test"), mpijax_comm.resolve(other, "test")
        assert a.id != b.id
        assert mpijax_comm.resolve(comm, "test").id == a.id
        assert (a.rank, a.size) == (RANK, SIZE)
    finally:
        other.Free()


def test_a_program_whose_communicator_was_freed_raises(comm):
    """The compiled program still names the freed communicator's id, whose
    handle MPI may give to the next communicator it makes (MPICH does): the
    call raises instead of running on that one, or crashing (Open MPI)."""
    dup = comm.Dup()
    f = jax.jit(lambda x: mpijax.allreduce(x, MPI.SUM, comm=dup))
    assert_equal(f(jnp.ones(2)), np.full(2, float(SIZE)))
    mpijax.wait()
    dup.Free()
    other = comm.Split(RANK, 0)  # one rank each: a reused handle would give 1, not SIZE
    try:
        with pytest.raises(MPI_FAILURE, match=r"its communicator \(id \d+\) is gone"):
            jax.block_until_ready(f(jnp.ones(2)))
        assert_equal(mpijax.allreduce(jnp.ones(2), MPI.SUM, comm=other), np.ones(2))
    finally:
        other.Free()
