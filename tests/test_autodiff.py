"""Derivatives of every op, checked against the global function computed in
NumPy from every rank's input: JVPs against central finite differences (all
ranks' inputs perturbed), VJPs and grad through the dot-product test and
finite differences of a loss, jacfwd/jacrev entry by entry, linear_transpose
nested three deep, and vmap against a loop.

Convention (docs/autodiff.md): a result every rank holds identically
(allreduce, allgather, bcast) counts once in the global function; any other
result is summed over ranks."""

import dataclasses
import functools
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import MODES, MPI_FAILURE, RANK, SIZE, assert_equal, count_calls, np_dtype, transposed

# A derivative that waits for a message that never comes fails, not hangs.
pytestmark = pytest.mark.usefixtures("watchdog")

WORLD = MPI.COMM_WORLD
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
N = 3  # elements per rank
H = 1e-6  # finite-difference step
ROOTS = sorted({0, SIZE - 1})


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    call: Callable  # (x, comm) -> this rank's result
    reference: Callable  # every rank's x -> every rank's result (NumPy)
    shape: Callable = lambda rank: (N,)  # this rank's input shape
    replicated: bool = False  # every rank holds the same result
    linear: bool = True
    # Receives from MPI.ANY_SOURCE or with MPI.ANY_TAG: transposed after they
    # ran (vjp, grad, jacrev), not by linear_transpose (test_..._cannot_be_linearly_transposed).
    wildcard: bool = False

    def __repr__(self):
        return self.name


def call_with(call, comm, x):
    return call(x, comm)


def fold(f, xs):
    return functools.reduce(f, xs)


def ring(x, comm, template=None, tag=0, source=PREV, recv_tag=0):
    """Pass x to the next rank (under `tag`), receiving into `template` from
    `source` with `recv_tag`: even ranks send first, odd ranks receive first."""
    template = x if template is None else template
    if RANK % 2 == 0:
        mpijax.send(x, NEXT, tag=tag, comm=comm)
        return mpijax.recv(template, source, tag=recv_tag, comm=comm)
    y = mpijax.recv(template, source, tag=recv_tag, comm=comm)
    mpijax.send(x, NEXT, tag=tag, comm=comm)
    return y


def on_odd_ranks(value, x):
    """`value` on odd ranks, x elsewhere: operands that are constants on some
    ranks only, as in `x if rank == root else zeros`."""
    return value if RANK % 2 else x


C = 0.75  # a constant operand's value


def from_prev(xs, odd_constant=False):
    """Every rank's result when each rank passes its x to the next one (odd
    ranks pass the constant C instead, with odd_constant)."""
    sent = [np.full_like(x, C) if odd_constant and r % 2 else x for r, x in enumerate(xs)]
    return [sent[(r - 1) % SIZE] for r in range(SIZE)]


# Rows per rank of the v-variants: uneven, zero on rank 1.
COUNTS = [2, 0, 1][:SIZE]
OFFSETS = np.cumsum([0, *COUNTS])
# alltoallv: rank r sends SENDS[r][j] rows to rank j.
SENDS = [[(r + 2 * j + 1) % 3 for j in range(SIZE)] for r in range(SIZE)]


def _rows_to(xs, r):
    """What rank r receives in alltoallv: its rows from every rank, in rank order."""
    return np.concatenate([np.split(xs[s], np.cumsum(SENDS[s])[:-1])[r] for s in range(SIZE)])


# ragged_alltoall: SENDS as an array, one more row on every rank than it
# sends (which gets a zero derivative), and one more row in the result than
# any rank receives (zeros).
RAGGED_ROWS = max(sum(SENDS[s][r] for s in range(SIZE)) for r in range(SIZE)) + 1


def _ragged_reference(xs):
    sent = [x[: sum(SENDS[s])] for s, x in enumerate(xs)]
    return [
        np.pad(got, [(0, RAGGED_ROWS - len(got))] + [(0, 0)] * (got.ndim - 1))
        for got in (_rows_to(sent, r) for r in range(SIZE))
    ]


LEFT = PREV if RANK > 0 else MPI.PROC_NULL
RIGHT = NEXT if RANK < SIZE - 1 else MPI.PROC_NULL


def chain_exchange(x, comm):
    """x to the right, twice its head to the left, x reversed to oneself."""
    a, b, s = mpijax.neighbor_exchange([x, 2 * x[:2], x[::-1]], [LEFT, RIGHT, RANK], [RIGHT, LEFT, RANK], comm=comm)
    return jnp.concatenate([a, b, s])


def chain_started(x, comm):
    """chain_exchange started, with work tied inside its window: three times
    x, added to the message to oneself."""
    request = mpijax.ineighbor_exchange([x, 2 * x[:2], x[::-1]], [LEFT, RIGHT, RANK], [RIGHT, LEFT, RANK], comm=comm)
    work = 3 * mpijax.started(request, x)
    a, b, s = mpijax.wait(request, after=work)
    return jnp.concatenate([a, b, s + work])


def ring_started(x, comm):
    """The irecv into a constant buffer, started before the isend."""
    received = mpijax.irecv(jnp.zeros(N), PREV, comm=comm)
    sent = mpijax.isend(x, NEXT, comm=comm)
    return mpijax.wait([received, sent])[0]


def chain_reference(xs):
    def result(r):
        a = xs[r - 1] if r > 0 else np.zeros(N)
        b = 2 * xs[r + 1][:2] if r < SIZE - 1 else np.zeros(2)
        return np.concatenate([a, b, xs[r][::-1]])

    return [result(r) for r in range(SIZE)]


def finite(y):
    """y with the infinities of exscan(MIN/MAX)'s first rank (the op's
    identity) as zeros, so that finite differences can be taken."""
    return jnp.where(jnp.isfinite(y), y, 0)


def _varied_cases():
    """reduce_scatter, exscan and the v-variants."""
    cases = [
        Case(
            "allgatherv",
            lambda x, c: mpijax.allgatherv(x, COUNTS, comm=c),
            lambda xs: [np.concatenate(xs)] * SIZE,
            shape=lambda rank: (COUNTS[rank],),
            replicated=True,
        ),
        Case(
            "alltoallv",
            lambda x, c: mpijax.alltoallv(x, SENDS[RANK], [SENDS[s][RANK] for s in range(SIZE)], comm=c),
            lambda xs: [_rows_to(xs, r) for r in range(SIZE)],
            shape=lambda rank: (sum(SENDS[rank]),),
        ),
        Case(
            "ragged_alltoall",
            lambda x, c: mpijax.ragged_alltoall(x, jnp.asarray(SENDS[RANK]), rows=RAGGED_ROWS, comm=c)[0],
            _ragged_reference,
            shape=lambda rank: (sum(SENDS[rank]) + 1,),
        ),
    ]
    for root in ROOTS:
        cases += [
            Case(
                f"gatherv-root{root}",
                lambda x, c, root=root: mpijax.gatherv(x, COUNTS, root, comm=c),
                lambda xs, root=root: [np.concatenate(xs) if r == root else xs[r] for r in range(SIZE)],
                shape=lambda rank: (COUNTS[rank],),
            ),
            Case(
                f"scatterv-root{root}",
                lambda x, c, root=root: mpijax.scatterv(x, COUNTS, root, comm=c),
                lambda xs, root=root: [xs[root][OFFSETS[r] : OFFSETS[r + 1]] for r in range(SIZE)],
                shape=lambda rank, root=root: (sum(COUNTS),) if rank == root else (COUNTS[rank],),
            ),
        ]
    for op, f in [("SUM", np.add), ("MAX", np.maximum), ("MIN", np.minimum), ("PROD", np.multiply)]:
        mpi_op = getattr(MPI, op)
        cases += [
            Case(
                f"reduce_scatter-{op}",
                lambda x, c, o=mpi_op: mpijax.reduce_scatter(x, o, comm=c),
                lambda xs, f=f: [fold(f, [x[r] for x in xs]) for r in range(SIZE)],
                shape=lambda rank: (SIZE, N),
                linear=op == "SUM",
            ),
            Case(
                f"exscan-{op}",
                lambda x, c, o=mpi_op, op=op: (finite if op in ("MIN", "MAX") else jnp.asarray)(
                    mpijax.exscan(x, o, comm=c)
                ),
                lambda xs, f=f, op=op: [
                    fold(f, xs[:r]) if r else np.full(N, 1.0 if op == "PROD" else 0.0) for r in range(SIZE)
                ],
                linear=op == "SUM",
            ),
        ]
    return cases


