"""mpi4jax 0.7's name for its token-free operations (mpi4jax.notoken)."""

from .experimental.notoken import *  # noqa: F403
from .experimental.notoken import __all__  # noqa: F401
