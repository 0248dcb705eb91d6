"""neighbor_exchange, cart_neighbors and halo_exchange against NumPy
references built from every rank's input: rings, chains with MPI.PROC_NULL
ends, oneself as neighbour, repeated neighbours, messages far above the eager
limit, Cartesian halos (faces and corners, periodic or walled, widths 1 and
2), the argument checks, and grad through a loop of halo-exchange steps
against finite differences. Derivatives and vmap of neighbor_exchange itself
are in test_autodiff.py's case table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpijax

from reference import (
    BIG,
    DTYPES,
    MODES,
    MPI_FAILURE,
    RANK,
    SIZE,
    assert_equal,
    checkerboard,
    count_calls,
    data,
    hlo_copies,
    np_dtype,
    transposed,
)

pytestmark = pytest.mark.usefixtures("watchdog")

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


def run(mode, f, *args):
    return [np.asarray(y) for y in MODES[mode](f)(*args)]


@checkerboard(2, dtype=DTYPES, shape=[(), (0,), (5,), (4, 2)])
def test_ring_both_ways_and_oneself(comm, mode, dtype, shape):
    xs = [[data(shape, dtype, r, seed) for seed in range(3)] for r in range(SIZE)]
    got = run(
        mode,
        lambda a, b, c: mpijax.neighbor_exchange([a, b, c], [PREV, NEXT, RANK], [NEXT, PREV, RANK], comm=comm),
        *xs[RANK],
    )
    for y, want in zip(got, [xs[PREV][0], xs[NEXT][1], xs[RANK][2]], strict=True):
        assert_equal(y, want)


@pytest.mark.parametrize("mode", MODES)
def test_chain_ends_receive_zeros_and_send_nothing(comm, mode):
    left = PREV if RANK > 0 else MPI.PROC_NULL
    right = NEXT if RANK < SIZE - 1 else MPI.PROC_NULL
    x = jnp.full((3,), RANK + 1.0)
    to_right, to_left = run(
        mode, lambda x: mpijax.neighbor_exchange([x, -x], [left, right], [right, left], comm=comm), x
    )
    assert_equal(to_right, np.full(3, float(RANK)) if RANK > 0 else np.zeros(3))
    assert_equal(to_left, -np.full(3, RANK + 2.0) if RANK < SIZE - 1 else np.zeros(3))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocking", [True, False], ids=["neighbor_exchange", "ineighbor_exchange"])
def test_integers_received_as_floats_carry_no_derivative(comm, mode, blocking):
    """A message that is an integer at one end and floating-point at the other
    carries no derivative, at both ends alike: its float end once waited for a
    cotangent (or sent one) that its integer end never sent (or received),
    which hung or, left queued, made a later gradient wrong."""

    def exchange(sends, recvs):
        if blocking:
            return mpijax.neighbor_exchange(sends, [PREV] * 2, [NEXT] * 2, recvs=recvs, comm=comm)
        (out,) = mpijax.wait([mpijax.ineighbor_exchange(sends, [PREV] * 2, [NEXT] * 2, recvs=recvs, comm=comm)])
        return out

    ids = jnp.arange(4, dtype=jnp.int32) + RANK

    def int_to_float(x):
        a, b = exchange([x, ids], [x, jax.ShapeDtypeStruct((4,), jnp.float32)])
        return jnp.sum(a**2) + jnp.sum(b)

    def float_to_int(x):
        a, b = exchange([x, 2 * x], [x, jax.ShapeDtypeStruct((4,), jnp.int32)])
        return jnp.sum(a**2) + jnp.sum(b)

    def floats(x):
        a, b = exchange([x, 3 * x], [x, x])
        return jnp.sum(a**2) + jnp.sum(b)

    x = jnp.arange(4, dtype=jnp.float32) + 1  # the same on every rank
    for f, want in [(int_to_float, 2 * x), (float_to_int, 2 * x), (floats, 2 * x + 3)]:
        assert_equal(MODES[mode](jax.grad(f))(x), want)


@pytest.mark.parametrize("mode", MODES)
def test_receive_specs_and_tags(comm, mode):
    """Receives of another shape and dtype than the sends (same bytes), given
    as arrays or ShapeDtypeStructs; tags chosen by the caller, the same
    neighbour twice (in reverse order on the receiving side)."""
    x = jnp.arange(6, dtype=jnp.float32) + 10 * RANK
    recvs = [jax.ShapeDtypeStruct((2, 3), jnp.float32), jnp.zeros(3, jnp.int64)]
    got = run(
        mode,
        lambda x: mpijax.neighbor_exchange(
            [x, x[:6].view(jnp.int32)], [PREV, PREV], [NEXT, NEXT], recvs=recvs, tags=[7, 3], comm=comm
        ),
        x,
    )
    theirs = np.arange(6, dtype=np.float32) + 10 * PREV
    assert_equal(got[0], theirs.reshape(2, 3))
    assert_equal(got[1], theirs.view(np.int64))


def test_large_messages_all_at_once(comm):
    """8 MiB each way and to oneself: every message in flight at once, none
    waiting for another (blocking sends in a row would deadlock here)."""
    n = BIG // 4
    x = jnp.arange(n, dtype=jnp.float32) + RANK
    got = jax.jit(
        lambda x: mpijax.neighbor_exchange([x, x + 1, x + 2], [PREV, NEXT, RANK], [NEXT, PREV, RANK], comm=comm)
    )(x)
    base = np.arange(n, dtype=np.float32)
    for y, want in zip(got, [base + PREV, base + NEXT + 1, base + RANK + 2], strict=True):
        assert_equal(y, want)


def test_no_messages(comm):
    assert mpijax.neighbor_exchange([], [], [], comm=comm) == []


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(sources=[RANK], dests=[RANK, RANK]), ValueError, "dests has 2 entries; expected 1"),
        (dict(sources=[MPI.ANY_SOURCE], dests=[RANK]), ValueError, r"sources\[0\]=MPI.ANY_SOURCE is not accepted"),
        (dict(sources=[RANK], dests=[SIZE]), ValueError, rf"dests\[0\]={SIZE} is out of range"),
        (
            dict(sources=[RANK], dests=[RANK], tags=[MPI.ANY_TAG]),
            ValueError,
            r"tags\[0\]=MPI.ANY_TAG is not accepted",
        ),
        (dict(sources=[RANK], dests=[RANK], recvs=[np.zeros(2)]), ValueError, "must fill its receive exactly"),
        (dict(sources=[RANK], dests=RANK), TypeError, "dests must be a list or tuple"),
    ],
)
def test_argument_errors_at_trace_time(comm, kwargs, error, match):
    with pytest.raises(error, match=match):
        jax.jit(lambda x: mpijax.neighbor_exchange([x], comm=comm, **kwargs)).lower(jnp.ones(3))


@pytest.mark.parametrize("mode", MODES)
def test_one_array_for_the_list_of_sends_is_refused(comm, mode):
    """sends=x for sends=[x]: an array would pass as one message per element
    (found by a tester: "sources has 1 entries; expected 4")."""
    with pytest.raises(TypeError, match="sends must be a list or tuple, got"):
        MODES[mode](lambda x: mpijax.neighbor_exchange(x, [RANK], [RANK], comm=comm))(jnp.arange(4.0))
    with pytest.raises(TypeError, match="sends must be a list or tuple, got dict"):
        mpijax.neighbor_exchange({"a": jnp.ones(2)}, [RANK], [RANK], comm=comm)
    # Arrays of ranks and tags are no ambiguity.
    (y,) = mpijax.neighbor_exchange([jnp.ones(2)], np.array([RANK]), np.array([RANK]), tags=np.array([3]), comm=comm)
    assert_equal(y, np.ones(2))


def test_a_message_to_oneself_needs_its_receive(comm):
    with pytest.raises(ValueError, match="goes to this rank itself with tag 0, but no receive"):
        mpijax.neighbor_exchange([jnp.ones(2)], [MPI.PROC_NULL], [RANK], comm=comm)


@pytest.mark.skipif(SIZE < 2, reason="needs a neighbour")
@pytest.mark.parametrize(
    "sent,dtype,received,match",
    [
        (2, "float64", 4, "shorter than its receive"),
        (4, "float64", 2, "MPI_ERR_TRUNCATE"),
        (4, "float32", 4, r"shorter than its receive(?=.*byte for byte \(the same number of elements)"),
    ],
)
def test_a_message_of_the_wrong_size_is_an_error_where_it_arrives(comm, sent, dtype, received, match):
    """Rank 0 sends to rank 1 a message of another size (or dtype) than rank
    1 expects (float64): rank 1 raises, naming the message; rank 0's send
    completes."""
    f = {
        0: lambda: mpijax.neighbor_exchange([jnp.ones(sent, dtype)], [MPI.PROC_NULL], [1], comm=comm),
        1: lambda: mpijax.neighbor_exchange([jnp.ones(0)], [0], [MPI.PROC_NULL], recvs=[jnp.ones(received)], comm=comm),
    }.get(RANK, lambda: [])
    try:
        if RANK == 1:
            with pytest.raises(MPI_FAILURE, match=rf"(?s){match}.*receiving from rank 0 with tag 0"):
                jax.block_until_ready(f())
        else:
            jax.block_until_ready(f())
    finally:
        comm.Barrier()


def cart(periodic, ndim=2):
    return MPI.COMM_WORLD.Create_cart(MPI.Compute_dims(SIZE, ndim), periods=[periodic] * ndim)


@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("corners", [True, False])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_cart_neighbors(periodic, corners, ndim):
    c = cart(periodic, ndim)
    dims, coords = c.Get_topo()[0], c.Get_coords(RANK)
    got = mpijax.cart_neighbors(c, corners=corners)
    assert len(got.offsets) == (3**ndim - 1 if corners else 2 * ndim)
    for offset, source, dest in zip(*got, strict=True):
        for sign, peer in ((1, dest), (-1, source)):
            at = [x + sign * d for x, d in zip(coords, offset, strict=True)]
            inside = all(0 <= a < n for a, n in zip(at, dims, strict=True))
            want = (
                c.Get_cart_rank([a % n for a, n in zip(at, dims, strict=True)]) if periodic or inside else MPI.PROC_NULL
            )
            assert peer == want, (offset, sign)
    c.Free()


@pytest.mark.parametrize("name", ["cart_neighbors", "halo_exchange"])
def test_a_cartesian_communicator_and_a_bool_corners_are_needed(comm, name):
    """Named after the function called (halo_exchange's error named
    cart_neighbors), and corners="no" is refused, not taken as true (found
    by a tester)."""
    call = getattr(mpijax, name)
    args = (jnp.zeros((3, 3)),) if name == "halo_exchange" else ()
    with pytest.raises(TypeError, match=f"mpijax.{name}: comm must be a Cartesian communicator .* got Intracomm"):
        call(*args, comm)
    c = cart(True)
    with pytest.raises(TypeError, match=f"mpijax.{name}: corners must be True or False, got str 'no'"):
        call(*args, c, corners="no")
    c.Free()


def local_block(glob, c, interior, width, fill):
    """This rank's block of `glob` with `width` ghost cells per side: the
    neighbours' cells (the other side of the domain where periodic), or
    `fill` beyond a wall."""
    dims, periods, coords = c.Get_topo()
    padded = glob
    for axis, periodic in enumerate(periods):
        pad = [(0, 0)] * glob.ndim
        pad[axis] = (width, width)
        padded = np.pad(padded, pad, mode="wrap") if periodic else np.pad(padded, pad, constant_values=fill)
    index = tuple(slice(k * n, k * n + n + 2 * width) for k, n in zip(coords, interior, strict=True))
    return padded[index]


def grid_case(periods, corners, width, split="rows"):
    """A 2-D Cartesian communicator, this rank's block of a global array with
    its ghost cells stale (a value of each rank's own), and what
    halo_exchange must make of it: the block of the padded global array,
    with the stale value beyond walls, and in the corners without
    `corners`."""
    dims = MPI.Compute_dims(SIZE, 2)
    c = MPI.COMM_WORLD.Create_cart(dims if split == "rows" else dims[::-1], periods=list(periods))
    dims = c.Get_topo()[0]
    stale = -1.0 - RANK
    glob = np.arange(np.prod(dims) * 12, dtype=np.float64).reshape(dims[0] * 4, dims[1] * 3)
    want = local_block(glob, c, (4, 3), width, fill=stale)
    before = want.copy()
    before[:width], before[-width:], before[:, :width], before[:, -width:] = stale, stale, stale, stale
    if not corners:
        for i in (slice(0, width), slice(-width, None)):
            for j in (slice(0, width), slice(-width, None)):
                want[i, j] = stale
    return c, before, want


@checkerboard(
    periods=[(True, True), (False, False), (False, True), (True, False)],
    split=["rows", "columns"],
    corners=[True, False],
    width=[1, 2],
)
def test_halo_exchange_fills_ghost_cells_like_the_global_array(mode, periods, split, corners, width):
    """Every rank's block against the padded global array. The ghosts start
    stale with a value of each rank's own, which those beyond a wall keep
    (corners too, though the corners arrive through the faces of the axes
    before theirs), as do the corners without `corners`."""
    c, before, want = grid_case(periods, corners, width, split)
    got = MODES[mode](lambda x: mpijax.halo_exchange(x, c, width=width, corners=corners))(before)
    assert_equal(got, want)
    c.Free()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("periodic", [True, False])
def test_halo_exchange_of_several_fields_in_one_call(mode, periodic):
    """A pytree of fields of different dtypes and trailing shapes: each comes
    back as if exchanged alone, all in a single neighbor_exchange."""
    c = cart(periodic)
    dims = c.Get_topo()[0]
    shape = (dims[0] * 4, dims[1] * 3)
    fields = {
        "h": np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
        "uv": np.arange(2 * np.prod(shape), dtype=np.int64).reshape(*shape, 2) - 7,
    }
    want = {k: local_block(f, c, (4, 3), 1, fill=-1) for k, f in fields.items()}
    before = {k: w.copy() for k, w in want.items()}
    for b in before.values():
        b[0], b[-1], b[:, 0], b[:, -1] = -1, -1, -1, -1
    exchange = lambda f: mpijax.halo_exchange(f, c)  # noqa: E731
    got = MODES[mode](exchange)(before)
    assert sorted(got) == ["h", "uv"]
    for k in want:
        assert_equal(got[k], want[k])
    calls = [e.primitive.name for e in jax.make_jaxpr(exchange)(before).eqns if "mpijax" in e.primitive.name]
    # One call for all fields and axes; none where every side is a wall.
    assert calls == ["mpijax_halo_exchange"] * (periodic or SIZE > 1)
    c.Free()


@checkerboard(dtype=DTYPES, shape=[(2,), (0,)])
def test_halo_exchange_moves_every_dtype_and_trailing_shape(mode, dtype, shape):
    """The handler packs bytes: every dtype, with trailing axes (empty too)."""
    c, before, want = grid_case((True, False), True, 1)
    field = lambda a: (a[..., None] * (1 + np.arange(shape[0]))).astype(np_dtype(dtype))  # noqa: E731
    assert_equal(MODES[mode](lambda x: mpijax.halo_exchange(x, c))(field(before)), field(want))
    c.Free()


@checkerboard(2, periods=[(True, True), (False, True), (False, False)], corners=[True, False], width=[1, 2])
def test_halo_exchange_derivatives(mode, periods, corners, width):
    """Linear: its JVP exchanges the tangent the same way, and its VJP is its
    adjoint: <H x, y> = <x, H^T y> summed over ranks for random x and y (H
    itself is checked against NumPy above). An integer field rides along
    with no derivative of its own."""
    c, before, _ = grid_case(periods, corners, width)
    rng = np.random.default_rng([RANK, width])
    x, t, y = rng.normal(size=(3, *before.shape))
    k = np.arange(before.size).reshape(before.shape) + 100 * RANK

    def h(a):
        return mpijax.halo_exchange(a, c, width=width, corners=corners)

    hx, ht = MODES[mode](lambda x, t: jax.jvp(h, (x,), (t,)))(x, t)
    assert_equal(hx, h(x))
    assert_equal(ht, h(t))
    (hty,) = MODES[mode](lambda x, y: jax.vjp(h, x)[1](y))(x, y)
    world = MPI.COMM_WORLD
    np.testing.assert_allclose(world.allreduce(np.sum(h(x) * y)), world.allreduce(np.sum(x * hty)), rtol=1e-12)
    grad = MODES[mode](jax.grad(lambda x, k: jnp.sum(h((x, k))[0] * y) + jnp.sum(h((x, k))[1])))(x, k)
    assert_equal(grad, hty)
    c.Free()


@pytest.mark.parametrize("periods,corners", [((True, True), True), ((False, True), False)])
def test_halo_exchange_jacobians_and_linear_transpose(periods, corners):
    """jacfwd's columns are the exchange of each basis vector (every rank's
    at once), jacrev's rows the VJP of each basis cotangent (which the test
    above checks as the adjoint), and linear_transpose is the VJP, three
    deep too."""
    c, before, _ = grid_case(periods, corners, 1)
    n = before.size
    basis = np.eye(n).reshape(n, *before.shape)
    y = np.random.default_rng([RANK, 1]).normal(size=before.shape)

    def h(a):
        return mpijax.halo_exchange(a, c, corners=corners)

    pullback = jax.vjp(h, before)[1]
    columns = jax.jit(jax.vmap(h))(basis).reshape(n, n).T
    rows = jax.jit(jax.vmap(lambda e: pullback(e)[0]))(basis).reshape(n, n)
    assert_equal(jax.jit(jax.jacfwd(h))(before).reshape(n, n), columns)
    assert_equal(jax.jit(jax.jacrev(h))(before).reshape(n, n), rows)
    assert_equal(transposed(h, before)(y), pullback(y)[0])
    assert_equal(transposed(transposed(transposed(h, before), y), before)(y), pullback(y)[0])
    c.Free()


def test_halo_exchange_in_a_time_loop_copies_no_field():
    """In place: the exchanged field is the call's output, so a time loop
    whose state is exchanged and then used compiles with no copy of the field
    in its body, and none at all when its input is donated (as a long run's
    state is); one that still uses the field unexchanged after the call gets
    the one copy that needs."""
    c = cart(True)
    field = jnp.zeros((18, 12), jnp.float32)

    def step(_, f):
        f = mpijax.halo_exchange(f, c)
        return f.at[1:-1, 1:-1].set(0.25 * (f[:-2, 1:-1] + f[2:, 1:-1] + f[1:-1, :-2] + f[1:-1, 2:]))

    def copies(f):
        return hlo_copies(jax.jit(f, donate_argnums=0), field)

    def loop(f):
        return lax.fori_loop(0, 4, step, f)

    assert copies(loop) == []
    assert len(copies(lambda f: mpijax.halo_exchange(f, c) + f)) == 1
    # Not donated, the input is copied before the loop, and the loop's body copies nothing.
    text = jax.jit(loop).lower(field).compile().as_text()
    copying = [part.split("{")[0] for part in text.split("\n\n") if " copy(" in part and "f32[18,12]" in part]
    assert len(copying) == 1 and copying[0].startswith("ENTRY"), copying
    c.Free()


@pytest.mark.parametrize("axis", [0, -1])
def test_halo_exchange_under_vmap(capfd, axis):
    """A batch of blocks, batched at either end, beside an unbatched field:
    each member as if exchanged alone, the batch in as many MPI calls as one
    exchange of the two fields."""
    c, before, want = grid_case((True, False), True, 1, split="columns")
    batch = np.stack([before + 100 * b for b in range(3)], axis)
    wants = np.stack([want + 100 * b for b in range(3)], axis)
    exchange = lambda a, b: mpijax.halo_exchange((a, b), c)  # noqa: E731
    batched = jax.jit(jax.vmap(exchange, in_axes=(axis, None), out_axes=axis))
    got, other = batched(batch, before)
    assert_equal(got, wants)
    assert_equal(other, np.stack([want] * 3, axis))
    alone = jax.jit(exchange)
    assert count_calls(capfd, lambda: batched(batch, before)) == count_calls(capfd, lambda: alone(before, before)) > 0
    c.Free()


@pytest.mark.parametrize("periods,corners", [((True, True), True), ((False, True), False)])
def test_the_gpu_lowering_on_the_cpu(periods, corners):
    """On GPUs halo_exchange lowers to slices and a neighbor_exchange per
    round (neighbors._by_slices): the same ghost cells, checked here."""
    from mpijax._src import comm as comms
    from mpijax._src.ops import neighbors

    c, before, want = grid_case(periods, corners, 2)
    faces = mpijax.cart_neighbors(c, corners=False)
    plan = neighbors._plan(c, faces, [before.shape], 2, corners)
    params = dict(comm=comms.resolve(c, "test").id, axes=2, **plan)
    (got,) = jax.jit(lambda x: neighbors._by_slices(x, **params))(before)
    assert_equal(got, want)
    c.Free()


def test_halo_exchange_checks_its_array():
    c = cart(True)
    with pytest.raises(ValueError, match=r"at least 3 \* width = 6 cells"):
        mpijax.halo_exchange(jnp.zeros((5, 9)), c, width=2)
    with pytest.raises(ValueError, match=r"halo_exchange: width must be at least 1 \(ghost cells per side\), got 0"):
        mpijax.halo_exchange(jnp.zeros((5, 9)), c, width=0)
    c.Free()


STEPS = 4


def diffuse(u, c):
    """STEPS explicit steps of a 5-point diffusion stencil with a nonlinear
    source, ghost cells refreshed by a halo exchange each step."""

    def step(_, u):
        u = mpijax.halo_exchange(u, c, corners=False)
        lap = u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * u[1:-1, 1:-1]
        return u.at[1:-1, 1:-1].add(0.1 * lap + 0.05 * jnp.sin(u[1:-1, 1:-1]))

    u = lax.fori_loop(0, STEPS, step, u)
    return jnp.sum(u[1:-1, 1:-1] ** 2)


def diffuse_global(glob):
    for _ in range(STEPS):
        lap = sum(np.roll(glob, s, axis) for axis in (0, 1) for s in (1, -1)) - 4 * glob
        glob = glob + 0.1 * lap + 0.05 * np.sin(glob)
    return np.sum(glob**2)


def test_grad_through_a_loop_of_halo_exchange_steps():
    """The gradient of a periodic diffusion run (every rank's loss summed)
    against central finite differences of the same run in NumPy on the whole
    grid, along a random direction."""
    c = cart(True)
    dims = c.Get_topo()[0]
    rng = np.random.default_rng(3)
    glob, direction = rng.normal(size=(2, dims[0] * 4, dims[1] * 4))
    local = lambda g: local_block(g, c, (4, 4), 1, fill=0.0)  # noqa: E731
    grad = jax.jit(jax.grad(lambda u: diffuse(u, c)))(local(glob))
    mine = float(np.sum(np.asarray(grad)[1:-1, 1:-1] * local(direction)[1:-1, 1:-1]))
    h = 1e-6
    fd = (diffuse_global(glob + h * direction) - diffuse_global(glob - h * direction)) / (2 * h)
    np.testing.assert_allclose(MPI.COMM_WORLD.allreduce(mine), fd, rtol=1e-6)
    c.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs a neighbour")
def test_the_watchdog_names_the_message_it_waited_for(comm):
    """Rank 0 waits for a message rank 1 never sends: the watchdog raises,
    naming it."""
    mpijax.set_timeout(1)
    try:
        if RANK == 0:
            with pytest.raises(MPI_FAILURE, match="timed out .* a message from rank 1 with tag 5"):
                jax.block_until_ready(
                    mpijax.neighbor_exchange([jnp.ones(2)], [1], [MPI.PROC_NULL], tags=[5], comm=comm)
                )
    finally:
        mpijax.set_timeout(60)
        comm.Barrier()


def test_check_mode_leaves_it_alone(comm):
    """Check mode does not cover neighbor_exchange (messages to several peers
    at once are checked by size on arrival, always): it runs as without it."""
    mpijax.set_check(True)
    try:
        (y,) = mpijax.neighbor_exchange([jnp.arange(3.0) + RANK], [PREV], [NEXT], comm=comm)
    finally:
        mpijax.set_check(False)
    assert_equal(y, np.arange(3.0) + PREV)


def test_integer_messages_have_no_derivatives(comm):
    """Integer messages ride along; the derivative exchanges leave them out on
    both ends (a message of floats and one of ints, both ways round)."""

    def loss(x):
        y, k = mpijax.neighbor_exchange([x, jnp.arange(3) + RANK], [PREV, NEXT], [NEXT, PREV], comm=comm)
        return jnp.sum(y**2) + jnp.sum(k)

    x = jnp.arange(3.0) + RANK
    value, grad = jax.jit(jax.value_and_grad(loss))(x)
    assert float(MPI.COMM_WORLD.allreduce(float(value))) == sum(
        float(np.sum((np.arange(3.0) + r) ** 2) + np.sum(np.arange(3) + r)) for r in range(SIZE)
    )
    assert_equal(grad, 2 * (np.arange(3.0) + RANK))  # x's square is computed on the next rank
