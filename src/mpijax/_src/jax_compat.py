"""Every use of JAX's private API, in one place (JAX 0.10 and newer)."""

import jax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax.extend.core import Effect, Primitive  # noqa: F401  (re-exported)

# The lowering compares token avals by identity: this must be JAX's singleton.
abstract_token = getattr(jax.ffi, "abstract_token", None) or _core.abstract_token

# Eager evaluation of a primitive: compile it alone and run it, with the
# runtime tokens of ordered effects threaded between calls.
apply_primitive = _dispatch.apply_primitive


def register_ordered_effect(effect_type):
    """Let `effect_type` be ordered, lowered with a token, and used under
    control flow, custom derivatives and remat."""
    for effect_set in (
        _effects.ordered_effects,
        _effects.lowerable_effects,
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
    ):
        effect_set.add_type(effect_type)
