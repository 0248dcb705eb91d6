"""One factory for every MPI primitive: the ordered effect, abstract
evaluation, eager evaluation and the FFI lowering that threads the token."""

from functools import partial

import jax
from jax.interpreters import mlir

from . import jax_compat
from .runtime import core  # noqa: F401  (registers the FFI targets)


class MpiEffect(jax_compat.Effect):
    """Every MPI call carries this one ordered effect: XLA threads a single
    token through all of them, so they run in program order on every rank."""

    __str__ = lambda self: "Mpi"  # noqa: E731


mpi_effect = MpiEffect()
jax_compat.register_ordered_effect(MpiEffect)


def _no_aliases(*avals, **params):
    return None


def mpi_primitive(name, outputs, aliases=_no_aliases):
    """A primitive for the FFI target ``mpijax_<name>``.

    outputs(*avals, **params) -> list of output avals (the token is added here).
    aliases(*avals, **params) -> {operand index: output index} that XLA should
    alias, so the handler can work in place, or None.
    Every param is an int passed to the handler as an attribute of that name.
    """
    prim = jax_compat.Primitive(f"mpijax_{name}")
    prim.multiple_results = True
    prim.def_impl(partial(jax_compat.apply_primitive, prim))
    prim.def_effectful_abstract_eval(lambda *avals, **params: (outputs(*avals, **params), {mpi_effect}))

    def lower(ctx, *operands, **params):
        token = ctx.tokens_in.get(mpi_effect)
        rule = jax.ffi.ffi_lowering(
            f"mpijax_{name}",
            has_side_effect=True,
            operand_output_aliases=aliases(*ctx.avals_in, **params),
        )
        with_token = ctx.replace(
            avals_in=[*ctx.avals_in, jax_compat.abstract_token],
            avals_out=[*ctx.avals_out, jax_compat.abstract_token],
        )
        *results, token = rule(with_token, *operands, token, **params)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({mpi_effect: token})))
        return results

    mlir.register_lowering(prim, lower, platform="cpu")
    return prim