def _cases():
    cases = []
    for op, f in [("SUM", np.add), ("MAX", np.maximum), ("MIN", np.minimum), ("PROD", np.multiply)]:
        mpi_op = getattr(MPI, op)
        cases.append(
            Case(
                f"allreduce-{op}",
                lambda x, c, o=mpi_op: mpijax.allreduce(x, o, comm=c),
                lambda xs, f=f: [fold(f, xs)] * SIZE,
                replicated=True,
                linear=op == "SUM",
            )
        )
        for root in ROOTS:
            cases.append(
                Case(
                    f"reduce-{op}-root{root}",
                    lambda x, c, o=mpi_op, root=root: mpijax.reduce(x, o, root, comm=c),
                    lambda xs, f=f, root=root: [fold(f, xs) if r == root else xs[r] for r in range(SIZE)],
                    linear=op == "SUM",
                )
            )
        cases.append(
            Case(
                f"scan-{op}",
                lambda x, c, o=mpi_op: mpijax.scan(x, o, comm=c),
                lambda xs, f=f: [fold(f, xs[: r + 1]) for r in range(SIZE)],
                linear=op == "SUM",
            )
        )
    for root in ROOTS:
        cases += [
            Case(
                f"bcast-root{root}",
                lambda x, c, root=root: mpijax.bcast(x, root, comm=c),
                lambda xs, root=root: [xs[root]] * SIZE,
                replicated=True,
            ),
            Case(
                f"gather-root{root}",
                lambda x, c, root=root: mpijax.gather(x, root, comm=c),
                lambda xs, root=root: [np.stack(xs) if r == root else xs[r] for r in range(SIZE)],
            ),
            Case(
                f"scatter-root{root}",
                lambda x, c, root=root: mpijax.scatter(x, root, comm=c),
                lambda xs, root=root: [xs[root][r] for r in range(SIZE)],
                shape=lambda rank, root=root: (SIZE, N) if rank == root else (N,),
            ),
        ]
    cases += _varied_cases()
    cases += [
        Case("allgather", lambda x, c: mpijax.allgather(x, comm=c), lambda xs: [np.stack(xs)] * SIZE, replicated=True),
        Case(
            "alltoall",
            lambda x, c: mpijax.alltoall(x, comm=c),
            lambda xs: [np.stack([xs[s][r] for s in range(SIZE)]) for r in range(SIZE)],
            shape=lambda rank: (SIZE, N),
        ),
        # The idioms as people write them: default source and tag, receive
        # buffers that are constants (on every rank, or on some), and tags
        # other than 0.
        Case("sendrecv", lambda x, c: mpijax.sendrecv(x, x, PREV, NEXT, comm=c), from_prev, wildcard=True),
        Case(
            "sendrecv-tagged",
            lambda x, c: mpijax.sendrecv(x, x, PREV, NEXT, sendtag=3, recvtag=3, comm=c),
            from_prev,
        ),
        Case(
            "sendrecv-tagged-zeros_like",
            lambda x, c: mpijax.sendrecv(x, jnp.zeros_like(x), PREV, NEXT, sendtag=3, recvtag=3, comm=c),
            from_prev,
        ),
        Case(
            "sendrecv-any-source-any-tag",
            lambda x, c: mpijax.sendrecv(x, jnp.zeros_like(x), MPI.ANY_SOURCE, NEXT, sendtag=4 + RANK, comm=c),
            from_prev,
            wildcard=True,
        ),
        Case(
            "sendrecv-zeros_like-any-source",
            lambda x, c: mpijax.sendrecv(
                x, jnp.zeros_like(x), MPI.ANY_SOURCE, NEXT, sendtag=4 + RANK, recvtag=4 + PREV, comm=c
            ),
            from_prev,
            wildcard=True,
        ),
        Case(
            "sendrecv-constant-on-odd-ranks",
            lambda x, c: mpijax.sendrecv(
                on_odd_ranks(jnp.full(N, C), x), on_odd_ranks(jnp.zeros(N), x), PREV, NEXT, sendtag=2, recvtag=2, comm=c
            ),
            lambda xs: from_prev(xs, odd_constant=True),
            linear=False,  # affine: odd ranks send a constant
        ),  # fmt: skip
        Case("send-recv", ring, from_prev),
        Case("recv-constant-buffer", lambda x, c: ring(x, c, template=jnp.zeros(N)), from_prev),
        Case(
            "recv-any-source-constant-buffer",
            lambda x, c: ring(x, c, template=jnp.zeros(N), tag=5 + RANK, source=MPI.ANY_SOURCE, recv_tag=5 + PREV),
            from_prev,
            wildcard=True,
        ),
        Case(
            "recv-defaults-constant-buffer",
            lambda x, c: ring(x, c, template=jnp.zeros(N), tag=5 + RANK, source=MPI.ANY_SOURCE, recv_tag=MPI.ANY_TAG),
            from_prev,
            wildcard=True,
        ),
        Case(
            "recv-any-tag-constant-buffer",
            lambda x, c: ring(x, c, template=jnp.zeros(N), tag=5 + RANK, recv_tag=MPI.ANY_TAG),
            from_prev,
            wildcard=True,
        ),
        Case(
            "send-constant-on-odd-ranks",
            lambda x, c: ring(on_odd_ranks(jnp.full(N, C), x), c, template=on_odd_ranks(x, jnp.zeros(N))),
            lambda xs: from_prev(xs, odd_constant=True),
            linear=False,  # affine
        ),
        # A rank whose operands are all constants still takes part in the
        # derivative's MPI calls.
        Case(
            "bcast-constant-buffer",
            lambda x, c: mpijax.bcast(x if RANK == 0 else jnp.zeros(N), 0, comm=c),
            lambda xs: [xs[0]] * SIZE,
            replicated=True,
        ),
        Case(
            "bcast-constant-root",
            lambda x, c: mpijax.bcast(jnp.full(N, C) if RANK == 0 else x, 0, comm=c),
            lambda xs: [np.full(N, C)] * SIZE,
            replicated=True,
            linear=False,  # constant
        ),
        # Many neighbours at once: a chain (MPI.PROC_NULL at its ends, whose
        # receive gives zeros), oneself, messages of other shapes than x.
        Case("neighbor_exchange-chain", chain_exchange, chain_reference),
        # A ring: at 2 ranks both messages go to the same neighbour (told apart by tag).
        Case(
            "neighbor_exchange-ring",
            lambda x, c: jnp.concatenate(mpijax.neighbor_exchange([x, 3 * x], [PREV, NEXT], [NEXT, PREV], comm=c)),
            lambda xs: [np.concatenate([xs[(r - 1) % SIZE], 3 * xs[(r + 1) % SIZE]]) for r in range(SIZE)],
        ),
        Case(
            "ineighbor_exchange-chain",
            chain_started,
            lambda xs: [
                y + np.concatenate([np.zeros(N + 2), 3 * x]) for y, x in zip(chain_reference(xs), xs, strict=True)
            ],
        ),
        Case("isend-irecv-ring", ring_started, lambda xs: [xs[(r - 1) % SIZE] for r in range(SIZE)]),
        Case(
            "scatter-constant-buffer",
            lambda x, c: mpijax.scatter(x if RANK == 0 else jnp.zeros(N), 0, comm=c),
            lambda xs: [xs[0][r] for r in range(SIZE)],
            shape=lambda rank: (SIZE, N) if rank == 0 else (N,),
        ),
    ]
    return cases


CASES = _cases()
LINEAR = [c for c in CASES if c.linear and not c.wildcard]
# jacfwd vmaps over each rank's input, jacrev over each rank's output: every
# rank must vmap over the same number of basis vectors.
SAME_INPUT_SIZE = [c for c in CASES if len({c.shape(r) for r in range(SIZE)}) == 1]
SAME_OUTPUT_SIZE = [
    c for c in CASES if len({y.shape for y in c.reference([np.ones(c.shape(r)) for r in range(SIZE)])}) == 1
]


def draw(case, what, rank=RANK, shape=None):
    """Random values, the same on every rank for a given (case, what, rank)."""
    rng = np.random.default_rng([zlib.crc32(case.name.encode()), zlib.crc32(what.encode()), rank])
    return rng.uniform(0.5, 2.0, case.shape(rank) if shape is None else shape)


def inputs(case, what="x"):
    return [draw(case, what, r) for r in range(SIZE)]


def cotangents(case):
    """Random cotangents of the result; identical on every rank for a replicated result."""
    ys = case.reference(inputs(case))
    return [draw(case, "w", 0 if case.replicated else r, ys[r].shape) for r in range(SIZE)]


def fd_tangents(case, xs, vs):
    """Central differences of the global function along vs, for every rank."""
    plus = case.reference([x + H * v for x, v in zip(xs, vs, strict=True)])
    minus = case.reference([x - H * v for x, v in zip(xs, vs, strict=True)])
    return [(p - m) / (2 * H) for p, m in zip(plus, minus, strict=True)]


