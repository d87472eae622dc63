"""Quantization runtime of the PyTorch modules: recipes' scaling state, quantizers, autocast.

- :mod:`.scaling`: the per-tensor scaling formulas (amax -> scale) and FP8 dtypes per format;
- :mod:`.float8_tensor`: :class:`Float8Tensor`, FP8 data with its scale_inv;
- :mod:`.float8_blockwise_tensor`: :class:`Float8BlockwiseTensor`, FP8 data with one scale per tile;
- :mod:`.mxfp8_tensor`: :class:`MXFP8Tensor`, FP8 data with one E8M0 scale per block of 32;
- :mod:`.quantizer`: one quantizer per tensor role (delayed, current, block, calibration, identity);
- :mod:`.recipe_state`: per-module scaling state (``fp8_meta["scaling_fwd"|"scaling_bwd"]``);
- :mod:`.delayed_update`: the amax reduction and delayed-scaling update of a group of states;
- :mod:`.autocast`: ``autocast`` / ``fp8_autocast`` and the update schedule;
- :mod:`.model_init`: ``quantized_model_init`` / ``fp8_model_init``;
- :mod:`.availability`: support queries, the FP8 emulation switch, the default recipe;
- :mod:`.global_state`: ``FP8GlobalStateManager`` for clients.
"""

from .autocast import QuantizationConfig, autocast, current_config, fp8_autocast
from .delayed_update import amax_and_scale_update as _amax_and_scale_update  # noqa: F401 - NVIDIA TE's names (its tests call them)
from .delayed_update import default_scale as _default_sf_compute  # noqa: F401
from .availability import (
    FP8_EMULATION_ENV,
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    get_cudnn_version,
    get_default_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .float8_blockwise_tensor import Float8BlockwiseTensor
from .float8_tensor import DeferredTranspose, Float8Tensor
from .global_state import FP8GlobalStateManager
from .model_init import fp8_model_init, quantized_model_init
from .mxfp8_tensor import MXFP8Tensor
from .quantizer import (
    AmaxObserver,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    FixedScaleQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from .recipe_state import (
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    RecipeState,
)
from .roles import FP8BwdTensors, FP8FwdTensors

__all__ = [
    "AmaxObserver",
    "DeferredTranspose",
    "DelayedScalingRecipeState",
    "FP8BwdTensors",
    "FP8FwdTensors",
    "FP8GlobalStateManager",
    "FP8_EMULATION_ENV",
    "Float8BlockQuantizer",
    "Float8BlockScalingRecipeState",
    "Float8BlockwiseTensor",
    "Float8CurrentScalingQuantizer",
    "Float8CurrentScalingRecipeState",
    "Float8Quantizer",
    "Float8Tensor",
    "FixedScaleQuantizer",
    "IdentityQuantizer",
    "MXFP8BlockScalingRecipeState",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "QuantizationConfig",
    "Quantizer",
    "RecipeState",
    "autocast",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "current_config",
    "fp8_autocast",
    "fp8_model_init",
    "get_cudnn_version",
    "get_default_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "quantized_model_init",
]
