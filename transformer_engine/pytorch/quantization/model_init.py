"""``quantized_model_init``: build modules whose primary weights belong to a quantization recipe.

    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        layer = te.Linear(1024, 1024)

Modules built inside store their GEMM weights as FP8 ``Float8Tensor`` parameters (DelayedScaling,
Float8CurrentScaling, or a CustomRecipe of per-tensor quantizers), ``Float8BlockwiseQTensor`` parameters
(Float8BlockScaling), ``MXFP8Tensor`` parameters (MXFP8BlockScaling) or ``NVFP4Tensor`` parameters
(NVFP4BlockScaling), which forward uses as they are: no weight cast per step, half the bytes of bf16 but for
the layouts that keep two quantizations (see ``module/_fp8_params.py``). They remember the
recipe: running them under an ``autocast`` of another recipe type raises ``RuntimeError("Recipe
mismatch ...")``, and so does loading a checkpoint of another recipe. With
``preserve_high_precision_init_val=True`` each FP8 weight keeps a CPU copy of its initial values, read
with ``param.get_high_precision_init_val()`` and freed with ``param.clear_high_precision_init_val()``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from transformer_engine.common.recipe import Recipe

from .availability import get_default_recipe
from .recipe_state import check_recipe_implemented

__all__ = ["ModelInitConfig", "fp8_model_init", "model_init_config", "quantized_model_init"]


@dataclass(frozen=True)
class ModelInitConfig:
    """The active ``quantized_model_init`` setting (disabled outside any)."""

    enabled: bool = False
    recipe: Optional[Recipe] = None
    preserve_high_precision_init_val: bool = False


_config = ModelInitConfig()


def model_init_config() -> ModelInitConfig:
    """The setting that modules being constructed now must follow."""
    return _config


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Modules constructed inside belong to ``recipe`` (default: :func:`get_default_recipe`).

    Raises:
        NotImplementedError: for a recipe the modules cannot run yet.

    Example:
        >>> import transformer_engine.pytorch as te
        >>> from transformer_engine.common.recipe import Float8CurrentScaling
        >>> with te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True):
        ...     layer = te.Linear(16, 16)
        >>> type(layer.weight).__name__, layer.weight.get_high_precision_init_val().shape
        ('Float8Tensor', torch.Size([16, 16]))
    """
    global _config
    if enabled:
        recipe = recipe if recipe is not None else get_default_recipe()
        check_recipe_implemented(recipe)
    saved, _config = _config, ModelInitConfig(bool(enabled), recipe, bool(preserve_high_precision_init_val))
    try:
        yield
    finally:
        _config = saved


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False):
    """Deprecated alias of :func:`quantized_model_init`."""
    warnings.warn("fp8_model_init is deprecated; use transformer_engine.pytorch.quantized_model_init", DeprecationWarning, stacklevel=2)
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)
