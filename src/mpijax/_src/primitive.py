"""The primitive factories: one ordered effect, abstract evaluation, eager
evaluation and the FFI lowering that threads the token; plus the helpers that
the autodiff and vmap rules of every op share."""

import atexit
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import ad, batching, mlir

from . import jax_compat
from .runtime import FFI_TARGETS


class MpiEffect(jax_compat.Effect):
    """Every MPI call carries this one ordered effect: XLA threads a single
    token through all of them, so they run in program order on every rank."""

    __str__ = lambda self: "Mpi"  # noqa: E731
    # All instances are the one effect, as jax.export's deserializer needs.
    __eq__ = lambda self, other: isinstance(other, MpiEffect)  # noqa: E731
    __hash__ = lambda self: hash(MpiEffect)  # noqa: E731


mpi_effect = MpiEffect()
jax_compat.register_ordered_effect(MpiEffect)
jax_compat.reuse_runtime_tokens_in_place()
jax_compat.aot_calls_thread_runtime_tokens()
jax_compat.batched_while_loops_keep_finished_elements(MpiEffect)
jax_compat.batched_conds_run_element_by_element(MpiEffect)
jax_compat.differentiate_bodies_with_mpi_calls(MpiEffect)
jax_compat.custom_derivatives_with_mpi_calls(MpiEffect)
jax_compat.keep_every_input_of_bodies_with_mpi_calls(MpiEffect)
seal = jax_compat.seal_at_top_level(mpi_effect)


def _one_device_per_program(closed_jaxpr, num_devices):
    """Each process makes its MPI calls once, from one device's program; JAX
    would refuse a program over several devices too, naming only the effect."""
    if num_devices > 1 and mpi_effect in closed_jaxpr.effects:
        ops = {
            e.primitive.name.removeprefix("mpijax_")
            for jaxpr in jax_compat.jaxprs(closed_jaxpr)
            for e in jaxpr.eqns
            if e.primitive.name.startswith("mpijax_") and mpi_effect in e.effects
        }
        raise ValueError(
            f"mpijax: this program's MPI calls ({', '.join(sorted(ops))}) would run on {num_devices} devices, "
            "over which its arrays are sharded; a process makes its MPI calls on one device: pass arrays that live "
            "on one device (jax.device_put(x, device); a process's own part of a global array is "
            "x.addressable_data(0))"
        )


jax_compat.program_checks.append(_one_device_per_program)


def drain():
    """Block until every MPI call dispatched so far, from any thread, has run
    (mpijax.wait() with no requests; jax.effects_barrier() does the same)."""
    jax.effects_barrier()


# Python may reach MPI_Finalize (mpi4py calls it after every atexit function)
# with MPI calls still queued; JAX's own atexit function runs after its
# backends are gone, too late to drain a sealed device.
atexit.register(drain)


EAGER_PROGRAMS = 64  # per primitive: the eager calls' compiled programs kept for reuse


