"""Every use of JAX's private API, in one place (JAX 0.8 and newer)."""

import contextlib
import contextvars
import functools
import gc
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import util as _util
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla
from jax._src.lax.control_flow import solves as _solves
from jax.extend.core import ClosedJaxpr, Primitive  # noqa: F401  (re-exported)
from jax.extend.mlir.dialects import stablehlo as _hlo

# Public from JAX 0.10 on; the same class before.
Effect = getattr(jax.extend.core, "Effect", None) or _effects.Effect

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


def batched_while_loops_keep_finished_elements(effect_type):
    """Under vmap, a while_loop whose condition differs between batch
    elements runs until the last element is done, and an element that is
    done must keep its carry. JAX lowers a condition with an ordered effect
    (an MPI call: `while allreduce(err) > tol`) once per iteration, inside
    the body, to make its calls once, but then runs the body on every
    element to the end (JAX 0.8 to 0.10): a finished element went on, with
    no error. Such loops are lowered here with the batched predicate in the
    carry: each iteration keeps the carry of the elements already done, and
    the condition still runs once per iteration. Every other loop takes
    JAX's own lowering."""
    from jax._src.lax.control_flow.loops import while_p

    jax_rule = getattr(_mlir._lowerings.get(while_p), "rule", None)
    if jax_rule is None:  # a JAX whose table of lowerings differs keeps its own
        return

    def rule(ctx, *args, **params):
        cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
        if not (cond_jaxpr.out_avals[0].shape and any(isinstance(e, effect_type) for e in cond_jaxpr.effects)):
            return jax_rule(ctx, *args, **params)
        cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]

        def loop(*args):
            cond_consts, body_consts, carry = _util.split_list(args, [cond_nconsts, body_nconsts])

            def going(carry, before=True):  # per element; once done, done
                return before & _core.eval_jaxpr(cond_jaxpr.jaxpr, cond_jaxpr.consts, *cond_consts, *carry)[0]

            def step(state):
                pred, carry = state
                new = _core.eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, *body_consts, *carry)
                dims = tuple(range(pred.ndim))
                kept = [
                    lax.select(lax.broadcast_in_dim(pred, jnp.shape(x), dims), n, x)
                    for n, x in zip(new, carry, strict=True)
                ]
                return going(kept, pred), kept

            return lax.while_loop(lambda state: jnp.any(state[0]), step, (going(carry), list(carry)))[1]

        return _mlir.lower_fun(loop)(ctx, *args)

    _mlir.register_lowering(while_p, rule)


