"""TransformerEngine-FL for PyTorch: TE's modules, ``autocast`` and quantization queries.

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    layer = te.Linear(1024, 1024)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = layer(x)

FP8 runs on CUDA GPUs with FP8 hardware (sm >= 8.9) and, emulated by the reference backend, on the
CPU; on an older GPU set ``TE_FL_FP8_EMULATION=1`` to emulate it there too. Importing this package
changes no global PyTorch state.
"""

from transformer_engine.common import recipe

from .module import Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .quantization import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_cudnn_version,
    get_default_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from .attention import DotProductAttention, InferenceParams, MultiheadAttention, RotaryPositionEmbedding
from .cpu_offload import get_cpu_offload_context
from .distributed import CudaRNGStatesTracker, checkpoint
from .graph import make_graphed_callables
from .cross_entropy import parallel_cross_entropy
from .permutation import (
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .tensor import (
    DType, Float8BlockQuantizer, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, MXFP8Quantizer,
    MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor, QuantizedTensor, Quantizer,
)
from .transformer import TransformerLayer
from . import ops, optimizers, router  # noqa: E402 - TE's submodules, reached as te.ops / te.optimizers / te.router

__all__ = [
    "CudaRNGStatesTracker",
    "DType",
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
    "DotProductAttention",
    "Fp8Padding",
    "Fp8Unpadding",
    "GroupedLinear",
    "InferenceParams",
    "MultiheadAttention",
    "RotaryPositionEmbedding",
    "TransformerLayer",
    "checkpoint",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "get_cpu_offload_context",
    "get_cudnn_version",
    "get_default_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "make_graphed_callables",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
    "ops",
    "parallel_cross_entropy",
    "optimizers",
    "quantized_model_init",
    "recipe",
    "router",
]
