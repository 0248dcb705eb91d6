"""Which dtypes MPI can carry, and which reductions are defined on them."""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from .runtime import core

SUPPORTED = tuple(
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        jnp.float16, jnp.bfloat16, np.float32, np.float64,
        np.complex64, np.complex128,
    )
)  # fmt: skip

# Reduction codes shared with C++, by the name of the mpi4py constant.
REDUCTIONS = core.reductions()

_ARITHMETIC = ("SUM", "PROD")
_ORDER = ("MIN", "MAX")
_LOGICAL = ("LAND", "LOR", "LXOR")
_BITWISE = ("BAND", "BOR", "BXOR")


def _defined_reductions(dtype):
    """The MPI standard's op x type table (16-bit floats as floats)."""
    if dtype == np.bool_:
        return _LOGICAL
    if jnp.issubdtype(dtype, jnp.integer):
        return _ARITHMETIC + _ORDER + _LOGICAL + _BITWISE
    if jnp.issubdtype(dtype, jnp.floating):
        return _ARITHMETIC + _ORDER
    return _ARITHMETIC  # complex


# Codes of user-defined ops (MPI.Op.Create) -> how messages name them.
_USER_OPS: dict[int, str] = {}


def reduction_label(code):
    """What messages call the op of `code`: MPI.SUM, or a user-defined op as
    the debug log and check mode name it (user-defined #<id>), with the object."""
    if code in _USER_OPS:
        return _USER_OPS[code]
    return "MPI." + next(name for name, c in REDUCTIONS.items() if c == code)


def check_dtype(dtype, op, arg="x"):
    if np.dtype(dtype) not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise TypeError(
            f"mpijax.{op}: {arg} has dtype {np.dtype(dtype).name}, which is not supported; supported dtypes: {names}"
        )


def reduction_code(reduction, dtype, op):
    """The C++ code of `reduction` (an mpi4py MPI.Op) for arrays of `dtype`:
    a predefined op where MPI defines it for the dtype, or a user-defined op."""
    choices = ", ".join(f"MPI.{n}" for n in REDUCTIONS) + " or a user-defined MPI.Op (MPI.Op.Create)"
    if not isinstance(reduction, MPI.Op):
        got = f"{type(reduction).__name__} {reduction!r}"
        raise TypeError(f"mpijax.{op}: op must be an MPI.Op, one of {choices}; got {got}")
    if not reduction.is_predefined:
        # Made by MPI.Op.Create: MPI applies it to any type. The compiled
        # program carries its registry id, never the handle.
        code = core.register_op(reduction)
        _USER_OPS[code] = f"user-defined #{code - len(REDUCTIONS)} ({reduction!r}, made by MPI.Op.Create)"
        return code
    name = next((n for n in REDUCTIONS if reduction == getattr(MPI, n)), None)
    if name is None:
        raise ValueError(f"mpijax.{op}: op must be one of {choices}; got {reduction!r}, which is not a reduction")
    defined = _defined_reductions(np.dtype(dtype))
    if name not in defined:
        raise TypeError(
            f"mpijax.{op}: op=MPI.{name} is not defined for dtype {np.dtype(dtype).name}; "
            f"defined for it: {', '.join('MPI.' + n for n in defined)}"
        )
    return REDUCTIONS[name]


def array(x, op, arg="x"):
    """`x` as a JAX array of a supported dtype."""
    if not isinstance(x, jax.Array):  # asarray of an array is an eager call of its own
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError):
            got = type(x).__name__ + (f" of dtype {x.dtype}" if hasattr(x, "dtype") else "")
            raise TypeError(f"mpijax.{op}: {arg} must be an array or a number, got {got}") from None
    check_dtype(x.dtype, op, arg)
    return x
