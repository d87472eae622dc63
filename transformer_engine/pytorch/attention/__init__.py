"""Attention: ``DotProductAttention``, ``MultiheadAttention``, rotary embeddings and the KV cache.

The attention math is the catalog's ``fused_attn_fwd`` / ``fused_attn_bwd`` op (any backend);
:mod:`._masks` and :mod:`._layout` turn TE's mask types, formats and padding into its arguments.

Also public for the rest of ``transformer_engine.pytorch`` (the private modules stay private): the
head-count checks that ``TransformerLayer`` shares (:func:`check_heads`, :func:`head_size`,
:func:`check_kv_channels`) and TE's attention mask types (:data:`ATTN_MASK_TYPES`, ``constants.AttnMaskTypes``).
"""

from ._checks import check_heads, check_kv_channels, head_size
from ._masks import ATTN_MASK_TYPES
from .dot_product_attention import DotProductAttention
from .inference import InferenceParams, KVCacheManager, NonPagedKVCacheManager, PagedKVCacheManager
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = [
    "ATTN_MASK_TYPES",
    "DotProductAttention",
    "InferenceParams",
    "KVCacheManager",
    "MultiheadAttention",
    "NonPagedKVCacheManager",
    "PagedKVCacheManager",
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
    "check_heads",
    "check_kv_channels",
    "head_size",
]
