"""mpijax's switches in the environment, read as mpi4jax reads its own."""

import os

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def flag(*names, default=False):
    """Whether a switch is on: the first of its names that is set decides
    (mpijax's own name before mpi4jax's), 1, true, on or yes (in any case)
    for on and 0, false, off or no for off; none set (or empty), `default`.
    Every set value is checked: another one is refused, naming the variable,
    rather than taken for on."""
    values = [(name, os.environ.get(name, "").strip().lower()) for name in names]
    for name, value in values:
        if value and value not in _ON + _OFF:
            raise ValueError(
                f"{name}={os.environ[name]!r}: expected one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off)"
            )
    name = deciding(*names)
    return default if name is None else dict(values)[name] in _ON


def deciding(*names):
    """The first of a switch's names that is set (not empty): the one that
    decides; None if none is."""
    return next((name for name in names if os.environ.get(name, "").strip()), None)
