"""mpi4jax's experimental namespace."""

import functools

from ..tokens import _after
from . import notoken  # noqa: F401  (mpi4jax 0.5-0.6: mpi4jax.experimental.notoken)


def auto_tokenize(f, token=None):
    """mpi4jax's decorator that threaded tokens through ``f``. mpijax orders
    MPI calls by itself, so this runs ``f`` as it is (after `token`, if given):
    code written for it, with or without tokens, keeps working."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _after(token, "experimental.auto_tokenize")
        return f(*args, **kwargs)

    return wrapper


__all__ = ["auto_tokenize"]
