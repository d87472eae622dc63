"""The TE modules: ``Linear``, ``LayerNorm``, ``RMSNorm``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``.

Each fused module runs one ``torch.autograd.Function`` whose forward and backward call catalog ops
(``transformer_engine.plugin.ops``) only; the active ``autocast`` recipe picks the quantizers.
"""

from .base import TransformerEngineBaseModule
from .fp8_padding import Fp8Padding, Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .rmsnorm import RMSNorm

__all__ = ["Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm",
           "TransformerEngineBaseModule"]
