"""The rotating shallow-water equations on a doubly periodic plane, split
over the ranks of an MPI job, one jitted time loop per rank.

    mpirun -n 2 python examples/shallow_water.py             # writes shallow_water.png
    mpirun -n 4 python examples/shallow_water.py --animate   # and shallow_water.gif

Two opposite jets in geostrophic balance, nudged by a little noise, become
unstable and roll up into vortices. The unknowns sit on an Arakawa C-grid:
the surface height h at the cell centres, the velocity u on the cells' east
faces and v on their north faces. In vector-invariant form,

    du/dt =  q (h v) - d/dx (g h + k) + nu lap u
    dv/dt = -q (h u) - d/dy (g h + k) + nu lap v
    dh/dt = -d/dx (h u) - d/dy (h v)

with the potential vorticity q = (f + dv/dx - du/dy) / h at the cell corners
and the kinetic energy k = (u^2 + v^2) / 2 at the centres, stepped by a
three-stage strong-stability-preserving Runge-Kutta scheme.

Each rank holds a block of the grid with one ghost cell on every side: one
mpijax.halo_exchange fills the ghost cells of h, u and v together before each
stage, and one allreduce per output interval sums the energy and mass.
"""

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

import mpijax

DAY = 86400.0
EVERY = 0.25  # days of steps in each compiled loop: between energy checks (and frames)


class Config(NamedTuple):
    n: int = 256  # grid cells along each side
    length: float = 5.0e6  # domain side, m
    depth: float = 500.0  # mean depth H, m
    f: float = 1.0e-4  # Coriolis parameter, 1/s
    g: float = 9.81  # gravity, m/s^2
    jet_speed: float = 30.0  # m/s
    jet_width: float = 1.5e5  # m
    noise: float = 0.5  # amplitude of the initial height noise, m
    viscosity: float = 1.0e3  # m^2/s, damps what the grid cannot resolve
    courant: float = 0.4  # of the gravity-wave speed

    @property
    def dx(self):
        return self.length / self.n

    @property
    def dt(self):
        return self.courant * self.dx / (self.g * self.depth) ** 0.5


class Comms(NamedTuple):
    """All the communication the model does: a benchmark swaps these for
    other bindings (benchmarks/apps.py)."""

    halo: Callable  # a pytree of blocks -> the same with their ghost cells filled
    sum: Callable  # an array -> its sum over ranks


def mpijax_comms(cart):
    return Comms(
        halo=lambda fields: mpijax.halo_exchange(fields, cart),
        sum=lambda x: mpijax.allreduce(x, op=MPI.SUM, comm=cart),
    )


def initial_state(cfg, rows, cols, dtype=jnp.float32):
    """h, u, v on the whole grid (the same on every rank, whatever the
    decomposition), cut to the block of grid rows `rows` and columns `cols`
    with one ghost cell each side. The jets u(y) are balanced by a height
    drop across them, f u = -g dh/dy."""
    y = (np.arange(cfg.n) + 0.5) * cfg.dx  # cell centres; u shares them along y
    jets = [(cfg.length / 4, 1.0), (3 * cfg.length / 4, -1.0)]
    u = sum(s * cfg.jet_speed / np.cosh((y - y0) / cfg.jet_width) ** 2 for y0, s in jets)
    h = cfg.depth - sum(
        s * cfg.f * cfg.jet_speed * cfg.jet_width / cfg.g * np.tanh((y - y0) / cfg.jet_width) for y0, s in jets
    )
    noise = cfg.noise * np.random.default_rng(0).standard_normal((cfg.n, cfg.n))
    fields = (h[:, None] + noise, np.broadcast_to(u[:, None], (cfg.n, cfg.n)), np.zeros((cfg.n, cfg.n)))
    index = np.ix_(np.arange(rows.start - 1, rows.stop + 1) % cfg.n, np.arange(cols.start - 1, cols.stop + 1) % cfg.n)
    return tuple(jnp.asarray(a[index], dtype) for a in fields)


def at(a, dj, di):
    """a[j + dj, i + di] at every [j, i] of the block. It wraps around the
    block's edges, which only reaches the ghost cells' results: the interior
    never looks further than one cell away."""
    return jnp.roll(a, (-dj, -di), axis=(0, 1))


def kinetic(u, v):
    """(u^2 + v^2) / 2 at the cell centres, from the faces on either side."""
    return 0.25 * (u**2 + at(u, 0, -1) ** 2 + v**2 + at(v, -1, 0) ** 2)


