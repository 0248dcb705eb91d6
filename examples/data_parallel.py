"""Data-parallel training of a small neural network.

Every rank holds the same model and the same data set. Each step, every rank
computes the gradient on its own slice of the global batch; one allreduce
averages the gradients, and every rank takes the same optimiser step, so the
parameters stay identical on all ranks without ever being sent. A whole
epoch is one jitted `lax.scan`, with the allreduce inside the compiled loop.

    mpirun -n 2 python examples/data_parallel.py
    mpirun -n 2 python examples/data_parallel.py --check   # compare with one process on the whole batch

All communication is in `average`, a function from a pytree to its mean over
the ranks, which the training loop takes as an argument: the same model,
data and loop can run with another way to communicate.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpijax


def dataset(n, seed=0, dtype=jnp.float32):
    """n noisy samples of a smooth function of two variables, drawn with
    NumPy from a fixed seed, so every rank generates the same data."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, (n, 2))
    y = np.sin(3 * x[:, :1]) * np.cos(2 * x[:, 1:]) + 0.05 * rng.normal(size=(n, 1))
    return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


def init_params(key, sizes, dtype=jnp.float32):
    """Weights and biases of a fully connected network, layer sizes `sizes`
    (inputs first). Weights scaled by 1/sqrt(fan-in) keep tanh out of saturation."""
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(k, (fan_in, fan_out), dtype) / np.sqrt(fan_in).astype(dtype)
        params.append((w, jnp.zeros(fan_out, dtype)))
    return params


def predict(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss(params, x, y):
    """Mean squared error over the rows of x: the local loss of a rank."""
    return jnp.mean((predict(params, x) - y) ** 2)


def batch_rows(n, batch, epoch, seed=0):
    """Row indices of every batch of `epoch`, shape (n // batch, batch): a
    permutation of the data set that depends only on (seed, epoch), so all
    ranks agree on it. Rows that do not fill a last batch are skipped."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    steps = n // batch
    return order[: steps * batch].reshape(steps, batch).astype(np.int32)


def adam_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return zeros, zeros, jnp.zeros((), jnp.int32)


def adam_update(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)

    def step(p, m, v):
        # Bias correction in the parameters' dtype, so float32 stays float32 under x64.
        m_hat = m / (1 - b1 ** t.astype(p.dtype))
        v_hat = v / (1 - b2 ** t.astype(p.dtype))
        return p - lr * m_hat / (jnp.sqrt(v_hat) + eps)

    return jax.tree.map(step, params, m, v), (m, v, t)


def mpi_average(comm):
    """The mean over the ranks of `comm` of every leaf of a pytree, by one
    MPI_Allreduce per dtype: one per step here, as the loss and the gradients
    share the parameters' dtype."""
    size = comm.Get_size()
    return lambda tree: jax.tree.map(lambda s: s / size, mpijax.tree_allreduce(tree, MPI.SUM, comm=comm))


def make_epoch(average, lr):
    """A jitted function that runs one epoch: `rows` (steps, local batch)
    selects this rank's rows of each batch. Returns the new state and the
    loss over the global batch at every step."""

    @jax.jit
    def epoch(state, data, rows):
        x, y = data

        def step(state, rows):
            params, opt = state
            local_loss, local_grads = jax.value_and_grad(loss)(params, x[rows], y[rows])
            # The slices are of equal size, so the mean over the ranks of their
            # mean losses (and gradients) is that of the global batch.
            global_loss, grads = average((local_loss, local_grads))
            params, opt = adam_update(params, grads, opt, lr)
            return (params, opt), global_loss

        return jax.lax.scan(step, state, rows)

    return epoch


def train(params, data, epochs, batch, average, rank, size, lr=3e-3, seed=0, report=None):
    """Trains `params` on `data` for `epochs` epochs of global batches of
    `batch` rows; this rank takes the `rank`-th of `size` contiguous slices of
    each batch. `report(epoch, losses)`, if given, is called after each epoch.
    Returns the final parameters and the loss of every step."""
    if batch % size:
        raise ValueError(f"batch {batch} is not divisible by the number of ranks {size}")
    local = batch // size
    run_epoch = make_epoch(average, lr)
    state = (params, adam_init(params))
    curve = []
    for e in range(epochs):
        rows = batch_rows(len(data[0]), batch, e, seed)[:, rank * local : (rank + 1) * local]
        state, losses = run_epoch(state, data, rows)
        curve.append(losses.block_until_ready())  # so that report times the epoch, not its dispatch
        if report is not None:
            report(e, losses)
    return state[0], jnp.concatenate(curve)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch", type=int, default=240, help="global batch size, divisible by the number of ranks")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--samples", type=int, default=4800, help="size of the data set")
    parser.add_argument("--check", action="store_true", help="also train in one process on the whole batch and compare")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    data = dataset(args.samples)
    params = init_params(jax.random.key(0), [2, 64, 64, 1])
    steps_per_epoch = args.samples // args.batch

    times = []  # at the end of each epoch; the first epoch includes compilation

    def report(epoch, losses):
        times.append(time.perf_counter())
        if rank == 0 and (epoch % 20 == 0 or epoch == args.epochs - 1):
            step = (epoch + 1) * steps_per_epoch
            print(f"epoch {epoch:3d}  step {step:5d}  loss {float(losses[-1]):.6f}", flush=True)

    common = dict(epochs=args.epochs, batch=args.batch, lr=args.lr)
    _, curve = train(params, data, average=mpi_average(comm), rank=rank, size=size, report=report, **common)
    if rank == 0:
        if args.epochs > 1:
            rate = (args.epochs - 1) * steps_per_epoch / (times[-1] - times[0])
            print(f"{size} rank(s), global batch {args.batch}: {rate:.0f} steps/s after compilation")
        print(f"final loss {float(curve[-1]):.6f}")

    if args.check:
        # The same training in this process alone, on the whole of every batch.
        _, alone = train(params, data, average=mpi_average(MPI.COMM_SELF), rank=0, size=1, **common)
        if rank == 0:
            diff = jnp.abs(curve - alone)
            print(
                f"one process on the whole batch: loss curves differ by at most {float(diff.max()):.3g} "
                f"({float((diff / alone).max()):.3g} relative; {curve.dtype}, {len(curve)} steps)"
            )


if __name__ == "__main__":
    main()