def global_sum(value):
    return WORLD.allreduce(np.asarray(value).item())


def pairing(case, ws, ys):
    """The global pairing of cotangents and results: a replicated result
    counts once. Bilinear, with no conjugate, as JAX's transposes are."""
    total = sum(np.sum(np.multiply(w, y)).item() for w, y in zip(ws, ys, strict=True))
    return total / SIZE if case.replicated else total


def alternating(shift):
    """Each case in one mode, eager and jit in turn: the rules are the same in
    both, only dispatch differs. The shifts of the tests of one case differ,
    so that each case runs both ways."""
    cases = [(case, list(MODES)[(i + shift) % 2]) for i, case in enumerate(CASES)]
    return pytest.mark.parametrize("case,mode", cases, ids=[f"{c!r}-{m}" for c, m in cases])


def assert_close(actual, expected, rtol=1e-6, atol=1e-8):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


@alternating(1)
def test_jvp_and_vjp_against_finite_differences(comm, case, mode):
    """The JVP against central differences J v; the VJP by the dot product:
    sum over ranks of <w, J v> == sum over ranks of <J^T w, v>, with J v from
    central differences in NumPy, and with J v from mpijax's jvp."""
    check_jvp_and_vjp(case, MODES[mode], functools.partial(call_with, case.call, comm))


