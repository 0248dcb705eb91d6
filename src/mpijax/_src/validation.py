"""Trace-time checks of the arguments every rank knows, so that a bad call
raises everywhere instead of leaving the other ranks waiting."""

import operator

import jax
import numpy as np
from mpi4py import MPI

from .runtime import core


def static_int(value, name, op):
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"mpijax.{op}: {name} must be a static Python int known at trace time, "
            f"got a traced value {value}; compute it outside jax.jit or mark it static"
        )
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"mpijax.{op}: {name} must be an int, got bool {value}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"mpijax.{op}: {name} must be an int, got {type(value).__name__} {value!r}") from None


def static_bool(value, name, op):
    """A switch: a bool (or 0/1), never a string, whose truth would be
    that of any non-empty word ("no" too)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"mpijax.{op}: {name} must be True or False, got {type(value).__name__} {value!r}")


def rank(value, name, comm, op, *, allow=()):
    """A rank argument: 0 <= value < comm size, or one of the constants in `allow`."""
    value = static_int(value, name, op)
    if value in allow or 0 <= value < comm.size:
        return value
    extra = "".join(f" or MPI.{_CONSTANTS[a]}" for a in allow)
    wildcard = value == MPI.ANY_SOURCE and name.startswith("source")
    what = (
        "MPI.ANY_SOURCE is not accepted"
        if wildcard
        else f"{value} is out of range for a communicator of size {comm.size}"
    )
    raise ValueError(f"mpijax.{op}: {name}={what} (expected 0 <= {name} < {comm.size}{extra})")


def tag(value, name, op, *, allow_any=False):
    value = static_int(value, name, op)
    largest = core.largest_tag()
    if (allow_any and value == MPI.ANY_TAG) or 0 <= value <= largest:
        return value
    extra = " or MPI.ANY_TAG" if allow_any else ""
    what = "MPI.ANY_TAG is not accepted" if value == MPI.ANY_TAG else f"{value} is out of range"
    raise ValueError(
        f"mpijax.{op}: {name}={what} (expected 0 <= {name} <= {largest}{extra}; "
        "mpijax keeps the tags above it for the messages of derivatives and of check mode)"
    )


def counts(values, name, comm, op):
    """Rows per rank of a v-variant: a static sequence of comm-size
    non-negative ints, the same on every rank (check mode verifies that); not
    a dict or set, whose keys would pass for counts."""
    if isinstance(values, (jax.core.Tracer, str, dict, set)) or not hasattr(values, "__len__"):
        raise TypeError(
            f"mpijax.{op}: {name} must be a sequence of {comm.size} static Python ints (one per rank), "
            f"got {type(values).__name__} {values!r}"
        )
    values = tuple(static_int(v, f"{name}[{i}]", op) for i, v in enumerate(values))
    if len(values) != comm.size:
        raise ValueError(
            f"mpijax.{op}: {name} has {len(values)} entries; expected one per rank of the communicator ({comm.size})"
        )
    if any(v < 0 for v in values):
        raise ValueError(f"mpijax.{op}: {name} must be non-negative, got {list(values)}")
    return values


def leading(x, rows, op, what):
    """x must have `rows` rows along its leading axis (`what` says why)."""
    if x.ndim == 0 or x.shape[0] != rows:
        raise ValueError(f"mpijax.{op}: x must have shape ({rows}, ...) {what}; got shape {x.shape}")


_CONSTANTS = {MPI.ANY_SOURCE: "ANY_SOURCE", MPI.PROC_NULL: "PROC_NULL"}


class _NotSet:
    def __repr__(self):
        return "NOTSET"


NOTSET = _NotSet()


def no_token(token, op):
    """The token-free API takes token= only to say where it went (as mpi4jax does)."""
    if token is not NOTSET:
        raise RuntimeError(
            f"mpijax.{op} takes no token: mpijax runs MPI calls in program order by itself. "
            f"Remove token=...; code written for mpi4jax's token API (before 0.8) runs on "
            f"mpijax.tokens.{op}, which takes and returns tokens."
        )
