"""Deprecated: ``transformer_engine.pytorch.fp8`` (renamed ``quantization`` in TE 2.9). Importing it warns.

Kept for clients that still import from here (HF Accelerate's ``check_mxfp8_support``, Megatron-LM's
``FP8GlobalStateManager``, ``fp8_autocast``, ``fp8_model_init``).
"""

import warnings

from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

from .quantization import (
    FP8GlobalStateManager,
    autocast,
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    quantized_model_init,
)

warnings.warn(
    "transformer_engine.pytorch.fp8 is deprecated; import from transformer_engine.pytorch (or its quantization module)",
    DeprecationWarning,
    stacklevel=2,
)

get_default_fp8_recipe = get_default_recipe

__all__ = [
    "DelayedScaling",
    "FP8GlobalStateManager",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "autocast",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "fp8_autocast",
    "fp8_model_init",
    "get_default_fp8_recipe",
    "get_default_recipe",
    "quantized_model_init",
]