def on_one_device_mesh(f):
    """f inside jax.shard_map over this process's one device, with JAX's
    check of the values varying over the mesh on (check_vma, the default):
    so a program written for JAX's sharding calls mpijax."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def spec(x):
        return jax.sharding.PartitionSpec("d") if np.ndim(x) else jax.sharding.PartitionSpec()

    return lambda x: jax.shard_map(f, mesh=mesh, in_specs=spec(x), out_specs=spec(jax.eval_shape(f, x)))(x)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_jvp_and_vjp_inside_shard_map(comm, case):
    """The same checks with every op inside shard_map: each transpose's
    cotangents, and the zeros that mpijax makes for tangents and receives,
    must be typed varying over the mesh where their primals are (JAX refused
    grad of a sendrecv, a bcast or a reduce there: "Expected cotangent type
    float32[4]{V:d} but got float32[4]")."""
    check_jvp_and_vjp(case, jax.jit, on_one_device_mesh(functools.partial(call_with, case.call, comm)))


def check_jvp_and_vjp(case, mode, f):
    xs, vs, ws = inputs(case), inputs(case, "v"), cotangents(case)

    def jvp_and_vjp(x, v, w):
        y, ydot = jax.jvp(f, (x,), (v,))
        return y, ydot, jax.vjp(f, x)[1](w)[0]

    y, ydot, xbar = mode(jvp_and_vjp)(xs[RANK], vs[RANK], ws[RANK])
    jv = fd_tangents(case, xs, vs)
    assert_close(y, case.reference(xs)[RANK], rtol=1e-12)
    assert_close(ydot, jv[RANK])
    rhs = global_sum(np.vdot(xbar, vs[RANK]))
    assert rhs == pytest.approx(pairing(case, ws, jv), rel=1e-6)
    assert rhs == pytest.approx(global_sum(np.vdot(ws[RANK], ydot)) / (SIZE if case.replicated else 1), rel=1e-10)


@alternating(0)
def test_grad_against_finite_differences(comm, case, mode):
    """grad of each rank's loss; the global loss sums them (once, if replicated)."""
    xs, vs = inputs(case), inputs(case, "v")

    def global_loss(xs):
        return pairing(case, [np.ones(y.shape) for y in case.reference(xs)], [np.sin(y) for y in case.reference(xs)])

    g = MODES[mode](jax.grad(lambda x: jnp.sum(jnp.sin(case.call(x, comm)))))(xs[RANK])
    fd = (
        global_loss([x + H * v for x, v in zip(xs, vs, strict=True)])
        - global_loss([x - H * v for x, v in zip(xs, vs, strict=True)])
    ) / (2 * H)
    assert global_sum(np.vdot(g, vs[RANK])) == pytest.approx(fd, rel=1e-6)


def _unit(shape, j):
    e = np.zeros(int(np.prod(shape)))
    e[j] = 1.0
    return e.reshape(shape)


@pytest.mark.parametrize("case", SAME_INPUT_SIZE, ids=repr)
def test_jacfwd(comm, case):
    """Column j: every rank moves its input along basis vector j at once."""
    xs = inputs(case)
    jac = np.asarray(jax.jit(jax.jacfwd(lambda x: case.call(x, comm)))(xs[RANK]))
    size = xs[RANK].size
    for j in range(size):
        column = fd_tangents(case, xs, [_unit(x.shape, j) for x in xs])[RANK]
        assert_close(jac.reshape(-1, size)[:, j], column.reshape(-1))


@pytest.mark.parametrize("case", SAME_OUTPUT_SIZE, ids=repr)
def test_jacrev(comm, case):
    """Row i: the cotangent of every rank's result is basis vector i at once;
    entry (i, j) on rank r sums over ranks s the derivative of y_s[i] in x_r[j]
    (once, if replicated)."""
    xs = inputs(case)
    ys = case.reference(xs)
    jac = np.asarray(jax.jit(jax.jacrev(lambda x: case.call(x, comm)))(xs[RANK]))
    size = xs[RANK].size
    for j in range(size):
        moved = [_unit(x.shape, j) if r == RANK else np.zeros(x.shape) for r, x in enumerate(xs)]
        dys = fd_tangents(case, xs, moved)
        for i in range(ys[RANK].size):
            basis = [_unit(y.shape, i) for y in ys]
            assert jac.reshape(-1, size)[i, j] == pytest.approx(pairing(case, basis, dys), abs=1e-7)


@pytest.mark.parametrize("case", LINEAR, ids=repr)
def test_linear_transpose_three_deep(comm, case):
    """T(T(T(f))) == T(f) == the VJP."""
    xs, ws = inputs(case), cotangents(case)
    f = functools.partial(call_with, case.call, comm)
    x, w = jnp.asarray(xs[RANK]), jnp.asarray(ws[RANK])
    once = transposed(f, x)(w)
    thrice = transposed(transposed(transposed(f, x), w), x)(w)
    _, pullback = jax.vjp(f, x)
    assert_close(once, pullback(w)[0], rtol=1e-12)
    assert_close(thrice, once, rtol=1e-12)
    # and T(T(f)) is f
    assert_close(transposed(transposed(f, x), w)(x), f(x), rtol=1e-12)


# The batch axis moved in or out, in turn over the cases: every rule moves
# its operands' batch axes with one helper (batch_operands), so between them
# the cases cover axis 0 (the default) and another on the way in and out.
VMAP_AXES = [(case, *[(-1, 0), (0, -1)][i % 2]) for i, case in enumerate(CASES)]


@pytest.mark.parametrize("case,in_axis,out_axis", VMAP_AXES, ids=[f"{c!r}-{i}-{o}" for c, i, o in VMAP_AXES])
def test_vmap_is_one_call_and_matches_a_loop(comm, case, in_axis, out_axis, capfd):
    batch = [inputs(case, f"batch{b}") for b in range(4)]
    stacked = jnp.asarray(np.stack([b[RANK] for b in batch], axis=in_axis))
    f = functools.partial(call_with, case.call, comm)
    calls = count_calls(capfd, lambda: f(jnp.asarray(batch[0][RANK])))
    vmapped = jax.jit(jax.vmap(f, in_axes=in_axis, out_axes=out_axis))
    assert count_calls(capfd, lambda: vmapped(stacked)) == calls  # one call per vmapped call
    want = np.stack([case.reference(b)[RANK] for b in batch], axis=out_axis)
    assert_close(vmapped(stacked), want, rtol=1e-12)


# The suite runs with jax_enable_x64 (float64 finite differences); most users
# run JAX's default 32-bit mode: a few cases of each kind of call there.
BITS32 = ["allreduce-MAX", "bcast-constant-buffer", "scatter-constant-buffer", "sendrecv",
          "recv-defaults-constant-buffer", "neighbor_exchange-ring", "isend-irecv-ring"]  # fmt: skip


@pytest.mark.parametrize("case", [c for c in CASES if c.name in BITS32], ids=repr)
def test_jvp_vjp_and_vmap_in_jax_default_32_bit_mode(comm, case):
    xs, vs, ws = inputs(case), inputs(case, "v"), cotangents(case)
    batch = [inputs(case, f"batch{b}") for b in range(2)]
    f = functools.partial(call_with, case.call, comm)

    def derivatives_and_vmap(x, v, w, stacked):
        y, ydot = jax.jvp(f, (x,), (v,))
        return y, ydot, jax.vjp(f, x)[1](w)[0], jax.vmap(f)(stacked)

    with jax.enable_x64(False):
        args = [np.float32(a) for a in (xs[RANK], vs[RANK], ws[RANK], np.stack([b[RANK] for b in batch]))]
        y, ydot, xbar, ys = jax.jit(derivatives_and_vmap)(*args)
    jv = fd_tangents(case, xs, vs)
    assert {a.dtype for a in (y, ydot, xbar, ys)} == {np.dtype(np.float32)}
    assert_close(y, case.reference(xs)[RANK], rtol=1e-6)
    assert_close(ydot, jv[RANK], rtol=1e-4, atol=1e-5)
    assert global_sum(np.vdot(xbar, vs[RANK])) == pytest.approx(pairing(case, ws, jv), rel=1e-5)
    assert_close(ys, np.stack([case.reference(b)[RANK] for b in batch]), rtol=1e-6)


# The 16-bit floats and complex: each case in one of them, each dtype in a
# quarter of the cases and over every kind of call (MAX and MIN, which MPI
# does not define on complex numbers, in the 16-bit floats). Receive buffers
# that are constants are zeros_like(x): jnp.zeros(N) is float64 here.
OTHER_DTYPES = ["float16", "complex64", "bfloat16", "complex128"]
DTYPE_CASES = [
    "allreduce-SUM", "allreduce-PROD", f"reduce-MAX-root{ROOTS[-1]}", "scan-PROD", "exscan-PROD",
    "reduce_scatter-MIN", "bcast-root0", f"bcast-root{ROOTS[-1]}", f"gather-root{ROOTS[-1]}", "scatter-root0",
    "allgather", "alltoall", "allgatherv", "alltoallv", f"scatterv-root{ROOTS[-1]}", "ragged_alltoall",
    "sendrecv", "sendrecv-any-source-any-tag", "neighbor_exchange-chain", "ineighbor_exchange-chain",
]  # fmt: skip
DTYPED = [
    (case, OTHER_DTYPES[2 * (i % 2) if "MAX" in case.name or "MIN" in case.name else i % 4])
    for i, case in enumerate(c for c in CASES if c.name in DTYPE_CASES)
]


@pytest.mark.parametrize("case,dtype", DTYPED, ids=[f"{c!r}-{d}" for c, d in DTYPED])
def test_jvp_and_vjp_in_16_bit_and_complex_dtypes(comm, case, dtype):
    """The JVP and VJP in the inputs' dtype, against finite differences in
    float64 (complex128) of the NumPy reference at the same, rounded, inputs,
    within 16 times the dtype's epsilon. Complex inputs, tangents and
    cotangents have random imaginary parts: the reference is holomorphic."""
    dt = np_dtype(dtype)
    wide = np.complex128 if dt.kind == "c" else np.float64

    def typed(what):
        parts = zip(inputs(case, what), inputs(case, what + "-imag"), strict=True)
        return [(re + 1j * im if dt.kind == "c" else re).astype(dt) for re, im in parts]

    xs, vs = typed("x"), typed("v")
    ys = case.reference([x.astype(wide) for x in xs])
    ws = [(w + 1j * w[::-1] if dt.kind == "c" else w).astype(dt) for w in cotangents(case)]
    f = functools.partial(call_with, case.call, comm)

    def jvp_and_vjp(x, v, w):
        y, ydot = jax.jvp(f, (x,), (v,))
        return y, ydot, jax.vjp(f, x)[1](w)[0]

    y, ydot, xbar = jax.jit(jvp_and_vjp)(xs[RANK], vs[RANK], ws[RANK])
    assert {a.dtype for a in (y, ydot, xbar)} == {dt}
    jv = fd_tangents(case, [x.astype(wide) for x in xs], [v.astype(wide) for v in vs])
    rtol = max(16 * float(jnp.finfo(dt).eps), 1e-6)
    scale = max(np.abs(ys[RANK]).max(initial=1), np.abs(jv[RANK]).max(initial=1))
    assert_close(np.asarray(y, wide), ys[RANK], rtol=rtol, atol=rtol * scale)
    assert_close(np.asarray(ydot, wide), jv[RANK], rtol=rtol, atol=rtol * scale)
    ws, vs = [w.astype(wide) for w in ws], [v.astype(wide) for v in vs]
    paired = pairing(case, ws, jv)
    bound = pairing(case, [np.abs(w) for w in ws], [np.abs(j) for j in jv])
    assert abs(global_sum(np.sum(np.asarray(xbar, wide) * vs[RANK])) - paired) <= rtol * bound


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("allreduce-SUM", "sendrecv", "send-recv", "alltoall")], ids=repr
)
def test_vmap_of_grad_and_grad_of_vmap(comm, case):
    """send-recv receives into x itself: a receive buffer computed from the
    batched value, as a separate receive needs there (docs/autodiff.md, rule 2)."""
    batch = [inputs(case, f"batch{b}") for b in range(3)]
    stacked = jnp.asarray(np.stack([b[RANK] for b in batch]))

    def loss(x):
        return jnp.sum(jnp.sin(case.call(x, comm)))

    per_element = [jax.jit(jax.grad(loss))(jnp.asarray(b[RANK])) for b in batch]
    assert_close(jax.jit(jax.vmap(jax.grad(loss)))(stacked), np.stack(per_element), rtol=1e-12)
    assert_close(jax.jit(jax.grad(lambda xs: jnp.sum(jax.vmap(loss)(xs))))(stacked), np.stack(per_element), rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_per_example_derivatives_through_exchanges_into_constant_buffers(comm, mode):
    """neighbor_exchange and ineighbor_exchange carry both ends of their
    messages in one call, so their results follow the batched sends whatever
    the receive buffers are (docs/autodiff.md, rule 2): vmap of grad and grad
    of vmap with recvs=jnp.zeros. Against NumPy: each rank sends x to NEXT
    and 3x to PREV; the loss sums w_r * (a_r**2 + b_r**2) over the ranks, so
    its gradient at rank r is 2 * (w_NEXT + 9 * w_PREV) * x."""
    w = lambda r: np.arange(1.0, N + 1) + 10 * r  # noqa: E731
    zeros = [jnp.zeros(N), jnp.zeros(N)]

    def blocking(x):
        return mpijax.neighbor_exchange([x, 3 * x], [PREV, NEXT], [NEXT, PREV], recvs=zeros, comm=comm)

    def started(x):
        return mpijax.wait(mpijax.ineighbor_exchange([x, 3 * x], [PREV, NEXT], [NEXT, PREV], recvs=zeros, comm=comm))

    xs = np.stack([np.arange(1.0, N + 1) * (b + 1) + RANK for b in range(3)])
    expected = 2 * (w(NEXT) + 9 * w(PREV)) * xs
    for exchange in (blocking, started):

        def loss(x, exchange=exchange):
            a, b = exchange(x)
            return jnp.sum(w(RANK) * (a**2 + b**2))

        assert_close(MODES[mode](jax.vmap(jax.grad(loss)))(xs), expected, rtol=1e-12)
        assert_close(MODES[mode](jax.grad(lambda xs: jnp.sum(jax.vmap(loss)(xs))))(xs), expected, rtol=1e-12)


@pytest.mark.skipif(SIZE < 2, reason="needs a sender")
def test_a_constant_receive_buffer_under_vmap_of_a_derivative_names_the_fix(comm):
    """Per-example derivatives through a receive into jnp.zeros of a batched
    message cannot work (docs/autodiff.md, rule 2): the receiving rank raises,
    naming the cause and the fix. Forward mode: the batched tangent message
    that its receive never took is then received here, by mpi4py."""

    def f(x):
        if RANK == 0:
            mpijax.send(x * 2, 1, comm=comm)
        elif RANK == 1:
            x = x * mpijax.recv(jnp.zeros(3), 0, comm=comm)
        return x

    run = jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (x,))))
    if RANK == 1:
        match = r"(?s)MPI_ERR_TRUNCATE.*longer than the array receiving it.*under jax\.vmap of a derivative.*rule 2"
        with pytest.raises(MPI_FAILURE, match=match):
            jax.block_until_ready(run(jnp.ones((2, 3))))
        status = MPI.Status()
        comm.Probe(0, MPI.ANY_TAG, status)
        assert status.Get_count(MPI.DOUBLE) == 2 * 3
        comm.Recv([np.empty(6), MPI.DOUBLE], 0, status.Get_tag())
    else:
        jax.block_until_ready(run(jnp.ones((2, 3))))


