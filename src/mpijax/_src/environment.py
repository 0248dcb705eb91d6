"""mpijax's switches in the environment, read as mpi4jax reads its own."""

import os

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def flag(*names, default=False):
    """Whether any of these environment variables is on: 1, true, on or yes
    (in any case), or off: 0, false, off or no; unset or empty, `default`.
    Another value is refused, naming the variable, rather than taken for on."""
    on = False
    for name in names:
        value = os.environ.get(name, "").strip().lower()
        if value and value not in _ON + _OFF:
            raise ValueError(
                f"{name}={os.environ[name]!r}: expected one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off)"
            )
        on = on or (value in _ON if value else default)
    return on