def batched_conds_run_element_by_element(effect_type):
    """Under vmap, a cond on a batched predicate whose branches make MPI
    calls runs each batch element's own branch, one element after the other.
    JAX runs every branch on the whole batch and selects each element's
    result: each branch's messages then pair with the peer's same branch, so
    an element whose predicate differs from its peer's element received the
    messages of a branch the peer did not take, with no error. Every other
    cond takes JAX's own rule (one branch on the whole batch)."""
    from jax._src.lax.control_flow.conditionals import cond_p

    jax_rule = _batching.fancy_primitive_batchers[cond_p]

    def rule(axis_data, args, dims, *, branches, **params):
        if dims[0] is None or not any(isinstance(e, effect_type) for b in branches for e in b.effects):
            return jax_rule(axis_data, args, dims, branches=branches, **params)
        batched = [i for i, d in enumerate(dims) if d is not None]

        def element(xs):
            operands = list(args)
            for i, x in zip(batched, xs, strict=True):
                operands[i] = x
            return cond_p.bind(*operands, branches=branches, **params)

        outs = lax.map(element, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
        return outs, [0] * len(outs)

    _batching.fancy_primitive_batchers[cond_p] = rule


def aot_calls_thread_runtime_tokens():
    """An ahead-of-time compiled program (`jax.jit(f).lower(x).compile()`)
    is called through JAX's C++ fast path whenever it has no unordered
    effect, even when it has an ordered one, whose runtime token that path
    does not pass: the second call fails ("Execution supplied 1 arguments but
    compiled program expected 2"). Programs with an ordered effect take the
    Python path, which passes the token, as JAX's ordered io_callback already
    does (a host callback keeps it off the C++ path): here, MPI programs that
    mpijax could not seal (see _Seal)."""
    executable = _pxla.MeshExecutable
    create_cpp_call = executable.create_cpp_call

    def create_cpp_call_without_tokens(self, params):
        if getattr(self.unsafe_call, "ordered_effects", None):
            return None
        return create_cpp_call(self, params)

    executable.create_cpp_call = create_cpp_call_without_tokens


class _Seal:
    """Executables whose ordered effect is sealed in: at the top level of a
    program on one device, the effect's token is created inside the module
    and dropped at its end, so the executable has no effect, keeps JAX's C++
    dispatch path and can be compiled ahead of time. Inside the module the
    token still orders every call (JAX threads it through nested jit, loops,
    cond, custom derivatives and remat, all traced as before). Across
    executions, order comes from the runtime: the PJRT CPU client runs one
    device's executions one after the other in dispatch order (each waits
    for the device's last enqueued execution, xla/pjrt/cpu/cpu_client.cc),
    and a GPU runs them in stream order.

    Only one device's programs are sealed: the first single-device program
    with the effect fixes it, on a platform with one local device. Any other
    program with the effect (another device, another platform) keeps JAX's
    runtime token and runs alone: it waits until the sealed device has
    finished what was queued, and its dispatch waits until it has run."""

    device = None  # the device whose programs are sealed, once there is one

    def __init__(self, effect):
        self.effect = effect
        self._drain = jax.jit(lambda x: x + 1)

    def may_seal(self, backend, num_devices, platforms):
        if num_devices != 1 or len(platforms) != 1 or backend is None:
            return False
        devices = backend.local_devices()
        if len(devices) != 1 or self.device not in (None, devices[0]):
            return False
        self.device = devices[0]
        return True

    def drain(self):
        """Wait until the sealed device has run every execution queued on it:
        one more execution there finishes after all of them."""
        if self.device is not None and backends_initialized():
            self._drain(jax.device_put(np.int8(0), self.device)).block_until_ready()


_sealed_p = Primitive("mpijax_sealed")
_sealed_p.multiple_results = True


# From JAX 0.11 on, XLA inlines a call whose only operand is the created token
# (a program without inputs) with a control edge from it on every inlined
# instruction, constants included, and its CSE pass then aborts the process
# ("cannot remove instruction"). Inlined while lowering, the sealed program is
# no call at all.
_inline_late = (
    {"inline_jax_late": True} if "inline_jax_late" in inspect.signature(_mlir.call_lowering).parameters else {}
)


def _lower_sealed(ctx, *args, jaxpr, effect):
    outer = ctx.tokens_in  # the program's other ordered effects
    inner = _mlir.TokenSet({**dict(outer.items()), effect: _hlo.create_token()})
    results, tokens = _mlir.call_lowering(
        "mpijax_sealed",
        jaxpr,
        None,
        ctx.module_context,
        ctx.avals_in,
        ctx.avals_out,
        inner,
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        **_inline_late,
    )
    ctx.set_tokens_out(outer.update_tokens(_mlir.TokenSet({e: tokens.get(e) for e, _ in outer.items()})))
    return results


_mlir.register_lowering(_sealed_p, _lower_sealed, cacheable=False)


def _sealed(closed, effect):
    """`closed` as one call of _sealed_p, whose effects lack `effect`."""
    invars = [_core.Var(v.aval) for v in closed.jaxpr.invars]
    outvars = [_core.Var(aval) for aval in closed.out_avals]
    effects = frozenset(closed.effects - {effect})
    eqn = _core.new_jaxpr_eqn(invars, outvars, _sealed_p, {"jaxpr": closed, "effect": effect}, effects)
    jaxpr = _core.Jaxpr((), invars, outvars, [eqn], effects, closed.jaxpr.debug_info)
    return ClosedJaxpr(jaxpr, ())


# Functions called as check(closed_jaxpr, num_devices) with every program JAX
# lowers at the top level (where seal_at_top_level hooks in), before it is
# lowered: they raise to refuse it.
program_checks = []


def jaxprs(closed_jaxpr):
    """The program's jaxpr and every jaxpr nested in it (nested jit, loops,
    cond, ...)."""
    pending = [closed_jaxpr.jaxpr]
    while pending:
        jaxpr = pending.pop()
        yield jaxpr
        pending.extend(sub for eqn in jaxpr.eqns for sub in _core.jaxprs_in_params(eqn.params))


def unused_results(closed_jaxpr, primitives, passive=lambda eqn: 0):
    """The equations of any of `primitives`, anywhere in the program, none of
    whose results is used where they are made; the first passive(eqn)
    operands of an equation are not uses."""
    found = []
    for jaxpr in jaxprs(closed_jaxpr):
        used = {v for e in jaxpr.eqns for v in e.invars[passive(e) :] if isinstance(v, _core.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, _core.Var)}
        found += [e for e in jaxpr.eqns if e.primitive in primitives and not any(v in used for v in e.outvars)]
    return found


def seal_at_top_level(effect):
    """Seal `effect` into the programs that JAX lowers from now on where it
    can (see _Seal), and make the programs it cannot seal wait for the
    sealed ones. Returns the _Seal, or None where this JAX lacks the hook
    (then every program keeps JAX's runtime token, as without this)."""
    lower = getattr(_pxla, "_cached_lowering_to_hlo", None)
    # It is cached (weakref_lru_cache): its parameters are those of the
    # function that the cache holds.
    functions = [
        f for f in gc.get_referents(lower) if inspect.isfunction(f) and f.__name__ == "_cached_lowering_to_hlo"
    ]
    signature = inspect.signature(functions[0]) if functions else None
    if signature is None or not {"closed_jaxpr", "backend", "num_devices", "platforms"} <= signature.parameters.keys():
        return None
    seal = _Seal(effect)

    @_util.weakref_lru_cache
    def lowering(closed_jaxpr, *args, **kwargs):
        given = signature.bind(closed_jaxpr, *args, **kwargs).arguments
        for check in program_checks:
            check(closed_jaxpr, given["num_devices"])
        if effect in closed_jaxpr.effects and seal.may_seal(given["backend"], given["num_devices"], given["platforms"]):
            closed_jaxpr = _sealed(closed_jaxpr, effect)
        return lower(closed_jaxpr, *args, **kwargs)

    _pxla._cached_lowering_to_hlo = lowering

    token_set = _dispatch.RuntimeTokenSet
    get_input, set_result, block = token_set.get_token_input, token_set.set_token_result, token_set.block_until_ready

    def get_token_input(self, eff, devices):
        if eff == effect:
            seal.drain()
        return get_input(self, eff, devices)

    def set_token_result(self, eff, token):
        set_result(self, eff, token)
        if eff == effect and seal.device is not None:
            token.block_until_ready()

    def block_until_ready(self):
        seal.drain()
        block(self)

    token_set.get_token_input = get_token_input
    token_set.set_token_result = set_token_result
    token_set.block_until_ready = block_until_ready
    return seal


def align_with_transformation(args, vmap=True, trace=None):
    """Make a transformation apply to an MPI call on every rank alike.

    JAX applies a primitive's JVP rule only where some operand has a tangent,
    and its batching rule only where some operand is batched, which can differ
    between ranks (a receive buffer is often a constant), while the call must
    be the same on every rank. So under differentiation every floating-point
    operand gets a tangent, zero where it had none (in reverse mode that zero
    must count as linear for the transposed call to run too: a frozen new ref
    does), and under vmap (unless `vmap` is False) every operand is batched.
    `trace`: the transformation (default: the current one).
    """
    trace = trace or _core.trace_ctx.trace
    if isinstance(trace, _ad.JVPTrace):
        return [_with_tangent(trace, x, _ad.JVPTracer, trace.parent_trace, _zeros) for x in args]
    if isinstance(trace, _ad.LinearizeTrace):
        return [_with_tangent(trace, x, _ad.LinearizeTracer, trace.tangent_trace, _linear_zeros) for x in args]
    if vmap and isinstance(trace, _batching.BatchTrace):
        if trace.tag is _primal_vmap.get() and not any(_batched_at(trace, x) for x in args):
            return args  # a primal in a custom_jvp rule (custom_derivatives_with_mpi_calls)
        return [_batched(trace, x) for x in args]
    return args


def differentiate_bodies_with_mpi_calls(effect_type):
    """Align the operands of a loop, cond, checkpoint or inner jit whose body
    makes MPI calls (an effect of `effect_type`) with differentiation, as an
    MPI call's own operands are (align_with_transformation). JAX
    differentiates such a primitive only where some operand has a tangent:
    on a rank where none has (a parameter that acts in rank 0's subdomain
    only), it ran the body without the derivative's calls, and the other
    ranks' derivative calls waited for them forever."""

    def calls_mpi(params):
        return any(isinstance(e, effect_type) for j in _core.jaxprs_in_params(params) for e in j.effects)

    for trace_type in (_ad.JVPTrace, _ad.LinearizeTrace):

        def process_primitive(self, primitive, tracers, params, /, _process=trace_type.process_primitive):
            if calls_mpi(params):
                tracers = align_with_transformation(tracers, vmap=False, trace=self)
            return _process(self, primitive, tracers, params)

        trace_type.process_primitive = process_primitive


# The vmap (its tag) directly under a JVP whose custom_jvp rule runs on
# primals that it does not batch: see custom_derivatives_with_mpi_calls.
_primal_vmap = contextvars.ContextVar("mpijax_primal_vmap", default=None)
# The primal inputs of the custom_jvp rule that runs now; and whether the
# custom_jvp call made on them (the rule's primal, `f(x)`) runs now, whose MPI
# calls bind the primal twin (MpiPrimitive.bind_primal).
_rule_primals = contextvars.ContextVar("mpijax_rule_primals", default=())
primal_calls = contextvars.ContextVar("mpijax_primal_calls", default=False)


def custom_derivatives_with_mpi_calls(effect_type):
    """Differentiate custom_jvp and custom_vjp functions that make MPI calls
    on every rank alike, and keep a custom_jvp's primal unbatched where
    jacfwd needs it so.

    JAX skips the rule (the fwd and bwd) where no input has a tangent, and
    runs the function alone: on a rank whose input does not depend on the
    differentiated value the rule's calls were missing, and the other ranks
    waited for them. So where no input has a tangent, the function (and a
    custom_jvp's rule) is traced first; if it makes MPI calls, its inputs get
    zero tangents (align_with_transformation) and the rule runs; if not, the
    traced function runs alone, as JAX would. A function that cannot be
    traced on abstract values (Python control flow on its values, which JAX
    gives it concrete where it runs it alone) is left to JAX.

    Under jacfwd (vmap over a JVP) a custom_jvp rule's primal calls see
    primals that the vmap does not batch, on every rank; aligned with the
    vmap they were batched, and jacfwd refuses a batched primal. So while
    the rule runs directly under such a vmap, every tangent is batched and a
    call whose operands the vmap does not batch stays unbatched, as the
    primal twin of mpijax's own rules (MpiPrimitive.bind_primal) does."""

    def without_tangents(trace, tracers, funs):
        """tracers, aligned if one of funs (WrappedFun, its input avals)
        makes MPI calls; and the first fun, traced, if none does."""
        traced = [_traced(f, avals) for f, avals in funs]
        for f, _ in funs[1:]:
            _forget(f)
        first = funs[0][0]
        if None in traced:
            _forget(first)
        elif any(isinstance(e, effect_type) for jaxpr, _ in traced for e in jaxpr.effects):
            _forget(first)
            tracers = align_with_transformation(tracers, vmap=False, trace=trace)
        else:
            jaxpr, consts = traced[0]
            first = _lu.wrap_init(functools.partial(_core.eval_jaxpr, jaxpr, consts), debug_info=first.debug_info)
        return tracers, first

    for trace_type in (_ad.JVPTrace, _ad.LinearizeTrace):

        def jvp_call(self, primitive, fun, jvp, tracers, /, _process=trace_type.process_custom_jvp_call, **params):
            pairs = [self.to_primal_tangent_pair(t) for t in tracers]
            if all(type(t) is _ad.Zero for _, t in pairs):
                avals = [_core.typeof(p) for p, _ in pairs]
                tangent_avals = [a.to_tangent_aval() for a in avals]
                tracers, fun = without_tangents(self, tracers, [(fun, avals), (jvp, avals + tangent_avals)])
            vmap = self.parent_trace
            with _setting(_rule_primals, tuple(p for p, _ in pairs)):
                if (
                    not isinstance(self, _ad.JVPTrace)
                    or not isinstance(vmap, _batching.BatchTrace)
                    or any(_batched_at(vmap, p) for p, _ in pairs)
                ):
                    return _process(self, primitive, fun, jvp, tracers, **params)
                with _core.set_current_trace(vmap):
                    tracers = [
                        _ad.JVPTracer(self, p, t if type(t) is _ad.Zero else _batched(vmap, t))
                        for p, t in map(self.to_primal_tangent_pair, tracers)
                    ]
                with _setting(_primal_vmap, vmap.tag):
                    return _process(self, primitive, fun, jvp, tracers, **params)

        def vjp_call(self, primitive, fun, fwd, bwd, tracers, /, _process=trace_type.process_custom_vjp_call, **params):
            if all(type(self.to_primal_tangent_pair(t)[1]) is _ad.Zero for t in tracers):
                tracers, fun = without_tangents(self, tracers, [(fun, [_core.typeof(t) for t in tracers])])
            return _process(self, primitive, fun, fwd, bwd, tracers, **params)

        trace_type.process_custom_jvp_call = jvp_call
        trace_type.process_custom_vjp_call = vjp_call

    from jax._src.custom_derivatives import custom_jvp_call_p

    def bind(*args, _bind=custom_jvp_call_p.bind, **params):
        operands = [a for a in args if not isinstance(a, _lu.WrappedFun)]
        primals = _rule_primals.get()
        on_primals = bool(operands) and all(any(a is p for p in primals) for a in operands)
        with _setting(primal_calls, True) if on_primals else contextlib.nullcontext():
            return _bind(*args, **params)

    custom_jvp_call_p.bind = bind


@contextlib.contextmanager
def _setting(var, value):
    """The context variable var holds value in the block."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _traced(fun, avals):
    """fun's jaxpr and consts on avals; None where it cannot be traced so."""
    try:
        jaxpr, _, consts, *_ = _pe.trace_to_jaxpr_dynamic(fun, avals)
    except Exception:
        return None
    return jaxpr, consts


def _forget(fun):
    """Empty the stores that a call of fun filled (its output's structure),
    so that JAX can call it, or its rule, as if it had not run."""
    for store in filter(None, fun.stores):
        store.reset()


def _batched_at(trace, x):
    return isinstance(x, _batching.BatchTracer) and x._trace.tag is trace.tag and x.batch_dim is not None


def keep_every_input_of_bodies_with_mpi_calls(effect_type):
    """Dead-code elimination keeps every input of a jaxpr that makes MPI
    calls. A loop, cond, checkpoint or shard_map body's derivative, once
    linearized, counts as linear (and is transposed) only through its
    linear inputs that it uses; a rank whose body does not use the
    differentiated value lost them, ran the derivative's calls forward on
    zeros, and the ranks that waited for its cotangents received zeros."""
    dce_jaxpr = _pe.dce_jaxpr

    def keeping(jaxpr, used_outputs, instantiate=False, **rest):  # JAX 0.12 adds live_inputs
        if any(isinstance(e, effect_type) for e in jaxpr.effects):
            instantiate = True
        return dce_jaxpr(jaxpr, used_outputs, instantiate, **rest)

    _pe.dce_jaxpr = keeping


# The partial evaluation under way in which MPI calls are never evaluated
# early: its parent trace (or _TANGENTS), and whether it is linear_transpose's.
_staging_under = contextvars.ContextVar("mpijax_staging_under", default=(None, False))
_TANGENTS = object()


def _staging(partial_eval, tangents_only):
    """`partial_eval`, under which MPI calls are staged (see stage_mpi_calls).

    `pe.trace_to_jaxpr_nounits` runs a function on partially known values
    and evaluates at once whatever depends on known values only. JAX uses it
    in linear_transpose, where a call whose operands are constants on one
    rank would run at trace time there but be transposed on the others, and
    to hoist loop-invariant work out of a scan under differentiation, which
    would take a receive into a constant buffer out of its loop (and the
    sender's loop would wait forever). Under it, MPI calls are staged.

    `pe.partial_eval_jaxpr_nounits[_fwd]` (`tangents_only`) splits the
    recomputation of a checkpointed function from its linear part when it is
    transposed. A receive into a constant buffer has a constant zero tangent
    on its rank: evaluated early, it would receive where the peer's
    transposed send has become a receive too. Under it, the calls of
    tangents with a floating-point operand are staged, at any depth."""

    def wrapper(*args, **kwargs):
        if tangents_only:
            scope = (_TANGENTS, False)
        else:
            linear = sys._getframe(1).f_code.co_name == "linear_transpose" and not _solve_transposing.get()
            scope = (_core.trace_ctx.trace, linear)
        with _setting(_staging_under, scope):
            return partial_eval(*args, **kwargs)

    return wrapper


# lax.custom_linear_solve takes its matvec's transpose (jax.scipy's bicgstab
# and gmres) when it is built, for a forward solve too, and runs it only under
# grad: there a transpose that cannot be computed (a receive from anyone) is
# refused where it is compiled or run (primitive.refusal_p), not while
# linear_transpose stages the matvec.
_solve_transposing = contextvars.ContextVar("mpijax_solve_transposing", default=False)


_transpose_one_output = _solves._transpose_one_output


def _transpose_for_solve(*args, **kwargs):
    with _setting(_solve_transposing, True):
        return _transpose_one_output(*args, **kwargs)


_solves._transpose_one_output = _transpose_for_solve
_pe.trace_to_jaxpr_nounits = _staging(_pe.trace_to_jaxpr_nounits, tangents_only=False)
# JAX 0.12's checkpoint transposes with the _fwd form.
for _name in ("partial_eval_jaxpr_nounits", "partial_eval_jaxpr_nounits_fwd"):
    if hasattr(_pe, _name):
        setattr(_pe, _name, _staging(getattr(_pe, _name), tangents_only=True))


def stage_mpi_calls(primitive, check_transposable=None, tangents=False):
    """Partial evaluation of `primitive`: JAX's default, except under
    pe.trace_to_jaxpr_nounits, where the call is always staged, with its
    floating-point constants as linear values (a frozen new ref) if
    `tangents` (the primitive of the tangents' calls, not its primal twin),
    so that linear_transpose transposes it on every rank; and under
    pe.partial_eval_jaxpr_nounits, see _staging. Under linear_transpose
    (not where custom_linear_solve calls it) `check_transposable(**params)`
    may raise first, on every rank alike, before any MPI call has run."""

    def rule(trace, *tracers, **params):
        parent, linear = _staging_under.get()
        if parent is trace.parent_trace or (parent is _TANGENTS and tangents and any(map(_inexact, tracers))):
            if linear and check_transposable:
                check_transposable(**params)
            if all(t.pval.is_known() for t in tracers):
                with _core.set_current_trace(trace):
                    tracers = [_staged(trace, t, linear=tangents) for t in tracers]
        return trace.default_process_primitive(primitive, tracers, params)

    _pe.custom_partial_eval_rules[primitive] = rule


def stage_tangent_calls_in_remat(primitive):
    """Under jax.checkpoint, JAX's partial evaluation (partial_eval_jaxpr_custom)
    runs a call whose operands are all known in the forward pass. In the JVP
    of the checkpointed function, the calls of the tangents (this primitive;
    the primal's calls bind its twin) can have only known operands on one rank,
    a receive into a constant buffer whose tangent is a constant zero, while
    the peer's send has an unknown tangent: the receive would run forward
    there, and the send be transposed into a receive that nothing answers. So
    a call with a floating-point operand is always staged, and transposed on
    every rank alike; the others (integer calls, not differentiated) are left
    as JAX leaves them: run forward, never recomputed, as any effect."""

    def rule(saveable, unks_in, inst_in, eqn):
        n = len(eqn.outvars)
        if any(unks_in) or any(map(_inexact, eqn.invars)):
            residuals = [v for v, inst in zip(eqn.invars, inst_in, strict=True) if type(v) is _core.Var and not inst]
            return None, eqn, [True] * n, [True] * n, residuals
        return eqn, None, [False] * n, [False] * n, []

    _pe.partial_eval_jaxpr_custom_rules[primitive] = rule


def _staged(trace, tracer, linear):
    """`tracer` as an unknown operand; a floating-point one as a linear
    value too if `linear` (not for the primal twin's calls, whose operands
    a frozen ref would leave batched where vmap batches the refs of a
    loop's body, as jacfwd of a transpose does)."""
    staged = trace.instantiate_const(tracer)
    if linear and _inexact(staged):
        return jax.freeze(jax.new_ref(staged))
    return staged


def _inexact(x):
    """Whether a tracer or jaxpr variable holds floating-point values."""
    return jnp.issubdtype(x.aval.dtype, jnp.inexact)


def batched_if_vmapped(x):
    """`x` batched along the innermost vmap, if there is one."""
    trace = _core.trace_ctx.trace
    return _batched(trace, x) if isinstance(trace, _batching.BatchTrace) else x


# jax.lax.pvary until JAX 0.9, then pcast(..., to="varying").
_to_varying = functools.partial(lax.pcast, to="varying") if hasattr(lax, "pcast") else lax.pvary


def varying_like(ct, aval):
    """A transpose rule's cotangent `ct` typed over shard_map's mesh axes as
    its primal's `aval` is (check_vma): made varying where the primal varies,
    summed where it does not, as JAX transposes its own casts. mpijax's calls
    run on one device, so the mesh axes have size 1 and the values stay."""
    if isinstance(ct, _ad.Zero):
        return _ad.Zero(aval.to_tangent_aval())
    have, want = _varying_axes(_core.typeof(ct)), _varying_axes(aval)
    if extra := have - want:
        ct = lax.psum(ct, tuple(sorted(extra)))
    if missing := want - have:
        ct = _to_varying(ct, tuple(sorted(missing)))
    return ct


def _varying_axes(aval):
    """The mesh axes over which values of `aval` vary (aval.mat.varying from
    JAX 0.10, aval.vma before)."""
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


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
    # Integer and bool values have no tangents on any rank, nor has a JAX
    # token (passed into an inner jit, found by a tester).
    if not isinstance(aval, _core.ShapedArray) or not jnp.issubdtype(aval.dtype, jnp.inexact):
        return x
    with _core.set_current_trace(tangent_trace):
        tangent = zeros(aval)
    return tracer_type(trace, x, tangent)


def _zeros(aval):
    """Zeros of `aval`, typed as varying over shard_map's mesh axes where it is."""
    return _ad_util.zeros_like_aval(aval.update(weak_type=False))


def _linear_zeros(aval):
    return jax.freeze(jax.new_ref(_zeros(aval)))
