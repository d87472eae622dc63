"""``transformer_engine.pytorch.constants``: the names of NVIDIA TE's module of that name that user code reads.

The dtype maps between torch and TE's ``DType``, the block sizes of the block-scaled formats, and the
accepted values of the attention and linear options (each defined where it is used; gathered here).
"""

import torch.distributed

from ..plugin.catalog.attention import BIAS_TYPES as AttnBiasTypes
from .attention import ATTN_MASK_TYPES as AttnMaskTypes
from .quantization.mxfp8_tensor import MXFP8_BLOCK as MXFP8_BLOCK_SCALING_SIZE
from .tensor.dtype import TE_DType, TE_DType_To_Torch

__all__ = [
    "AttnBiasTypes", "AttnMaskTypes", "AttnTypes", "GemmParallelModes", "LayerTypes", "MXFP8_BLOCK_SCALING_SIZE",
    "NVFP4_BLOCK_SCALING_SIZE", "TE_DType", "TE_DType_To_Torch", "dist_group_type",
]

AttnTypes = ("self", "cross")
LayerTypes = ("encoder", "decoder")
GemmParallelModes = ("row", "column", None)
#: elements per NVFP4 block along a row (the recipe does not run yet)
NVFP4_BLOCK_SCALING_SIZE = 16
dist_group_type = torch.distributed.ProcessGroup
