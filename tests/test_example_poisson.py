"""examples/poisson_cg.py: the distributed CG solve of the walled Poisson problem against the same
solve on one rank (a Cartesian communicator of COMM_SELF) and against a dense NumPy solve of the
matrix assembled here cell by cell, and jax.grad of the loss through the solve (an adjoint CG
solve) against central finite differences of the dense solve. N = 12 splits evenly over the
decompositions of 1, 2 and 3 ranks (1 x 1, 2 x 1, 3 x 1)."""

import jax
import numpy as np
import pytest
from mpi4py import MPI

import poisson_cg
from reference import SIZE

pytestmark = pytest.mark.usefixtures("watchdog")

N = 12
TOL = 1e-12


@pytest.fixture
def cart(comm):
    c = comm.Create_cart(MPI.Compute_dims(SIZE, 2), periods=[False, False])
    yield c
    c.Free()


def dense_matrix(theta):
    """The operator as a dense (N*N, N*N) matrix, written cell by cell: each face between two
    cells carries the harmonic mean of their kappa, a wall face 2 kappa of its cell (the wall
    is h/2 away), all over h^2."""
    kappa, h2 = np.exp(theta), (1.0 / N) ** 2
    a = np.zeros((N * N, N * N))
    for i in range(N):
        for j in range(N):
            for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                p, (k, m) = i * N + j, (i + di, j + dj)
                if 0 <= k < N and 0 <= m < N:
                    face = 2 * kappa[i, j] * kappa[k, m] / (kappa[i, j] + kappa[k, m])
                    a[p, k * N + m] -= face / h2
                else:
                    face = 2 * kappa[i, j]
                a[p, p] += face / h2
    return a


def dense_solve(theta, f):
    return np.linalg.solve(dense_matrix(theta), f.ravel()).reshape(N, N)


def dense_loss(theta, f, target):
    return np.sum((dense_solve(theta, f) - target) ** 2) / N**2


def solve_on(c):
    """CG's solution on the Cartesian communicator c, gathered on every rank."""
    theta, problem = poisson_cg.setup(N, c)
    comms = poisson_cg.mpijax_comms(c)
    u, (steps, rel) = jax.jit(lambda theta: poisson_cg.solve(theta, problem, comms, TOL))(theta)
    assert float(rel) <= TOL and 0 < int(steps) < 10_000
    return poisson_cg.gather_interior(u, c)


def test_distributed_solve_equals_one_rank_and_dense_solves(cart):
    """The CG iterates on any number of ranks differ from one rank's only by the rounding of the
    sums over ranks; both meet the dense solution to within CG's tolerance."""
    alone = MPI.COMM_SELF.Create_cart([1, 1], periods=[False, False])
    try:
        distributed, one_rank = solve_on(cart), solve_on(alone)
    finally:
        alone.Free()
    theta, f, _ = poisson_cg.global_fields(N)
    want = dense_solve(theta, f)
    np.testing.assert_allclose(distributed, one_rank, rtol=1e-10)
    np.testing.assert_allclose(distributed, want, rtol=1e-10)
    np.testing.assert_allclose(one_rank, want, rtol=1e-10)


def test_grad_through_the_solve_against_finite_differences(cart):
    """The gradient (its adjoint solve included) along one random global direction, summed over
    ranks, against central differences of the dense solve's loss."""
    theta, problem = poisson_cg.setup(N, cart)
    comms = poisson_cg.mpijax_comms(cart)
    value, grad = jax.jit(jax.value_and_grad(lambda theta: poisson_cg.loss(theta, problem, comms, TOL)))(theta)
    theta_g, f_g, target_g = poisson_cg.global_fields(N)
    direction = np.random.default_rng(5).normal(size=(N, N))
    mine = np.sum(np.asarray(grad)[1:-1, 1:-1] * poisson_cg.local_block(direction, cart)[1:-1, 1:-1])
    eps = 1e-4
    fd = (
        dense_loss(theta_g + eps * direction, f_g, target_g) - dense_loss(theta_g - eps * direction, f_g, target_g)
    ) / (2 * eps)
    np.testing.assert_allclose(float(value), dense_loss(theta_g, f_g, target_g), rtol=1e-10)
    np.testing.assert_allclose(cart.allreduce(float(mine)), fd, rtol=1e-6)
    # Ghost values of theta are overwritten by the halo exchange or unused beyond a wall.
    ghosts = np.ones(np.shape(grad), bool)
    ghosts[1:-1, 1:-1] = False
    assert not np.any(np.asarray(grad)[ghosts])
