"""examples/data_parallel.py: training with the gradients averaged over the
ranks of a communicator gives the same loss curve and parameters as one
process training alone on the whole of every batch, and the gradient that
the training uses is that of the whole batch's mean loss."""

import hashlib

import jax
import numpy as np
import pytest
from mpi4py import MPI

import mpijax

import data_parallel as dp

pytestmark = pytest.mark.usefixtures("watchdog")

# float64: the runs differ only in the order in which the terms of the
# gradient are summed (over a rank's rows, then over ranks), near 1e-16
# relative, and a few steps of Adam amplify that little.
DTYPE = np.float64
RTOL = 1e-12
SAMPLES, BATCH, EPOCHS = 48, 12, 2  # 8 steps; a batch of 12 splits evenly over 1, 2, 3, 4 and 6 ranks
STEPS = EPOCHS * SAMPLES // BATCH


def setup():
    data = dp.dataset(SAMPLES, seed=1, dtype=DTYPE)
    params = dp.init_params(jax.random.key(1), [2, 16, 16, 1], DTYPE)
    return data, params


def train(comm):
    """Trains on `comm`; returns the final parameters, the loss curve and the
    averaged (loss, gradients) of every step, as the training used them."""
    seen = []

    def average(tree):
        out = dp.mpi_average(comm)(tree)
        jax.debug.callback(lambda t: seen.append(jax.tree.map(np.asarray, t)), out, ordered=True)
        return out

    data, params = setup()
    params, curve = dp.train(params, data, EPOCHS, BATCH, average, comm.Get_rank(), comm.Get_size(), lr=1e-2, seed=1)
    return params, np.asarray(curve), seen


@pytest.fixture(scope="module")
def runs():
    """Both trainings, once for all the tests (each compiles its own loop):
    on a duplicate of COMM_WORLD, and in this process alone."""
    mpijax.set_timeout(60)  # as the watchdog does, which starts after this fixture
    comm = MPI.COMM_WORLD.Dup()
    try:
        yield {"comm": train(comm), "self": train(MPI.COMM_SELF)}
    finally:
        comm.Free()
        mpijax.set_timeout(None)


def assert_close(actual, expected):
    """Every leaf within RTOL of the largest entry of its expected value (a
    tolerance relative to each entry would fail on entries near zero)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype == DTYPE
        np.testing.assert_allclose(a, e, rtol=0, atol=RTOL * float(np.max(np.abs(e))))


def checksum(tree):
    return hashlib.sha256(b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree))).hexdigest()


def test_data_parallel_equals_one_process(runs, comm):
    params, curve, _ = runs["comm"]
    alone_params, alone_curve, _ = runs["self"]
    assert curve.shape == alone_curve.shape == (STEPS,)
    assert curve.dtype == DTYPE
    np.testing.assert_allclose(curve, alone_curve, rtol=RTOL)
    assert_close(params, alone_params)
    # Every rank applies the same averaged gradients: the same parameters, bit for bit.
    assert len(set(comm.allgather(checksum(params)))) == 1


@pytest.fixture(scope="module")
def whole_batch_gradient():
    """Without mpijax: the mean loss over the whole first batch and its gradient."""
    (x, y), params = setup()
    rows = dp.batch_rows(SAMPLES, BATCH, epoch=0, seed=1)[0]
    return jax.jit(jax.value_and_grad(dp.loss))(params, x[rows], y[rows])


@pytest.mark.parametrize("where", ["self", "comm"])
def test_gradient_is_whole_batch_gradient(runs, whole_batch_gradient, where):
    _, _, seen = runs[where]
    assert len(seen) == STEPS
    loss, grads = seen[0]
    expected_loss, expected_grads = whole_batch_gradient
    # Not bit for bit even alone: XLA may sum in another order inside the training loop.
    np.testing.assert_allclose(loss, expected_loss, rtol=RTOL)
    assert_close(grads, expected_grads)