def test_a_constant_bcast_buffer_under_vmap_of_a_derivative_names_the_fix(comm):
    """The same for bcast into jnp.zeros_like(x) off the root (a tester got
    only the collectives' general cause): the rank that receives raises;
    MPICH 4.0 gives the truncation of a collective another class and no
    cause.
    Ranks 0 and 1 take part, on a communicator of their own that the
    unreceived tangent message dies with."""
    pair = comm.Split(int(RANK < 2), RANK)
    f = lambda x: mpijax.bcast(x if RANK == 0 else jnp.zeros_like(x), 0, comm=pair)  # noqa: E731
    run = jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (x,))))
    try:
        if RANK == 1:
            match = r"(?s)mpijax\.bcast failed.*MPI_ERR_TRUNCATE.*under jax\.vmap of a derivative.*zeros_like.*rule 2"
            if MPI.Get_library_version().startswith("MPICH"):  # its class for this (docs/failure-modes.md)
                match = r"mpijax\.bcast failed.*MPI_ERR_OTHER"
            with pytest.raises(MPI_FAILURE, match=match):
                jax.block_until_ready(run(jnp.ones((2, 3))))
        elif RANK == 0 and SIZE > 1:
            jax.block_until_ready(run(jnp.ones((2, 3))))
    finally:
        pair.Free()


@pytest.mark.parametrize("axes", [(0, None), (None, 0), (1, 0)])
def test_vmap_sendrecv_mixed_axes(comm, axes):
    """Batched and unbatched operands mixed: the unbatched one is broadcast."""
    data = np.random.default_rng(7).normal(size=(SIZE, 4, 2))  # rank r's batch
    send_axis, recv_axis = axes
    send = {0: data[RANK], 1: data[RANK].T, None: data[RANK][0]}[send_axis]
    template = np.zeros((4, 2)) if recv_axis == 0 else np.zeros(2)
    want = data[PREV] if send_axis is not None else np.broadcast_to(data[PREV][0], (4, 2))
    f = jax.vmap(lambda s, r: mpijax.sendrecv(s, r, PREV, NEXT, comm=comm), in_axes=(send_axis, recv_axis))
    assert_close(jax.jit(f)(send, template), want, rtol=1e-12)


def test_max_ties_share_the_derivative(comm):
    """Ranks whose values tie for the maximum share the derivative equally."""
    x = jnp.array([5.0, 1.0 + RANK, 7.0 if RANK == 0 else 2.0])  # element 0 ties on every rank
    g = jax.jit(jax.grad(lambda x: jnp.sum(mpijax.allreduce(x, MPI.MAX, comm=comm))))(x)
    assert_close(g, [1.0 / SIZE, 1.0 if RANK == SIZE - 1 else 0.0, 1.0 if RANK == 0 else 0.0])


def test_prod_derivative_where_inputs_are_zero(comm):
    """The derivative of a product is the product of the other factors, also
    where some factor is zero (no division); for the prefix products of scan
    and exscan, summed over the prefixes that hold this rank's factor."""
    xs = [np.array([0.0 if r == 0 else 2.0, 0.0 if r < 2 else 3.0, 1.5]) for r in range(SIZE)]

    def others(ranks):  # the product of the factors of `ranks` but this rank's
        return np.prod([xs[s] for s in ranks if s != RANK] or [np.ones(3)], axis=0)

    wants = {
        mpijax.allreduce: others(range(SIZE)),
        mpijax.scan: sum(others(range(q + 1)) for q in range(RANK, SIZE)),
        mpijax.exscan: sum((others(range(q)) for q in range(RANK + 1, SIZE)), np.zeros(3)),
    }
    for op, want in wants.items():
        g = jax.jit(jax.grad(lambda x: jnp.sum(op(x, MPI.PROD, comm=comm))))(xs[RANK])  # noqa: B023
        assert_close(g, want, rtol=1e-12)


def test_scan_max_ties_share_the_derivative(comm):
    """Within a prefix, ranks that tie for the maximum share the derivative."""
    x = jnp.array([5.0, 1.0 + RANK])  # element 0 ties on every rank; element 1 grows with rank
    g = jax.jit(jax.grad(lambda x: jnp.sum(mpijax.scan(x, MPI.MAX, comm=comm))))(x)
    # Element 0: prefix r (r >= RANK) gives each of its r + 1 tied ranks 1 / (r + 1).
    share = sum(1.0 / (r + 1) for r in range(RANK, SIZE))
    assert_close(g, [share, 1.0])  # element 1: each prefix's maximum is its last rank


FOLDS = {"PROD": np.prod, "MAX": np.max, "MIN": np.min}


@pytest.mark.parametrize("root", [None, 0], ids=["allreduce", "reduce"])
@pytest.mark.parametrize("op", FOLDS)
def test_second_derivatives_of_nonlinear_reductions(comm, op, root):
    """jvp of grad of sum(sin(op over ranks)) (on the root only, for reduce),
    against finite differences of the gradient computed in NumPy: the
    derivative rules of PROD (exclusive scans) and of MIN/MAX (a gather and
    an alltoall) are differentiable again. Values are distinct, so no
    perturbation changes which rank holds the extremum."""
    rng = np.random.default_rng(11)
    xs = 0.5 + rng.permutation(3 * SIZE).reshape(SIZE, 3) / (3 * SIZE)
    vs = rng.normal(size=(SIZE, 3))
    fold = FOLDS[op]

    def numpy_grad(xs):
        y = fold(xs, axis=0)
        others = np.prod([xs[s] for s in range(SIZE) if s != RANK] or [np.ones(3)], axis=0)
        return np.cos(y) * (others if op == "PROD" else xs[RANK] == y)

    def loss(x):
        if root is None:
            return jnp.sum(jnp.sin(mpijax.allreduce(x, getattr(MPI, op), comm=comm)))
        return jnp.sum(jnp.sin(mpijax.reduce(x, getattr(MPI, op), root, comm=comm))) * (RANK == root)

    _, hvp = jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,)))(xs[RANK], vs[RANK])
    assert_close(hvp, (numpy_grad(xs + H * vs) - numpy_grad(xs - H * vs)) / (2 * H), rtol=1e-6)


SECOND = ("recv-constant-buffer", "scatter-constant-buffer", "ineighbor_exchange-chain", "isend-irecv-ring")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SECOND], ids=repr)
def test_second_derivatives_of_receives_into_constants(comm, case):
    """jvp of grad against central differences of the gradient (which the
    tests above check against NumPy), where a receive's buffer is a
    constant: the derivative messages of the receive must be made like the
    sender's. One left unmatched would also spoil the next gradient."""

    def loss(x):
        return jnp.sum(jnp.sin(case.call(x, comm))) * jnp.sum(x)

    x, v = inputs(case)[RANK], inputs(case, "v")[RANK]
    grad = jax.jit(jax.grad(loss))
    before = grad(x)
    _, hvp = jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,)))(x, v)
    assert_close(hvp, (grad(x + H * v) - grad(x - H * v)) / (2 * H), rtol=1e-5, atol=1e-7)
    assert_close(grad(x), before, rtol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c.wildcard], ids=repr)
def test_receives_from_anyone_cannot_be_linearly_transposed(comm, case):
    """linear_transpose never runs the receive, so it cannot know whom to
    answer: it raises on every rank instead of guessing the tag (and hanging)."""
    x = jnp.asarray(inputs(case)[RANK])
    with pytest.raises(NotImplementedError, match="cannot transpose a receive from MPI.ANY_SOURCE or with MPI.ANY_TAG"):
        jax.linear_transpose(functools.partial(call_with, case.call, comm), x)(x)


def _custom_total(comm):
    """sum over ranks of sin(x), a custom_jvp whose function and rule call MPI."""
    total = jax.custom_jvp(lambda x: mpijax.allreduce(jnp.sin(x), MPI.SUM, comm=comm))
    total.defjvp(lambda p, t: (total(p[0]), mpijax.allreduce(jnp.cos(p[0]) * t[0], MPI.SUM, comm=comm)))
    return total


