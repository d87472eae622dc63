"""Flax (linen) modules of Transformer Engine: the same names, fields and defaults as NVIDIA TE.

``dtype`` is the parameter dtype everywhere; the computation runs in the input's dtype, and FP8
is switched on by ``transformer_engine.jax.autocast``. Masks: 1 / True = masked out.
"""

from ..sharding import extend_logical_axis_rules
from .attention import DotProductAttention, MultiHeadAttention
from .dense import DenseGeneral, LayerNormDenseGeneral
from .layernorm import LayerNorm
from .mlp import LayerNormMLP
from .relative_position import RelativePositionBiases
from .state_module import make_dot_general_cls, make_grouped_dense_cls, wrap_function_in_te_state_module
from .transformer import TransformerLayer, TransformerLayerType

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "extend_logical_axis_rules",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]