def tendencies(state, cfg):
    h, u, v = state
    dx = cfg.dx
    hu = 0.5 * (h + at(h, 0, 1)) * u  # mass fluxes, on the faces
    hv = 0.5 * (h + at(h, 1, 0)) * v
    corner_h = 0.25 * (h + at(h, 0, 1) + at(h, 1, 0) + at(h, 1, 1))
    q = (cfg.f + (at(v, 0, 1) - v) / dx - (at(u, 1, 0) - u) / dx) / corner_h
    bernoulli = cfg.g * h + kinetic(u, v)

    def lap(a):
        return (at(a, 0, 1) + at(a, 0, -1) + at(a, 1, 0) + at(a, -1, 0) - 4 * a) / dx**2

    # q and the flux across, each averaged onto the face where it acts.
    hv_at_u = 0.25 * (hv + at(hv, 0, 1) + at(hv, -1, 0) + at(hv, -1, 1))
    hu_at_v = 0.25 * (hu + at(hu, 1, 0) + at(hu, 0, -1) + at(hu, 1, -1))
    du = 0.5 * (q + at(q, -1, 0)) * hv_at_u - (at(bernoulli, 0, 1) - bernoulli) / dx + cfg.viscosity * lap(u)
    dv = -0.5 * (q + at(q, 0, -1)) * hu_at_v - (at(bernoulli, 1, 0) - bernoulli) / dx + cfg.viscosity * lap(v)
    dh = -(hu - at(hu, 0, -1) + hv - at(hv, -1, 0)) / dx
    return dh, du, dv


def step(state, cfg, comms):
    """One time step, three stages, each after a halo exchange. The ghost
    cells' results are garbage: the next exchange overwrites them."""

    def euler(s):  # s with its ghost cells filled
        return jax.tree.map(lambda a, da: a + cfg.dt * da, s, tendencies(s, cfg))

    def mix(a, b, w):
        return jax.tree.map(lambda x, y: (1 - w) * x + w * y, a, b)

    # The stages mix their results with the state as exchanged: no copy of
    # it without its ghost cells has to live beside it.
    state = comms.halo(state)
    s1 = euler(state)
    s2 = mix(state, euler(comms.halo(s1)), 0.25)
    return mix(state, euler(comms.halo(s2)), 2.0 / 3.0)


def totals(state, cfg, comms):
    """The energy (available potential and kinetic, per unit density) and
    the mass above the mean depth, of the whole domain. Both are sums of
    departures from rest, which single precision adds up accurately."""
    h, u, v = comms.halo(state)
    eta = h - cfg.depth
    energy = 0.5 * cfg.g * eta**2 + h * kinetic(u, v)
    return comms.sum(jnp.stack([jnp.sum(energy[1:-1, 1:-1]), jnp.sum(eta[1:-1, 1:-1])]) * cfg.dx**2)


def simulate(state, steps, cfg, comms):
    """`steps` time steps in one compiled loop, then the domain's totals."""
    state = lax.fori_loop(0, steps, lambda _, s: step(s, cfg, comms), state)
    return state, totals(state, cfg, comms)


def time_loop(cfg, cart, every=EVERY):
    """The loop that main compiles, as a function of the state: `every` days
    of steps, then the totals; and its number of steps."""
    steps = max(1, round(every * DAY / cfg.dt))
    return (lambda state: simulate(state, steps, cfg, mpijax_comms(cart))), steps


