"""Every use of JAX's private API, in one place (JAX 0.10 and newer)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import Effect, Primitive  # noqa: F401  (re-exported)

# The lowering compares token avals by identity: this must be JAX's singleton.
abstract_token = getattr(jax.ffi, "abstract_token", None) or _core.abstract_token

# Eager evaluation of a primitive: compile it alone and run it, with the
# runtime tokens of ordered effects threaded between calls.
apply_primitive = _dispatch.apply_primitive


# Whether JAX has started its backends (after which devices are fixed).
backends_initialized = _xla_bridge.backends_are_initialized


def register_ordered_effect(effect_type):
    """Let `effect_type` be ordered, lowered with a token, and used under
    control flow, custom derivatives and remat; and keep its equations when
    partial evaluation stages them out (a linearized send has no outputs that
    anything depends on)."""
    for effect_set in (
        _effects.ordered_effects,
        _effects.lowerable_effects,
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.partial_eval_kept_effects,
    ):
        effect_set.add_type(effect_type)


def reuse_runtime_tokens_in_place():
    """Before each execution of a jitted function with an ordered effect, JAX
    reshards the effect's runtime token onto the executable's devices
    (`RuntimeTokenSet.get_token_input` -> `device_put`), even when it already
    lives on the one device the executable runs on, which is the only case
    ordered effects allow. That costs about half of the dispatch time of a
    small jitted function with MPI calls; the token is passed on as it is
    there, and every other case takes JAX's own path."""
    token_set = _dispatch.RuntimeTokenSet
    reshard = token_set.get_token_input

    def get_token_input(self, effect, devices):
        token = self.current_tokens.get(effect)
        if isinstance(token, _core.Token) and len(devices) == 1 and token._buf.sharding.device_set == {devices[0]}:
            return token
        return reshard(self, effect, devices)

    token_set.get_token_input = get_token_input


def align_with_transformation(args):
    """Under differentiation, give every floating-point operand a tangent.

    JAX applies a primitive's JVP rule only where some operand has a tangent,
    which can differ between ranks (a receive buffer is often a constant),
    while the tangent's MPI call must be made on every rank. So every
    floating-point operand gets a tangent, zero where it had none. In reverse
    mode that zero must count as linear for the transposed call to run too: a
    frozen new ref does (jax.new_ref / jax.freeze).
    """
    trace = _core.trace_ctx.trace
    if isinstance(trace, _ad.JVPTrace):
        return [_with_tangent(trace, x, _ad.JVPTracer, trace.parent_trace, _zeros) for x in args]
    if isinstance(trace, _ad.LinearizeTrace):
        return [_with_tangent(trace, x, _ad.LinearizeTracer, trace.tangent_trace, _linear_zeros) for x in args]
    return args


def batched_if_vmapped(x):
    """`x` batched along the innermost vmap, if there is one."""
    trace = _core.trace_ctx.trace
    return _batched(trace, x) if isinstance(trace, _batching.BatchTrace) else x


def transposed_receive_buffer(aval):
    """Zeros to receive a cotangent into, inside a transpose rule: batched
    along the innermost vmap (jacrev), where the peer sends a batched
    cotangent; and, under partial evaluation (linear_transpose of a
    transpose), unknown and linear, so that the receive is staged and
    transposed again like the peer's send, not run on these constants."""
    x = batched_if_vmapped(_zeros(aval))
    trace = _core.trace_ctx.trace
    if isinstance(trace, _pe.JaxprTrace):
        return jax.freeze(jax.new_ref(trace.new_instantiated_const(x)))
    return x


def _batched(trace, x):
    if isinstance(x, _batching.BatchTracer) and x._trace.tag is trace.tag:
        return x
    with _core.set_current_trace(trace.parent_trace):
        value = lax.broadcast(x, (trace.axis_data.size,))
    return _batching.BatchTracer(trace, value, 0)


def _with_tangent(trace, x, tracer_type, tangent_trace, zeros):
    if isinstance(x, tracer_type) and x._trace.tag is trace.tag:
        return x
    aval = _core.typeof(x)
    if not jnp.issubdtype(aval.dtype, jnp.inexact):
        return x  # integer and bool values have no tangents on any rank
    with _core.set_current_trace(tangent_trace):
        tangent = zeros(aval)
    return tracer_type(trace, x, tangent)


def _zeros(aval):
    return lax.full(aval.shape, 0, aval.dtype)


def _linear_zeros(aval):
    return jax.freeze(jax.new_ref(_zeros(aval)))
