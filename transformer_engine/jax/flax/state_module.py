"""TE's quantized GEMMs inside other Flax code: a function wrapped in a module that owns its FP8 state.

``wrap_function_in_te_state_module(f, recipe)`` returns a Flax module class whose ``__call__(*args)`` is
``f(generate_quantizer_set, *args)``; ``generate_quantizer_set(postfix="")`` gives the quantizer set of one GEMM
under ``recipe`` (the no-op set for ``recipe=None``), whatever autocast is active. Delayed scaling keeps its
state in the ``"_overwrite_with_gradient"`` collection (NVIDIA TE's choice for these wrappers, which frameworks
such as MaxText handle): ``{x,kernel,grad}{postfix}_scale`` and ``_amax_history``, whose gradient is their next
value (see ``transformer_engine.jax.dense``).

    te_dot_general_cls = make_dot_general_cls(DelayedScaling())
    layer = nn.Dense(features, dot_general=te_dot_general_cls())   # y = x . W in FP8, W still Flax's param

``make_grouped_dense_cls(None)`` is a grouped GEMM (``jax.lax.ragged_dot``: rows of x in consecutive groups of
``group_sizes``, group g multiplied by ``kernel[g]``) in the input precision.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
from jax import lax

from ..dense import dense
from ..quantize import QuantizeMetaSet, QuantizerFactory, QuantizerSet, noop_quantizer_set
from ._base import _ROLES, _meta_variables

__all__ = ["make_dot_general_cls", "make_grouped_dense_cls", "wrap_function_in_te_state_module"]

#: the variable collection of the wrappers' delayed-scaling state (NVIDIA TE's)
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def wrap_function_in_te_state_module(f: Callable, quantization_recipe, name: Optional[str] = None,
                                     quantization_checkpoint_name: Optional[str] = None) -> type:
    """A Flax module class calling ``f(generate_quantizer_set, *args, **kwargs)``; it owns no parameters, only the
    FP8 state ``quantization_recipe`` keeps (see the module docstring). ``quantization_checkpoint_name``: accepted,
    as by the other modules, with no effect on the math.

    Raises (when the module is called):
        NotImplementedError: ``generate_quantizer_set(n_groups=...)`` with a recipe (per-group quantizers).
    """
    del quantization_checkpoint_name

    class TEWrapper(nn.Module):
        """Owns the FP8 state of the GEMMs ``f`` runs (see ``wrap_function_in_te_state_module``)."""

        def generate_quantizer_set(self, postfix: str = "", n_groups: Optional[int] = None) -> QuantizerSet:
            if quantization_recipe is None:
                return noop_quantizer_set
            if n_groups is not None:
                raise NotImplementedError(
                    f"{type(self).__name__}: quantizers per group (n_groups={n_groups}) are not implemented; "
                    "use quantization_recipe=None"
                )
            initial = QuantizerFactory.create_meta_set(quantization_recipe)
            if initial is None:  # a recipe without state: current scaling, MXFP8
                return QuantizerFactory.create_set(recipe=quantization_recipe)
            metas = QuantizeMetaSet(*(_meta_variables(self, role + postfix, meta, OVERWRITE_WITH_GRADIENT)
                                      for role, meta in zip(_ROLES, initial)))
            return QuantizerFactory.create_set(recipe=quantization_recipe, meta_set=metas)

        @nn.compact
        def __call__(self, *args, **kwargs):
            return f(self.generate_quantizer_set, *args, **kwargs)

    TEWrapper.__name__ = TEWrapper.__qualname__ = f"TEWrapper_{name or f.__name__}"
    return TEWrapper


def make_dot_general_cls(quantization_recipe) -> type:
    """A Flax module class that is a ``dot_general`` (x, kernel, dimension_numbers) running TE's GEMM under
    ``quantization_recipe``: for ``nn.Dense(dot_general=make_dot_general_cls(recipe)())`` and the like, where the
    kernel stays the caller's parameter.

    Raises (when called):
        ValueError: dimension numbers with batch dimensions (TE's GEMM contracts, it does not batch).
    """

    def te_dot_general(generate_quantizer_set, x: jax.Array, kernel: jax.Array, dims, **kwargs) -> jax.Array:
        del kwargs  # precision, preferred_element_type: TE's GEMM chooses them
        contracting_dims, batch_dims = dims
        if tuple(map(tuple, batch_dims)) != ((), ()):
            raise ValueError(f"te_dot_general: batch dimensions {batch_dims} are not supported; pass ((), ())")
        return dense(x, kernel, contracting_dims=contracting_dims, quantizer_set=generate_quantizer_set())

    return wrap_function_in_te_state_module(te_dot_general, quantization_recipe, "dot_general")


def make_grouped_dense_cls(quantization_recipe, quantization_checkpoint_name: Optional[str] = None) -> nn.Module:
    """An instance of a module computing the grouped GEMM ``(x, kernel, group_sizes) -> y``: x [M, K] in consecutive
    groups of ``group_sizes`` rows (sum <= M; rows past the sum give 0), kernel [G, K, N], y[rows of g] = x[rows of g]
    . kernel[g] (``jax.lax.ragged_dot``), in the input precision.

    Raises:
        NotImplementedError: a quantization recipe (NVIDIA TE takes MXFP8BlockScaling here; not implemented yet).
    """
    if quantization_recipe is not None:
        raise NotImplementedError(
            f"make_grouped_dense_cls({type(quantization_recipe).__name__}()): quantized grouped GEMMs are not implemented "
            "yet in TransformerEngine-FL's JAX; pass None (the grouped GEMM in the input precision)"
        )

    def te_grouped_dot_general(generate_quantizer_set, x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, **kwargs):
        del generate_quantizer_set, kwargs
        return lax.ragged_dot(x, kernel.astype(x.dtype), group_sizes)

    return wrap_function_in_te_state_module(te_grouped_dot_general, None, "ragged_dot",
                                            quantization_checkpoint_name=quantization_checkpoint_name)()