@pytest.mark.parametrize("mode", MODES)
def test_jacfwd_and_hessian_of_a_custom_jvp_with_mpi_calls(comm, mode):
    """jacfwd batches the tangents, not the primal: the rule's primal call
    stays unbatched (it was batched with the tangents, and jacfwd refused
    it, found by testers), also inside a jit, cond, loop or checkpoint and
    under a second jacfwd. Forward mode sums every rank's tangent, and a replicated result
    counts once in reverse mode (docs/autodiff.md)."""
    total = _custom_total(comm)
    xs = [np.linspace(0.1, 1.3, N) + r for r in range(SIZE)]
    s, c = sum(map(np.sin, xs)), sum(map(np.cos, xs))
    x = jnp.asarray(xs[RANK])
    assert_close(MODES[mode](jax.jacfwd(total))(x), np.diag(c), rtol=1e-12)
    hessian = MODES[mode](jax.hessian(lambda x: jnp.sum(total(x) ** 2)))(x)
    assert_close(hessian, np.diag(2 * c * np.cos(xs[RANK]) - 2 * s * np.sin(xs[RANK])), rtol=1e-12)
    # Inside an inner jit, a cond, a loop or a checkpoint the rule runs staged
    # and is batched later, and under jacfwd of jacfwd the inner rule runs
    # under the outer vmap: the primal calls bind the primal twin there
    # (raised as above before).
    in_cond = lambda x: lax.cond(x[0] > -100, total, lambda x: -total(x), x)  # noqa: E731
    in_loop = lambda x: lax.fori_loop(0, 1, lambda i, y: total(y), x)  # noqa: E731
    for f in (jax.jit(total), in_cond, in_loop, jax.checkpoint(total)):
        assert_close(MODES[mode](jax.jacfwd(f))(x), np.diag(c), rtol=1e-12)
    third = np.zeros((N, N, N))
    third[np.arange(N), np.arange(N), np.arange(N)] = -s
    assert_close(MODES[mode](jax.jacfwd(jax.jacfwd(total)))(x), third, rtol=1e-12)
    # A rule whose primal is no call of the function on its own inputs works
    # directly under jacfwd, but inside a jit it is batched with its tangents,
    # and jacfwd refuses it (docs/autodiff.md).
    other = jax.custom_jvp(lambda x: mpijax.allreduce(jnp.sin(x), MPI.SUM, comm=comm))
    allreduce = functools.partial(mpijax.allreduce, op=MPI.SUM, comm=comm)
    other.defjvp(lambda p, t: (allreduce(jnp.sin(p[0])), allreduce(jnp.cos(p[0]) * t[0])))
    assert_close(MODES[mode](jax.jacfwd(other))(x), np.diag(c), rtol=1e-12)
    with pytest.raises(ValueError, match="output was batched"):
        MODES[mode](jax.jacfwd(jax.jit(other)))(x)


@pytest.mark.parametrize("mode", MODES)
def test_custom_derivatives_with_mpi_calls_whose_input_is_constant_on_some_ranks(comm, mode):
    """Only rank 0 differentiates the input. JAX runs a custom function alone
    where no input has a tangent, so the other ranks made none of the rule's
    calls and rank 0 waited for them: jvp of a custom_jvp allreduce, and of
    one whose rule alone calls MPI; grad of a sendrecv ring as a custom_jvp
    and as a custom_vjp (found by testers). Now the rule runs on every rank."""
    total = _custom_total(comm)
    mean_tangent = jax.custom_jvp(lambda x: x)
    mean_tangent.defjvp(lambda p, t: (p[0], mpijax.allreduce(t[0], MPI.SUM, comm=comm) / SIZE))
    shift = jax.custom_jvp(lambda x: mpijax.sendrecv(x, x, PREV, NEXT, recvtag=0, comm=comm))
    shift.defjvp(lambda p, t: (shift(p[0]), shift(t[0])))
    shift_vjp = jax.custom_vjp(lambda x: mpijax.sendrecv(x, x, PREV, NEXT, recvtag=0, comm=comm))
    back = lambda _, g: (mpijax.sendrecv(g, g, NEXT, PREV, recvtag=0, comm=comm),)  # noqa: E731
    shift_vjp.defvjp(lambda x: (shift_vjp(x), None), back)
    p, v = jnp.linspace(0.2, 0.8, N), jnp.linspace(1.0, -1.0, N)
    own = lambda p: p if RANK == 0 else jnp.ones(N)  # noqa: E731
    jvp = lambda f: MODES[mode](lambda p, v: jax.jvp(lambda p: f(own(p)), (p,), (v,))[1])(p, v)  # noqa: E731
    assert_close(jvp(total), np.cos(p) * v, rtol=1e-12)  # rank 0's tangent, on every rank
    assert_close(jvp(mean_tangent), v / SIZE, rtol=1e-12)
    weights = jnp.arange(N) + 1.0 + RANK
    for f in (shift, shift_vjp):
        grad = MODES[mode](jax.grad(lambda p, f=f: jnp.vdot(weights, f(own(p)))))(p)
        # d/dp of sum_r <w_r, x_(r-1)>, with x_0 = p: w_1 on rank 0, nothing elsewhere.
        assert_equal(grad, np.arange(N) + 1.0 + NEXT if RANK == 0 else np.zeros(N))


def test_a_custom_jvp_function_with_python_control_flow_on_its_values():
    """JAX runs a custom_jvp function alone, on concrete values, where its
    input has no tangent; mpijax's look for MPI calls in it (a trace on
    abstract values) must leave such a function to JAX (a tester's
    regression: TracerBoolConversionError)."""
    square_if_positive = jax.custom_jvp(lambda x: x**2 if x > 0 else -x)
    square_if_positive.defjvp(lambda p, t: (square_if_positive(p[0]), 2 * p[0] * t[0]))
    assert jax.grad(lambda y: y * square_if_positive(3.0))(2.0) == 9.0
    assert jax.jvp(lambda y: y * square_if_positive(3.0), (2.0,), (1.0,))[1] == 9.0


def test_a_custom_jvp_rule_receiving_from_anyone_is_refused_under_grad(comm):
    """JAX transposes a custom_jvp rule's tangent code under grad without
    running it: the same error as linear_transpose's, which now names the
    case (found by a tester, with sendrecv's default recvtag), where the
    transpose runs or is compiled, also differentiated again."""
    shift = jax.custom_jvp(lambda x: mpijax.sendrecv(x, x, PREV, NEXT, comm=comm))
    shift.defjvp(lambda primals, tangents: (shift(*primals), shift(*tangents)))
    x = jnp.arange(3.0) + RANK
    assert_equal(jax.jvp(shift, (x,), (2 * x,))[1], 2 * (jnp.arange(3.0) + PREV))
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(shift(x))))
    for f in (grad, jax.jit(grad), jax.jacfwd(grad), jax.jacrev(grad)):
        with pytest.raises(NotImplementedError, match="that has not run: .*a custom_jvp rule's tangent under jax.grad"):
            f(x)


