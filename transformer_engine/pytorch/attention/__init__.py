"""Attention: ``DotProductAttention``, ``MultiheadAttention``, rotary embeddings and the KV cache.

The attention math is the catalog's ``fused_attn_fwd`` / ``fused_attn_bwd`` op (any backend);
:mod:`._masks` and :mod:`._layout` turn TE's mask types, formats and padding into its arguments.
"""

from .dot_product_attention import DotProductAttention
from .inference import InferenceParams, KVCacheManager, NonPagedKVCacheManager, PagedKVCacheManager
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = [
    "DotProductAttention",
    "InferenceParams",
    "KVCacheManager",
    "MultiheadAttention",
    "NonPagedKVCacheManager",
    "PagedKVCacheManager",
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
]
