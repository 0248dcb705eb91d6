"""The JAX releases mpijax was tested with. mpijax relies on JAX's private
API (jax_compat.py), which may change in any release: an untested JAX gets a
warning at import. pyproject.toml's dependency on jax is this same range
(tests/test_api.py keeps the two equal)."""

import re
import warnings

import jax

from . import environment

# Oldest and newest tested, the whole suite on the CPU: 0.8.0 (and 0.10.2) in CI, 0.8.0 to
# 0.12.0.1 in docs/jax_versions.log; 0.11.2 also in the GPU check on an H100
# (docs/benchmarks/gpu/h100-2026-11-23/gpu-check.log) and an H200
# (docs/benchmarks/gpu/gpu-check.log).
TESTED = ("0.8.0", "0.12.0.1")


def _release(version):
    """(0, 11, 2) for "0.11.2" and for "0.11.2.dev20260101"; () for a version
    that does not start with a number, which counts as untested."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in numbers.group().split(".")) if numbers else ()


def warn_if_untested(version=None):
    """Warn, unless MPIJAX_UNTESTED_JAX is set, when `version` (default: the
    imported JAX's) is outside the tested range."""
    version = version or jax.__version__
    low, high = TESTED
    silenced = environment.flag("MPIJAX_UNTESTED_JAX")  # checked also where it is not needed
    if silenced or _release(low) <= _release(version) <= _release(high):
        return
    warnings.warn(
        f"mpijax was tested with JAX {low} to {high}, not with JAX {version}: it uses JAX's private API, "
        "which may have changed, so calls may fail or give wrong results. Install a tested JAX "
        f"(pip install 'jax>={low},<={high}'), or set MPIJAX_UNTESTED_JAX=1 to silence this warning.",
        stacklevel=2,
    )