def decompose(comm, n):
    """A 2-D Cartesian communicator, periodic both ways, and this rank's rows
    and columns of the n x n grid."""
    dims = MPI.Compute_dims(comm.Get_size(), 2)
    if n % dims[0] or n % dims[1]:
        raise SystemExit(f"--n {n} does not split over a {dims[0]} x {dims[1]} grid of ranks: pick a multiple of both")
    cart = comm.Create_cart(dims, periods=[True, True])
    (py, px), (cy, cx) = dims, cart.Get_coords(cart.Get_rank())
    return cart, slice(cy * n // py, (cy + 1) * n // py), slice(cx * n // px, (cx + 1) * n // px)


def gather_field(a, cart, n):
    """The whole grid of a field (h, u or v) on rank 0, None elsewhere."""
    blocks = np.asarray(mpijax.gather(a[1:-1, 1:-1], root=0, comm=cart))
    if cart.Get_rank() != 0:
        return None
    ny, nx = blocks.shape[1:]  # every rank's block has this shape (decompose)
    full = np.empty((n, n), blocks.dtype)
    for r, block in enumerate(blocks):
        cy, cx = cart.Get_coords(r)
        full[cy * ny : (cy + 1) * ny, cx * nx : (cx + 1) * nx] = block
    return full


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=Config._field_defaults["n"], help="grid cells along each side")
    parser.add_argument("--days", type=float, default=10.0, help="simulated time")
    parser.add_argument("--every", type=float, default=EVERY, help="days between energy checks (and frames)")
    parser.add_argument("--out", default="shallow_water.png", help="picture of the final height")
    parser.add_argument("--animate", action="store_true", help="also write an animation, the PNG's name with .gif")
    args = parser.parse_args()
    if not (args.days > 0 and args.every > 0):
        parser.error("--days and --every must be positive")

    comm = MPI.COMM_WORLD
    cfg = Config(n=args.n)
    cart, rows, cols = decompose(comm, cfg.n)
    rank0 = cart.Get_rank() == 0
    loop, chunk = time_loop(cfg, cart, min(args.every, args.days))
    chunks = max(1, round(args.days * DAY / (chunk * cfg.dt)))

    def say(*what):
        if rank0:
            print(*what, flush=True)

    dims = cart.Get_topo()[0]
    where = jax.devices()[0].platform
    say(f"{cfg.n} x {cfg.n} cells on {dims[0]} x {dims[1]} ranks ({where}), {chunks * chunk} steps of {cfg.dt:.0f} s")
    state = initial_state(cfg, rows, cols)
    start = time.perf_counter()
    advance = jax.jit(loop).lower(state).compile()
    say(f"compiled in {time.perf_counter() - start:.1f} s")

    first = np.asarray(jax.jit(lambda s: totals(s, cfg, mpijax_comms(cart)))(state))
    frames = [gather_field(state[0], cart, cfg.n)] if args.animate else []
    mass0 = cfg.depth * cfg.length**2
    start = shown = time.perf_counter()
    for c in range(1, chunks + 1):
        state, (energy, mass) = advance(state)
        energy, mass = float(energy), float(mass)  # waits for the chunk
        if args.animate:
            frames.append(gather_field(state[0], cart, cfg.n))
        now = time.perf_counter()
        if now - shown > 3 or c == chunks:
            shown = now
            say(
                f"day {c * chunk * cfg.dt / DAY:5.2f}  {c * chunk / (now - start):6.0f} steps/s  "
                f"energy change {energy / first[0] - 1:+.1e}  mass change {(mass - first[1]) / mass0:+.1e}"
            )
    elapsed = time.perf_counter() - start
    say(f"{chunks * chunk / elapsed:.1f} steps/s ({elapsed:.1f} s for {chunks * chunk} steps)")

    final = gather_field(state[0], cart, cfg.n)
    if rank0:
        if not np.all(np.isfinite(final)):
            raise SystemExit("the run blew up: lower Config.courant or raise Config.viscosity")
        plot(final, cfg, args.out, f"day {chunks * chunk * cfg.dt / DAY:.1f}, {comm.Get_size()} ranks")
        print(f"wrote {args.out}")
        if args.animate:
            animate(frames, cfg, args.out.rsplit(".", 1)[0] + ".gif")


def plot(h, cfg, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    km = cfg.length / 1e3
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(h, origin="lower", extent=(0, km, 0, km), cmap="RdBu_r")
    fig.colorbar(image, ax=ax, label="surface height h (m)")
    ax.set(xlabel="x (km)", ylabel="y (km)", title=f"shallow water, {title}")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def animate(frames, cfg, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.animation
    import matplotlib.pyplot as plt

    km = cfg.length / 1e3
    fig, ax = plt.subplots(figsize=(5, 5))
    image = ax.imshow(frames[0], origin="lower", extent=(0, km, 0, km), cmap="RdBu_r")
    image.set_clim(frames[-1].min(), frames[-1].max())
    ax.set(xlabel="x (km)", ylabel="y (km)")
    movie = matplotlib.animation.FuncAnimation(fig, lambda i: [image.set_data(frames[i])], len(frames))
    movie.save(path, writer=matplotlib.animation.PillowWriter(fps=10))
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