@pytest.mark.parametrize("mode", MODES)
def test_derivatives_of_receives_from_any_source_go_back_to_each_sender(comm, mode):
    """Rank 0 receives from every other rank with the defaults (MPI.ANY_SOURCE,
    MPI.ANY_TAG), in whatever order the messages arrive; each sender used its
    own tag. Rank 0's loss does not depend on the order, so each sender's
    gradient is cos of its own x, and the tangent is the sum over senders."""
    xs, vs = [draw(CASES[0], "x", r) for r in range(SIZE)], [draw(CASES[0], "v", r) for r in range(SIZE)]

    def loss(x):
        if RANK == 0:
            received = [mpijax.recv(jnp.zeros(N), comm=comm) for _ in range(SIZE - 1)]
            return sum((jnp.sum(jnp.sin(y)) for y in received), jnp.zeros(()))
        mpijax.send(x, 0, tag=10 + RANK, comm=comm)
        return jnp.zeros(())

    g = MODES[mode](jax.grad(loss))(xs[RANK])
    assert_close(g, np.cos(xs[RANK]) if RANK else np.zeros(N), rtol=1e-12)
    _, t = MODES[mode](lambda x, v: jax.jvp(loss, (x,), (v,)))(xs[RANK], vs[RANK])
    assert_close(t, sum(np.vdot(np.cos(x), v) for x, v in zip(xs[1:], vs[1:], strict=True)) if RANK == 0 else 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_a_receive_from_anyone_leaves_derivative_messages_to_their_receive(comm, mode):
    """A ring where every rank receives with MPI.ANY_SOURCE and MPI.ANY_TAG,
    and rank 0 starts late: rank 1's forward receive still waits for rank 0's
    value when rank 2, past its forward pass, sends rank 1 a cotangent. The
    receive must take the value and leave the cotangent to the backward pass."""
    xs = [draw(CASES[0], "x", r) for r in range(SIZE)]

    def loss(x):
        return jnp.sum(jnp.sin(mpijax.sendrecv(x, jnp.zeros_like(x), MPI.ANY_SOURCE, NEXT, comm=comm)))

    grad = MODES[mode](jax.grad(loss))
    jax.block_until_ready(grad(xs[RANK]))  # compiled on every rank before the race
    for _ in range(3):
        comm.Barrier()
        if RANK == 0:
            time.sleep(0.2)
        assert_close(grad(xs[RANK]), np.cos(xs[RANK]), rtol=1e-12)


def test_grad_through_scan_receiving_into_a_constant(comm):
    """A receive into a constant buffer depends on nothing that changes in its
    loop: JAX would hoist it out of a differentiated scan, and the sender's
    loop would then wait for receives that never come."""

    def body(c, _):
        return jnp.sin(c) * ring(c, comm, template=jnp.zeros(N)), None

    def with_scan(x):
        return jnp.sum(lax.scan(body, x, None, length=3)[0])

    def unrolled(x):
        for _ in range(3):
            x = body(x, None)[0]
        return jnp.sum(x)

    x = jnp.arange(N) * 0.1 + RANK * 0.01
    assert_close(jax.jit(jax.grad(with_scan))(x), jax.jit(jax.grad(unrolled))(x), rtol=1e-12)


# Control flow, checkpointing and solvers.


def test_derivatives_through_scan_and_fori_loop(comm):
    """grad, jacfwd, jacrev and hessian of three steps in lax.scan and in
    fori_loop against the same steps unrolled. jacfwd is vmap of jvp, which computes
    the primal unbatched: its MPI calls must stay so where a loop's body
    stages them and vmap batches the body afterwards (they were batched, and
    jacfwd refused the batched primal result)."""

    def body(x):
        return jnp.sin(mpijax.sendrecv(x, x, PREV, NEXT, comm=comm)) * mpijax.allreduce(x, MPI.SUM, comm=comm)

    def with_scan(x):
        return lax.scan(lambda c, _: (body(c), None), x, None, length=3)[0]

    def with_fori(x):
        return lax.fori_loop(0, 3, lambda i, c: body(c), x)

    def unrolled(x):
        return body(body(body(x)))

    def summed(f):
        return lambda x: jnp.sum(f(x))

    x = jnp.arange(3.0) * 0.1 + RANK * 0.01 + 0.2
    # jacrev vmaps the transposed loop over each row of the Jacobian.
    for derivative in (jax.grad, jax.jacfwd, jax.jacrev, jax.hessian):
        vector_valued = derivative in (jax.jacfwd, jax.jacrev)
        want = jax.jit(derivative(unrolled if vector_valued else summed(unrolled)))(x)
        for looped in (with_scan, with_fori):  # fori_loop with static bounds lowers to scan
            assert_close(jax.jit(derivative(looped if vector_valued else summed(looped)))(x), want, rtol=1e-12)
    assert_close(jax.grad(summed(with_scan))(x), jax.jit(jax.grad(summed(unrolled)))(x), rtol=1e-12)
    assert_close(jax.jacfwd(with_fori)(x), jax.jit(jax.jacfwd(unrolled))(x), rtol=1e-12)


def test_grad_through_checkpoint(comm):
    @jax.checkpoint
    def layer(x):
        return jnp.tanh(mpijax.allreduce(x, MPI.SUM, comm=comm) * mpijax.bcast(x, 0, comm=comm))

    def loss(x):
        return jnp.sum(layer(layer(x)))

    def plain(x):
        return jnp.sum(layer.__wrapped__(layer.__wrapped__(x)))

    x = jnp.linspace(0.1, 0.3, 3) + RANK * 0.05
    assert_close(jax.jit(jax.grad(loss))(x), jax.jit(jax.grad(plain))(x), rtol=1e-12)


def test_derivatives_of_a_handoff_under_checkpoint_and_in_loops(comm):
    """Each even rank sends to the next rank, which receives into a constant
    buffer: the receiver's calls have constant operands only, where its
    peer's are differentiated. grad against its closed form, and grad,
    jacrev and hessian under jax.checkpoint (nested), in fori_loop and in
    a checkpointed fori_loop against the plain steps. Under checkpoint the
    receiver's tangent receive ran in the forward pass and then received
    again in the backward one, where its peer received too (a deadlock)."""

    def body(x):
        if RANK % 2 == 0:
            if RANK + 1 < SIZE:
                mpijax.send(x, RANK + 1, comm=comm)
            return x * x
        return x * mpijax.recv(jnp.zeros_like(x), RANK - 1, comm=comm)

    def plain(x):
        return jnp.sum(body(body(x)))

    variants = [
        lambda x: jnp.sum(jax.checkpoint(body)(jax.checkpoint(body)(x))),
        lambda x: jnp.sum(lax.fori_loop(0, 2, lambda i, c: body(c), x)),
        lambda x: jnp.sum(lax.fori_loop(0, 2, lambda i, c: jax.checkpoint(body)(c), x)),
    ]
    xs = np.arange(SIZE * N, dtype=np.float64).reshape(SIZE, N) * 0.1 + 0.5
    # Two steps leave x**4 on an even rank and x * x_prev**3 on an odd one;
    # the gradient of their sum over ranks:
    if RANK % 2:
        closed_form = xs[RANK - 1] ** 3
    else:
        after = xs[RANK + 1] if RANK + 1 < SIZE else 0
        closed_form = 4 * xs[RANK] ** 3 + 3 * after * xs[RANK] ** 2
    x = jnp.asarray(xs[RANK])
    assert_close(jax.grad(plain)(x), closed_form, rtol=1e-12)
    for derivative in (jax.grad, jax.jacrev, jax.hessian):
        want = jax.jit(derivative(plain))(x)
        for f in variants:
            assert_close(jax.jit(derivative(f))(x), want, rtol=1e-12)


def _twice(step):
    """Two steps of `step(u, s)`, in each of the ways a simulation code wraps them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    shard = jax.sharding.PartitionSpec("d")
    return {
        "scan": lambda u, s: lax.scan(lambda u, _: (step(u, s), None), u, None, length=2)[0],
        "fori_loop": lambda u, s: lax.fori_loop(0, 2, lambda i, u: step(u, s), u),
        "checkpoint": lambda u, s: jax.checkpoint(step)(jax.checkpoint(step)(u, s), s),
        "cond": lambda u, s: lax.cond(jnp.sum(u) > -1e9, step, lambda u, s: u, step(u, s), s),
        "jit": lambda u, s: jax.jit(step)(jax.jit(step)(u, s), s),
        "shard_map": lambda u, s: jax.shard_map(step, mesh=mesh, in_specs=(shard, shard), out_specs=shard)(
            step(u, s), s
        ),
    }


@pytest.mark.parametrize("wrap", list(_twice(None)))
def test_a_parameter_that_acts_on_one_rank_only(comm, wrap):
    """A control parameter that acts in rank 0's subdomain only: elsewhere
    the loop's (or cond's, checkpoint's, inner jit's, shard_map's) operands
    are constants and its body does not use the parameter, so JAX saw
    nothing to differentiate there, ran the other ranks' derivative calls
    alone (a hang, found by a tester), or ran them forward on zeros (a
    wrong gradient). grad and jvp against central differences of the whole
    simulation in NumPy."""
    prev, next_ = (RANK - 1) % SIZE, (RANK + 1) % SIZE

    def step(u, s):
        u = u + (0.1 * s if RANK == 0 else 0.0)
        return u + 0.25 * mpijax.sendrecv(u, u, prev, next_, comm=comm) ** 2

    def loss(s):
        return jnp.sum(_twice(step)[wrap](jnp.full(N, 0.5), s) ** 2) * (RANK + 1)

    def global_loss(s):
        us = [np.full(N, 0.5) for _ in range(SIZE)]
        for _ in range(2):
            us[0] = us[0] + 0.1 * s
            us = [u + 0.25 * us[(r - 1) % SIZE] ** 2 for r, u in enumerate(us)]
        return sum(np.sum(u**2) * (r + 1) for r, u in enumerate(us))

    s, v = np.linspace(0.2, 0.8, N), np.linspace(1.0, -1.0, N)
    fd = (global_loss(s + H * v) - global_loss(s - H * v)) / (2 * H)
    g = jax.jit(jax.grad(loss))(s)
    assert global_sum(np.vdot(g, v)) == pytest.approx(fd, rel=1e-6)
    if RANK:
        assert_equal(g, np.zeros(N))
    _, tangent = jax.jit(lambda s, v: jax.jvp(loss, (s,), (v,)))(s, v)
    assert global_sum(tangent) == pytest.approx(fd, rel=1e-6)


def test_vmap_of_cond_whose_predicate_is_batched(comm):
    """vmap of a cond on a batched predicate that differs between the ranks
    (each rank's own data decides): each element runs its own branch, and
    receives what its peer's element computed in the peer's branch. (JAX
    runs both branches on the whole batch: each branch's message paired
    with the peer's same branch, found by a tester.)"""

    def f(x):
        return lax.cond(
            x[0] > 0,
            lambda c: mpijax.sendrecv(c, jnp.zeros_like(c), PREV, NEXT, comm=comm),
            lambda c: 2 * mpijax.sendrecv(-3 * c, jnp.zeros_like(c), PREV, NEXT, comm=comm) + 1,
            x,
        )

    signs = [np.random.default_rng(r).choice([-1.0, 1.0], size=(6, 1)) for r in range(SIZE)]
    xs = [signs[r] * (np.arange(6 * N).reshape(6, N) + 1 + 100 * r) for r in range(SIZE)]
    message = np.where(signs[PREV] > 0, xs[PREV], -3 * xs[PREV])
    want = np.where(signs[RANK] > 0, message, 2 * message + 1)
    for mode in MODES.values():
        assert_close(mode(jax.vmap(f))(jnp.asarray(xs[RANK])), want, rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_cg_with_distributed_matvec(comm, mode):
    """A = sum over ranks of A_r (SPD), each rank holds A_r; cg on the
    replicated system A x = b with matvec allreduce(A_r @ x); and its
    gradient with respect to b."""
    rng = np.random.default_rng(3)
    parts = [rng.normal(size=(4, 4)) for _ in range(SIZE)]
    parts = [p @ p.T + 4 * np.eye(4) for p in parts]
    a, b = sum(parts), np.arange(1.0, 5.0)
    mine = jnp.asarray(parts[RANK])

    def solve(b):
        x, _ = jax.scipy.sparse.linalg.cg(lambda v: mpijax.allreduce(mine @ v, MPI.SUM, comm=comm), b, tol=1e-12)
        return x

    assert_close(MODES[mode](solve)(b), np.linalg.solve(a, b), rtol=1e-8)
    g = MODES[mode](jax.grad(lambda b: jnp.sum(solve(b) ** 2)))(jnp.asarray(b))
    assert_close(g, 2 * np.linalg.solve(a, np.linalg.solve(a, b)), rtol=1e-7)


@pytest.mark.parametrize("solver", ["bicgstab", "gmres"])
def test_nonsymmetric_solvers_with_a_matvec_that_receives(comm, solver):
    """bicgstab and gmres transpose their matvec without running it
    (lax.custom_linear_solve): with the source and tag passed, the gradient
    is right; with sendrecv's default recvtag, MPI.ANY_TAG, the solve is
    right (eager and jitted: the transpose is taken, never run) and its grad
    raises on every rank, before the transpose runs. The replicated matvec is A v = sum over ranks of M_r v +
    P_r v, P_r v reaching rank r + 1 by sendrecv; v is marked varying, or the
    transposed matvec would give each rank its own share of A^T w only."""
    rng = np.random.default_rng(5)
    ms = [rng.normal(size=(4, 4)) + 3 * np.eye(4) for _ in range(SIZE)]
    ps = [rng.normal(size=(4, 4)) for _ in range(SIZE)]
    a, b = sum(ms) + sum(ps), np.arange(1.0, 5.0)
    m, p = jnp.asarray(ms[RANK]), jnp.asarray(ps[RANK])
    solve_with = getattr(jax.scipy.sparse.linalg, solver)

    def loss(b, **recvtag):
        def matvec(v):
            v = mpijax.varying(v, comm=comm)  # each rank's own product of the replicated v
            received = mpijax.sendrecv(p @ v, v, PREV, NEXT, comm=comm, **recvtag)
            return mpijax.allreduce(m @ v + received, MPI.SUM, comm=comm)

        return jnp.sum(solve_with(matvec, b, tol=1e-12, atol=0.0)[0] ** 2)

    x = np.linalg.solve(a, b)
    value, g = jax.jit(jax.value_and_grad(functools.partial(loss, recvtag=0)))(jnp.asarray(b))
    assert_close(value, np.sum(x**2), rtol=1e-8)
    assert_close(g, 2 * np.linalg.solve(a.T, x), rtol=1e-7)
    for mode in MODES.values():
        assert_close(mode(loss)(jnp.asarray(b)), np.sum(x**2), rtol=1e-8)
    bs = jnp.stack([b, 2 * b])
    assert_close(jax.vmap(loss)(bs), [np.sum(x**2), 4 * np.sum(x**2)], rtol=1e-8)
    for mode in MODES.values():
        with pytest.raises(NotImplementedError, match="that has not run: .*lax.custom_linear_solve's matvec"):
            mode(jax.grad(loss))(jnp.asarray(b))


# Replicated results that feed work differing by rank --------------------------
# Each rank does its own work on a value every rank holds alike, and the ranks'
# losses are allreduced. Marked with mpijax.varying, the value's cotangents are
# summed over the ranks; the global loss, a NumPy function of every rank's
# input, is differentiated by central differences, element by element.

DATA = [np.random.default_rng([11, r]).normal(size=N) for r in range(SIZE)]


def _variance(x, comm, mark=mpijax.varying):
    mean = mark(mpijax.allreduce(jnp.sum(x), MPI.SUM, comm=comm) / (N * SIZE), comm=comm)
    return mpijax.allreduce(jnp.sum((x - mean) ** 2), MPI.SUM, comm=comm)


def _root_parameters_fit_every_rank(x, comm, mark=mpijax.varying):
    p = mark(mpijax.bcast(x, 0, comm=comm), comm=comm)
    return mpijax.allreduce(jnp.sum((p * DATA[RANK] - 1.0) ** 2), MPI.SUM, comm=comm)


def _next_ranks_row(x, comm, mark=mpijax.varying):
    rows = mark(mpijax.allgather(x, comm=comm), comm=comm)
    return mpijax.allreduce(jnp.sum(jnp.sin(rows[NEXT]) * DATA[RANK]), MPI.SUM, comm=comm)


REPLICATED_INTO_LOCAL = {
    "variance": (_variance, lambda xs: np.sum((np.concatenate(xs) - np.mean(np.concatenate(xs))) ** 2)),
    "bcast parameters": (
        _root_parameters_fit_every_rank,
        lambda xs: sum(np.sum((xs[0] * DATA[r] - 1.0) ** 2) for r in range(SIZE)),
    ),
    "allgather row": (
        _next_ranks_row,
        lambda xs: sum(np.sum(np.sin(xs[(r + 1) % SIZE]) * DATA[r]) for r in range(SIZE)),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", REPLICATED_INTO_LOCAL)
def test_varying_sums_the_cotangents_of_a_replicated_value(comm, name, mode):
    f, reference = REPLICATED_INTO_LOCAL[name]
    xs = [np.random.default_rng([5, r]).normal(size=N) for r in range(SIZE)]

    def moved(r, j, h):
        return [x + h * (s == r) * np.eye(N)[j] for s, x in enumerate(xs)]

    fd = [(reference(moved(RANK, j, H)) - reference(moved(RANK, j, -H))) / (2 * H) for j in range(N)]
    loss = functools.partial(f, comm=comm)
    assert_close(MODES[mode](jax.grad(loss))(jnp.asarray(xs[RANK])), fd, rtol=1e-6, atol=1e-7)
    if SIZE > 1:  # unmarked, the gradient is wrong on some rank, and nothing says so
        unmarked = functools.partial(f, comm=comm, mark=lambda value, comm: value)
        wrong = not np.allclose(MODES[mode](jax.grad(unmarked))(jnp.asarray(xs[RANK])), fd, rtol=1e-6, atol=1e-7)
        assert comm.allreduce(wrong, op=MPI.LOR)
    # Forward mode needs no mark, and the mark changes nothing there.
    vs = [np.random.default_rng([6, r]).normal(size=N) for r in range(SIZE)]
    _, tangent = MODES[mode](lambda x, v: jax.jvp(loss, (x,), (v,)))(jnp.asarray(xs[RANK]), jnp.asarray(vs[RANK]))
    plus = reference([x + H * v for x, v in zip(xs, vs, strict=True)])
    minus = reference([x - H * v for x, v in zip(xs, vs, strict=True)])
    assert_close(tangent, (plus - minus) / (2 * H), rtol=1e-6, atol=1e-7)


def test_varying_under_vmap_and_its_transposes(comm):
    """vmap of the marked gradient against each batch entry, and the
    mark's transpose is the sum over ranks (its own transpose the mark)."""
    xs = np.stack([np.random.default_rng([8, r]).normal(size=(2, N)) for r in range(SIZE)])
    grads = jax.jit(jax.vmap(jax.grad(functools.partial(_variance, comm=comm))))(jnp.asarray(xs[RANK]))
    for b in range(2):
        spread = np.concatenate(xs[:, b])
        assert_close(grads[b], 2 * (xs[RANK, b] - spread.mean()), rtol=1e-10)
    mark = functools.partial(mpijax.varying, comm=comm)
    x = jnp.asarray(xs[RANK, 0])
    (summed,) = jax.linear_transpose(mark, x)(x)
    assert_close(summed, xs[:, 0].sum(axis=0), rtol=1e-12)
    (back,) = jax.linear_transpose(lambda y: jax.linear_transpose(mark, x)(y)[0], x)(x)
    assert_close(back, xs[RANK, 0], rtol=1e-12)
