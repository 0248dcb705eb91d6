"""A distributed conjugate-gradient solve of a 2-D Poisson problem, and its gradient.

    -div(kappa grad u) = f  on the unit square,  u = 0 on its walls,  kappa = exp(theta)

on an N x N cell-centred grid split over the ranks of a 2-D Cartesian communicator. Each rank
holds its block of cells with one ghost cell on every side, refreshed by mpijax.halo_exchange;
the dot products of CG are summed over ranks by mpijax.allreduce. The solve is wrapped in
lax.custom_linear_solve, so jax.grad of a loss of u goes through it by a second CG solve (the
adjoint) instead of back through the iterations; main checks that gradient against central
finite differences.

    mpirun -n 2 python examples/poisson_cg.py [--n 128] [--tol 1e-12]

Discretization (finite volumes, spacing h = 1/N): cell P exchanges with each neighbour Q the
flux k_PQ (u_P - u_Q) / h across their shared face, with k_PQ the harmonic mean of kappa in the
two cells (two half cells in series, so the flux stays continuous where kappa jumps). A wall face
lies h/2 from its cell's centre with u = 0 on it: its flux is 2 kappa_P u_P / h, which is the same
formula with a ghost cell u_Q = 0 and zero resistance 1/kappa_Q = 0. So ghosts beyond a wall stay
0 and count as zero resistance; the operator is symmetric positive definite.

All communication goes through a `Comms` object; the solver and the loss touch only local blocks,
so another backend (shard_map with ppermute and psum, say) can run them unchanged.
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


class Comms(NamedTuple):
    halo: Callable  # block (ny + 2, nx + 2) -> the same with ghosts filled from neighbours (walls: kept)
    sum: Callable  # array -> its element-wise sum over all ranks, on every rank


def mpijax_comms(cart) -> Comms:
    return Comms(
        halo=lambda x: mpijax.halo_exchange(x, cart, corners=False),
        sum=lambda x: mpijax.allreduce(x, op=MPI.SUM, comm=cart),
    )


class Problem(NamedTuple):
    """This rank's blocks, each (ny + 2, nx + 2) with one ghost cell per side."""

    f: np.ndarray  # source
    target: np.ndarray  # the u the loss fits
    inside: np.ndarray  # 1 on cells of the domain (ours and our neighbours'), 0 on ghosts beyond a wall
    h: float  # grid spacing, 1 / N


# ---------------------------------------------------------------- set-up (host side, NumPy)


def block_bounds(n, parts, k):
    """Cells [lo, hi) of part k when n cells are split as evenly as possible."""
    return n * k // parts, n * (k + 1) // parts


def local_block(glob, cart, fill=0.0):
    """This rank's block of a global N x N field, with one ghost cell per side: the neighbours'
    cells, or `fill` beyond a wall. Every rank builds the same global field, so the problem
    does not depend on the number of ranks."""
    dims, _, coords = cart.Get_topo()
    (r0, r1), (c0, c1) = (block_bounds(glob.shape[a], dims[a], coords[a]) for a in (0, 1))
    return np.pad(glob, 1, constant_values=fill)[r0 : r1 + 2, c0 : c1 + 2]


def global_fields(n):
    """theta, f and u_target on the cell centres of the global grid."""
    y, x = np.meshgrid((np.arange(n) + 0.5) / n, (np.arange(n) + 0.5) / n, indexing="ij")
    theta = 1.5 * np.sin(2 * np.pi * x) * np.sin(3 * np.pi * y)  # kappa from 0.22 to 4.5
    f = 1.0 + 10.0 * np.exp(-((x - 0.3) ** 2 + (y - 0.6) ** 2) / 0.01)  # a background and a hot spot
    target = 0.05 * np.sin(np.pi * x) * np.sin(np.pi * y)
    return theta, f, target


def setup(n, cart):
    """(theta, problem): this rank's blocks of the global problem on an n x n grid."""
    theta, f, target = global_fields(n)
    problem = Problem(
        f=local_block(f, cart),
        target=local_block(target, cart),
        inside=local_block(np.ones((n, n)), cart, fill=0.0),
        h=1.0 / n,
    )
    return local_block(theta, cart), problem


def gather_interior(x, cart):
    """The global field assembled from every rank's block interior, on every rank (NumPy)."""
    blocks = cart.allgather((cart.Get_coords(cart.Get_rank()), np.asarray(x)[1:-1, 1:-1]))
    dims = cart.Get_topo()[0]
    n = [sum(b.shape[a] for c, b in blocks if c[1 - a] == 0) for a in (0, 1)]
    glob = np.empty(n, dtype=blocks[0][1].dtype)
    for (i, j), b in blocks:
        (r0, _), (c0, _) = block_bounds(n[0], dims[0], i), block_bounds(n[1], dims[1], j)
        glob[r0 : r0 + b.shape[0], c0 : c0 + b.shape[1]] = b
    return glob


# ---------------------------------------------------------------- solver (local blocks + comms)