class MpiPrimitive(jax_compat.Primitive):
    """A primitive that makes MPI calls. Under differentiation and vmap its
    operands are first aligned with the transformation, so that every rank
    makes the same calls whatever its own operands depend on."""

    routed = False  # whether the last operand is a route (point_to_point.py), which is never aligned
    aligned = True  # whether operands are aligned with the transformations at all
    vmapped = True  # whether vmap aligns them (not for the primal twin, see bind_primal)

    def __init__(self, name):
        super().__init__(name)
        self._eager = {}
        self.primal = self

    def bind(self, *args, **params):
        if jax_compat.is_eager():
            return self._compiled(params)(*args)
        if self.primal is not self and jax_compat.primal_calls.get():
            return self.primal.bind(*args, **params)
        return super().bind(*self._aligned(args, vmap=self.vmapped), **params)

    def _compiled(self, params):
        """The call alone, jitted: what JAX's eager evaluation runs, without
        its per-call steps (trace lookup, keyword hashing), so an eager MPI
        call costs about what a jitted one does. The EAGER_PROGRAMS used last
        are kept (each holds its compiled programs): a loop over new tags,
        roots or communicators must not keep one per iteration."""
        key = tuple(sorted(params.items()))
        compiled = self._eager.pop(key, None)
        if compiled is None:
            compiled = jax.jit(lambda *args: jax_compat.Primitive.bind(self, *args, **params))
            if len(self._eager) >= EAGER_PROGRAMS:
                self._eager.pop(next(iter(self._eager)), None)
        self._eager[key] = compiled  # the dict's order: least recently used first
        return compiled

    def bind_with_trace(self, trace, args, *rest):
        # Partial evaluation binds a call whose operands are all known straight
        # to its parent trace, past bind: align them with that trace too (for
        # differentiation, which leaves their avals, in `rest`, as they are).
        return super().bind_with_trace(trace, self._aligned(args, vmap=False, trace=trace), *rest)

    def bind_primal(self, *args, **params):
        """The primal call of a JVP rule. Under vmap it is batched only where
        its operands are: jacfwd computes the primal inside its vmap, from
        values that are unbatched on every rank, and needs it unbatched. It
        is the call of a twin primitive that vmap does not align, so that it
        stays so where the JVP is staged and batched later (a loop's body
        under jacfwd)."""
        return self.primal.bind(*args, **params)

    def with_twin(self):
        """This primitive and its primal twin (bind_primal), a primitive of
        its own that the factories register alike."""
        twin = MpiPrimitive(self.name)
        twin.vmapped = False
        twin.routed, twin.aligned = self.routed, self.aligned
        self.primal = twin
        return self, twin

    def _aligned(self, args, vmap, trace=None):
        if not self.aligned:
            return list(args)
        n = len(args) - self.routed
        return [*jax_compat.align_with_transformation(args[:n], vmap, trace), *args[n:]]


def _no_aliases(*avals, **params):
    return None


def mpi_primitive(
    name,
    outputs,
    aliases=_no_aliases,
    *,
    jvp=None,
    transpose=None,
    batch=None,
    attributes=None,
    routed=False,
    aligned=True,
    check_transposable=None,
):
    """A primitive for the FFI target ``mpijax_<name>``, with its rules.

    outputs(*avals, **params) -> list of output avals (the token is added here).
    aliases(*avals, **params) -> {operand index: output index} that XLA should
    alias, so the handler can work in place, or None.
    jvp(prim, primals, tangents, **params): the JVP rule (linear_jvp for a
    linear call).
    transpose(cts, *operands, **params): the transpose of a linear call.
    batch(prim, args, dims, **params): the vmap rule, which makes one call on
    the batch.
    (A call without operands, barrier, has no jvp and no batch rule.)
    attributes: the params passed to the handler, as int64 attributes of the
    same name, int64 arrays where they are tuples and uint8 arrays where bytes
    (default: all); the others only steer the Python rules.
    routed: the last operand is a route (point_to_point.py).
    aligned: whether MpiPrimitive aligns the operands with the transformations
    (False where the rules need to see which operands truly have tangents).
    check_transposable(**params): raises if linear_transpose cannot transpose
    the call (jax_compat.stage_mpi_calls).
    """
    prim = MpiPrimitive(f"mpijax_{name}")
    prim.routed = routed
    prim.aligned = aligned
    prim.check_transposable = check_transposable or (lambda **params: None)

    def lower(ctx, *operands, shield, **params):
        token = ctx.tokens_in.get(mpi_effect)
        # XLA:GPU's dynamic-slice fusion (JAX 0.11) folds the slices that
        # feed a custom call, and the updates of slices with its results,
        # into a fusion around it, token and all, which its priority fusion
        # cannot cost: a CHECK failure aborts the process. Barriers on both
        # sides keep them apart.
        shielded = _behind_barrier if shield else list
        operands = shielded(operands)
        rule = jax.ffi.ffi_lowering(
            f"mpijax_{name}",
            has_side_effect=True,
            operand_output_aliases=aliases(*ctx.avals_in, **params),
        )
        with_token = ctx.replace(
            avals_in=[*ctx.avals_in, jax_compat.abstract_token],
            avals_out=[*ctx.avals_out, jax_compat.abstract_token],
        )
        attrs = {k: _attribute(v) for k, v in params.items() if attributes is None or k in attributes}
        *results, token = rule(with_token, *operands, token, **attrs)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({mpi_effect: token})))
        return shielded(results)

    for p in prim.with_twin():
        p.check_transposable = prim.check_transposable
        p.multiple_results = True
        p.def_impl(partial(jax_compat.apply_primitive, p))
        p.def_effectful_abstract_eval(lambda *avals, **params: (outputs(*avals, **params), {mpi_effect}))
        for platform in FFI_TARGETS:
            mlir.register_lowering(p, partial(lower, shield=platform == "CUDA"), platform=platform.lower())
        jax_compat.stage_mpi_calls(p, prim.check_transposable, tangents=p is prim)
    jax_compat.stage_tangent_calls_in_remat(prim)
    _define_rules(prim, jvp, transpose, batch)
    return prim


