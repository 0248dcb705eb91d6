"""Every use of JAX's private API, in one place (JAX 0.10 and newer)."""

import contextvars
import sys

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


def is_eager():
    """Whether a primitive bound now runs at once (no transformation traces it)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


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


def align_with_transformation(args, vmap=True):
    """Make a transformation apply to an MPI call on every rank alike.

    JAX applies a primitive's JVP rule only where some operand has a tangent,
    and its batching rule only where some operand is batched, which can differ
    between ranks (a receive buffer is often a constant), while the call must
    be the same on every rank. So under differentiation every floating-point
    operand gets a tangent, zero where it had none (in reverse mode that zero
    must count as linear for the transposed call to run too: a frozen new ref
    does), and under vmap (unless `vmap` is False) every operand is batched.
    """
    trace = _core.trace_ctx.trace
    if isinstance(trace, _ad.JVPTrace):
        return [_with_tangent(trace, x, _ad.JVPTracer, trace.parent_trace, _zeros) for x in args]
    if isinstance(trace, _ad.LinearizeTrace):
        return [_with_tangent(trace, x, _ad.LinearizeTracer, trace.tangent_trace, _linear_zeros) for x in args]
    if vmap and isinstance(trace, _batching.BatchTrace):
        return [_batched(trace, x) for x in args]
    return args


# The partial evaluation under way in which MPI calls are never evaluated
# early: its parent trace, and whether it is linear_transpose's.
_staging_under = contextvars.ContextVar("mpijax_staging_under", default=(None, False))


def _stages_every_mpi_call(trace_to_jaxpr):
    """`pe.trace_to_jaxpr_nounits` runs a function on partially known values
    and evaluates at once whatever depends on known values only. JAX uses it
    in linear_transpose, where a call whose operands are constants on one
    rank would run at trace time there but be transposed on the others, and
    to hoist loop-invariant work out of a scan under differentiation, which
    would take a receive into a constant buffer out of its loop (and the
    sender's loop would wait forever). Under it, MPI calls are staged."""

    def wrapper(*args, **kwargs):
        linear = sys._getframe(1).f_code.co_name == "linear_transpose"
        token = _staging_under.set((_core.trace_ctx.trace, linear))
        try:
            return trace_to_jaxpr(*args, **kwargs)
        finally:
            _staging_under.reset(token)

    return wrapper


_pe.trace_to_jaxpr_nounits = _stages_every_mpi_call(_pe.trace_to_jaxpr_nounits)


def stage_mpi_calls(primitive, check_transposable=None):
    """Partial evaluation of `primitive`: JAX's default, except under
    pe.trace_to_jaxpr_nounits, where the call is always staged, with its
    floating-point constants as linear values (a frozen new ref), so that
    linear_transpose transposes it on every rank. There
    `check_transposable(**params)` may raise first, on every rank alike,
    before any MPI call has run."""

    def rule(trace, *tracers, **params):
        parent, linear = _staging_under.get()
        if parent is trace.parent_trace:
            if linear and check_transposable:
                check_transposable(**params)
            if all(t.pval.is_known() for t in tracers):
                with _core.set_current_trace(trace):
                    tracers = [_staged(trace, t) for t in tracers]
        return trace.default_process_primitive(primitive, tracers, params)

    _pe.custom_partial_eval_rules[primitive] = rule


def _staged(trace, tracer):
    staged = trace.instantiate_const(tracer)
    if jnp.issubdtype(staged.aval.dtype, jnp.inexact):
        return jax.freeze(jax.new_ref(staged))
    return staged


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