def operator(theta, problem, comms):
    """The matrix-free operator A: interior (ny, nx) -> interior (ny, nx)."""
    # Resistance 1/kappa, zero beyond a wall: the harmonic mean below then gives a wall face 2 kappa.
    rho = problem.inside * jnp.exp(-comms.halo(theta))
    kx = 2 / (rho[1:-1, :-1] + rho[1:-1, 1:])  # faces between columns j and j + 1: (ny, nx + 1)
    ky = 2 / (rho[:-1, 1:-1] + rho[1:, 1:-1])  # faces between rows i and i + 1: (ny + 1, nx)
    h2 = problem.h**2

    def matvec(v):
        u = comms.halo(jnp.pad(v, 1))  # ghosts beyond a wall stay 0
        fx = kx * (u[1:-1, 1:] - u[1:-1, :-1])
        fy = ky * (u[1:, 1:-1] - u[:-1, 1:-1])
        return -(fx[:, 1:] - fx[:, :-1] + fy[1:] - fy[:-1]) / h2

    return matvec


def cg(matvec, b, dot, tol, maxiter):
    """Conjugate gradients from x = 0 until |r| <= tol |b| or maxiter steps.
    Returns x and (steps, |r| / |b|), |r| the recurrence's residual."""
    bb = dot(b, b)

    def unconverged(s):
        k, _, _, _, rr = s
        return (k < maxiter) & (rr > tol**2 * bb)

    def step(s):
        k, x, r, p, rr = s
        ap = matvec(p)
        alpha = rr / dot(p, ap)
        x, r = x + alpha * p, r - alpha * ap
        rr_next = dot(r, r)
        return k + 1, x, r, r + (rr_next / rr) * p, rr_next

    k, x, _, _, rr = lax.while_loop(unconverged, step, (0, jnp.zeros_like(b), b, b, bb))
    return x, (k, jnp.sqrt(rr / jnp.where(bb > 0, bb, 1)))  # b = 0 (a zero cotangent): x = 0, no steps


def solve(theta, problem, comms, tol=1e-12, maxiter=10_000):
    """u (ny + 2, nx + 2, ghosts 0) and (CG steps, relative residual). Differentiable in theta:
    the derivative is one more CG solve with the same (symmetric) operator."""
    dot = lambda a, b: comms.sum(jnp.sum(a * b))  # noqa: E731
    u, info = lax.custom_linear_solve(
        operator(theta, problem, comms),
        problem.f[1:-1, 1:-1],
        solve=lambda matvec, b: cg(matvec, b, dot, tol, maxiter),
        symmetric=True,
        has_aux=True,
    )
    return jnp.pad(u, 1), info


def loss(theta, problem, comms, tol=1e-12, maxiter=10_000):
    """The integral of (u - u_target)^2 over the whole domain."""
    u, _ = solve(theta, problem, comms, tol, maxiter)
    misfit = (u - problem.target)[1:-1, 1:-1]
    return comms.sum(jnp.sum(misfit**2)) * problem.h**2


def residual(u, theta, problem, comms):
    """|f - A u| / |f| over the whole domain, recomputed (not CG's recurrence)."""
    r = problem.f[1:-1, 1:-1] - operator(theta, problem, comms)(u[1:-1, 1:-1])
    return jnp.sqrt(comms.sum(jnp.sum(r**2)) / comms.sum(jnp.sum(problem.f[1:-1, 1:-1] ** 2)))


# ---------------------------------------------------------------- driver


def main():
    jax.config.update("jax_enable_x64", True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=128, help="grid cells per side")
    parser.add_argument("--tol", type=float, default=1e-12, help="CG's relative residual")
    parser.add_argument("--maxiter", type=int, default=10_000)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    dims = MPI.Compute_dims(world.size, 2)
    if args.n < max(dims):
        parser.error(f"--n {args.n} leaves some of the {dims[0]} x {dims[1]} blocks without cells")
    cart = world.Create_cart(dims, periods=[False, False])
    comms = mpijax_comms(cart)
    say = print if cart.rank == 0 else lambda *a: None
    theta, problem = setup(args.n, cart)
    say(f"{cart.size} rank(s), {dims[0]} x {dims[1]} blocks of about {args.n // dims[0]} x {args.n // dims[1]} cells")

    solve_jit = jax.jit(lambda theta: solve(theta, problem, comms, args.tol, args.maxiter))
    jax.block_until_ready(solve_jit(theta))  # compile
    start = time.perf_counter()
    u, (steps, rel) = jax.block_until_ready(solve_jit(theta))
    seconds = time.perf_counter() - start
    true_rel = jax.jit(lambda u, theta: residual(u, theta, problem, comms))(u, theta)
    say(f"N = {args.n}: CG {int(steps)} steps, relative residual {float(rel):.2e} (recomputed {float(true_rel):.2e})")
    say(f"solve: {seconds * 1e3:.1f} ms (compiled)")

    objective = lambda theta: loss(theta, problem, comms, args.tol, args.maxiter)  # noqa: E731
    value, grad = jax.jit(jax.value_and_grad(objective))(theta)  # the adjoint: a second CG solve
    # One global direction drawn identically on every rank; each rank takes its block.
    direction = local_block(np.random.default_rng(0).normal(size=(args.n, args.n)), cart)
    along = world.allreduce(float(np.sum(np.asarray(grad)[1:-1, 1:-1] * direction[1:-1, 1:-1])))
    eps = 1e-4
    loss_jit = jax.jit(objective)
    fd = (float(loss_jit(theta + eps * direction)) - float(loss_jit(theta - eps * direction))) / (2 * eps)
    say(f"loss {float(value):.10e}")
    say(f"grad . d = {along:.10e}, finite difference {fd:.10e}, relative error {abs(along - fd) / abs(fd):.1e}")


if __name__ == "__main__":
    main()