def _behind_barrier(values):
    """values, passed through an optimization barrier (where there are any)."""
    return list(hlo.OptimizationBarrierOp(values).results) if values else []


def _attribute(value):
    """A param as the handler's attribute: tuples become int64 arrays, bytes
    uint8 arrays."""
    if isinstance(value, tuple):
        return np.array(value, np.int64)
    return np.frombuffer(value, np.uint8) if isinstance(value, bytes) else value


def _define_rules(prim, jvp, transpose, batch):
    """The rules of prim and of its primal twin; the JVP rule is prim's for
    both, so that the tangents' calls are aligned with vmap."""
    for p in (prim, prim.primal):
        if jvp is not None:
            ad.primitive_jvps[p] = partial(jvp, prim)
        if transpose is not None:
            ad.primitive_transposes[p] = partial(_typed_like_primals, transpose)
        if batch is not None:
            batching.primitive_batchers[p] = partial(batch, p)


def _typed_like_primals(transpose, cts, *primals, **params):
    """`transpose`'s cotangents, each typed over shard_map's mesh axes as
    its primal is: JAX checks that, and receives and constants are typed
    invariant whatever they are computed from."""
    return [
        jax_compat.varying_like(ct, x.aval) if ad.is_undefined_primal(x) and ct is not None else ct
        for ct, x in zip(transpose(cts, *primals, **params), primals, strict=True)
    ]


def _token_primitive(name, outputs, lower):
    """A communication-free step of the token chain (for mpijax.tokens)."""
    prim = jax_compat.Primitive(f"mpijax_{name}")
    prim.multiple_results = True
    prim.def_impl(partial(jax_compat.apply_primitive, prim))
    prim.def_effectful_abstract_eval(lambda *avals: (outputs, {mpi_effect}))
    mlir.register_lowering(prim, lower)
    return prim


def _chained(ctx, value):
    """Tie `value` (an array or token) to the MPI token chain, both ways."""
    token, value = hlo.OptimizationBarrierOp([ctx.tokens_in.get(mpi_effect), value]).results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({mpi_effect: token})))
    return value


def _lower_join(ctx, token):
    _chained(ctx, token)
    return []


# join_p(token): later MPI calls depend on `token` (a user token: a float32
# scalar, or a JAX token).
join_p = _token_primitive("join", [], _lower_join)
# current_token_p(): a float32 scalar that depends on every earlier MPI call.
current_token_p = _token_primitive(
    "current_token",
    [jax.core.ShapedArray((), jnp.float32)],
    lambda ctx: [_chained(ctx, mlir.ir_constant(np.float32(0)))],
)
batching.primitive_batchers[join_p] = lambda args, dims: (join_p.bind(*args), [])
# A token carried through a loop, cond or checkpoint whose body makes MPI
# calls gets a tangent like every floating-point operand there: the chain
# takes the primal token and has no outputs to differentiate.
ad.primitive_jvps[join_p] = lambda primals, tangents: (join_p.bind(*primals), [])


def local_primitive(name, impl, *, transpose, batch):
    """A communication-free linear primitive computed by `impl(x, **params)`
    (jnp code): the adjoints of the ops whose results are replicated. Their
    own adjoints (`transpose`) communicate, so they are MPI calls to JAX
    (aligned with every transformation, never dead-code-eliminated, staged in
    linear_transpose): otherwise a rank whose adjoint's result is unused would
    drop it, and skip the collective that the other ranks make when
    transposing again. `batch`: the vmap rule."""
    prim = MpiPrimitive(f"mpijax_{name}")

    def abstract(x, **params):
        out = jax.eval_shape(partial(impl, **params), x)
        return x.update(shape=out.shape, dtype=out.dtype), {mpi_effect}

    for p in prim.with_twin():
        p.def_impl(impl)
        p.def_effectful_abstract_eval(abstract)
        # lower_fun passes the token through unchanged.
        mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
        jax_compat.stage_mpi_calls(p, tangents=p is prim)
    jax_compat.stage_tangent_calls_in_remat(prim)
    _define_rules(prim, linear_jvp, transpose, batch)
    return prim


def _refuse(*args, message, outputs):
    raise NotImplementedError(message)


def _refusal_batch(args, dims, *, message, outputs):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    outputs = tuple(((size, *shape), dtype) for shape, dtype in outputs)
    outs = refusal_p.bind(*batch_operands(args, dims, [0] * len(args)), message=message, outputs=outputs)
    return outs, [0] * len(outs)


def _refusal_transpose(cts, *operands, message, outputs):
    outputs = tuple((x.aval.shape, x.aval.dtype) for x in operands)
    return refusal_p.bind(*map(ad.instantiate_zeros, cts), message=message, outputs=outputs)


# refusal_p.bind(*operands, message=, outputs=((shape, dtype), ...)): a linear
# map that cannot be computed, which raises NotImplementedError(message) where
# it is compiled or run, not where it is traced (lax.custom_linear_solve takes
# its matvec's transpose for a forward solve too, and only grad runs it). It
# has the MPI effect, so that it is never dead-code-eliminated where the
# peers' transposed calls would wait for it.
refusal_p = jax_compat.Primitive("mpijax_refusal")
refusal_p.multiple_results = True
refusal_p.def_impl(_refuse)
refusal_p.def_effectful_abstract_eval(
    lambda *avals, outputs, **params: ([jax.core.ShapedArray(*out) for out in outputs], {mpi_effect})
)
mlir.register_lowering(refusal_p, _refuse)
batching.primitive_batchers[refusal_p] = _refusal_batch
ad.deflinear2(refusal_p, _refusal_transpose)


def linear_jvp(prim, primals, tangents, **params):
    """The JVP of a linear primitive: the same call on the tangents."""
    return prim.bind_primal(*primals, **params), prim.bind(*map(ad.instantiate_zeros, tangents), **params)


def cotangent(cts):
    """A transpose rule's cotangent, instantiated, and batched under vmap
    (jacrev): it can be a symbolic zero here and batched on the rank it is
    exchanged with. Every adjoint is a call on every rank (MPI calls must
    match), made whether or not the cotangent is symbolically zero."""
    return jax_compat.batched_if_vmapped(ad.instantiate_zeros(cts[0] if isinstance(cts, list) else cts))


def batch_operands(args, dims, axes):
    """Put each operand's batch axis at position axes[i] (broadcasting any
    unbatched operand): every rank then lays out its messages alike."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    return [
        jnp.moveaxis(a, d, axis) if d is not None else jnp.expand_dims(a, axis).repeat(size, axis)
        for a, d, axis in zip(args, dims, axes, strict=True)
    ]
