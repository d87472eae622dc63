"""Flax ``DotProductAttention`` and ``MultiHeadAttention``.

``DotProductAttention`` has no parameters (except ``softmax_offset`` (1, h, 1, 1) for the learnable
softmax) and runs ``transformer_engine.jax.attention.fused_attn``. Masks use TE's convention:
**1 / True = masked out**, shape [b, 1, sq, skv]; the mask is ignored for "no_mask" and "causal".

``MultiHeadAttention`` = (LayerNorm +) QKV projection, optional rotary embedding, attention and the
output projection ``out``. Its submodules: ``qkv`` (LayerNormDenseGeneral, features (3, h*d)) for
self-attention without GQA when ``fuse_qkv_params``; otherwise ``query`` (LayerNormDenseGeneral) and
``kv`` (DenseGeneral, features (2, g*d)), or ``query``/``key``/``value`` without fused params.
By default (T5X convention) the logits are not scaled (``scale_attn_logits=False``) and the query
kernel's initial values are divided by sqrt(head_dim) instead (``scaled_query_init=True``).
"""

from __future__ import annotations

import warnings
from math import sqrt
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..attention import (
    AttnSoftmaxType,
    CPStrategy,
    QKVLayout,
    canonicalize_attn_bias_type,
    canonicalize_attn_mask_type,
    canonicalize_qkv_layout,
    canonicalize_softmax_type,
    fused_attn,
)
from ..sharding import (
    BATCH_AXES,
    HEAD_AXES,
    HIDDEN_AXES,
    HIDDEN_TP_AXES,
    SEQLEN_AXES,
    SEQLEN_TP_AXES,
    W_FSDP_AXES,
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    W_TP_AXES,
    with_sharding_constraint_by_logical_axes,
)
from ._base import Initializer, stacked_init
from ._rotary import rotary_pos_emb
from .dense import DenseGeneral, LayerNormDenseGeneral

__all__ = ["DotProductAttention", "MultiHeadAttention"]


def _batch_first(x: Optional[jax.Array], transpose: bool) -> Optional[jax.Array]:
    """(s, b, ...) <-> (b, s, ...) when ``transpose``."""
    return x if (x is None or not transpose) else jnp.swapaxes(x, 0, 1)


class DotProductAttention(nn.Module):
    """Attention of (b, s, h, d) query, key and value: softmax(scale * q k^T [+ bias], mask) v.

    Attributes:
        head_dim, num_attention_heads: sizes; num_gqa_groups: kv heads (None = num_attention_heads).
        attention_dropout: dropout on the probabilities (rng ``dropout_rng_name``).
        attn_mask_type: "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right", ...
        attn_bias_type: None = "post_scale_bias" if a bias is passed, else "no_bias".
        dtype: deprecated, unused. float32_logits: the logits are always float32 here.
        qkv_layout: "bshd_bshd_bshd", "bshd_bs2hd" (key holds packed kv), "bs3hd" (query holds
            packed qkv), or the "thd" layouts with a SequenceDescriptor of segment ids.
        scale_factor: None = 1/sqrt(head_dim).
        transpose_batch_sequence: inputs are (s, b, ...); None warns and means False.
        window_size: (left, right) sliding window. max_segments_per_seq: accepted.
        context_parallel_*: must keep their defaults. context_checkpoint_name: checkpoint name.
        softmax_type: "vanilla", "off_by_one" or "learnable" (creates param ``softmax_offset``).
        score_mod, score_mod_bprop: must be None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> dpa = DotProductAttention(head_dim=4, num_attention_heads=2, transpose_batch_sequence=False)
        >>> q = jnp.ones((1, 3, 2, 4))
        >>> dpa.apply({}, q, q, q, deterministic=True).shape
        (1, 3, 2, 4)
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: Optional[float] = None
    transpose_batch_sequence: Optional[bool] = None
    window_size: Optional[Tuple[int, int]] = None
    max_segments_per_seq: int = 1
    context_parallel_strategy: str = "DEFAULT"
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_checkpoint_name: str = "context"
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None

    def _transpose(self) -> bool:
        if self.transpose_batch_sequence is None:
            warnings.warn(
                "DotProductAttention: transpose_batch_sequence=None means False (inputs are [b, s, h, d]); "
                "set it explicitly", UserWarning, stacklevel=3,
            )
            return False
        return self.transpose_batch_sequence

    def _softmax_offset(self, softmax_type: AttnSoftmaxType):
        if softmax_type != AttnSoftmaxType.LEARNABLE_SOFTMAX:
            return None
        shape = (1, self.num_attention_heads, 1, 1)
        return self.param("softmax_offset", nn.initializers.zeros, shape, jnp.float32)

    @nn.compact
    def __call__(self, query, key, value, sequence_descriptor=None, bias=None, *, deterministic: bool = False,
                 mask=None, score_mod_tensors=None, score_mod_bprop_tensors=None):
        """Returns the context (b, s, h, d) (or (s, b, h, d) when transposed) in query's dtype."""
        if self.score_mod is not None or self.score_mod_bprop is not None or score_mod_tensors is not None:
            raise NotImplementedError("DotProductAttention: score_mod is not implemented; pass None")
        del score_mod_bprop_tensors
        sequence_descriptor = mask if sequence_descriptor is None else sequence_descriptor
        transpose = self._transpose()
        layout = canonicalize_qkv_layout(self.qkv_layout)
        softmax_type = canonicalize_softmax_type(self.softmax_type)
        bias_type = self.attn_bias_type or ("post_scale_bias" if bias is not None else "no_bias")
        arrays = (query, key, value)[: layout.n_tensors()]
        qkv = tuple(_batch_first(a, transpose) for a in arrays)
        use_dropout = not deterministic and self.attention_dropout > 0.0
        out = fused_attn(
            qkv, bias, sequence_descriptor, self.make_rng(self.dropout_rng_name) if use_dropout else None,
            canonicalize_attn_bias_type(bias_type), canonicalize_attn_mask_type(self.attn_mask_type), layout,
            softmax_type, 1.0 / sqrt(self.head_dim) if self.scale_factor is None else self.scale_factor,
            self.attention_dropout, not deterministic, window_size=self.window_size,
            context_parallel_strategy=_cp_strategy(self.context_parallel_strategy),
            context_parallel_causal_load_balanced=self.context_parallel_causal_load_balanced,
            context_parallel_axis=self.context_parallel_axis, context_checkpoint_name=self.context_checkpoint_name,
            softmax_offset=self._softmax_offset(softmax_type),
        )
        return _batch_first(out, transpose)


def _cp_strategy(name) -> CPStrategy:
    return name if isinstance(name, CPStrategy) else CPStrategy[str(name).upper()]


def _split_init(first_init: Initializer, rest_init: Initializer, n: int) -> Initializer:
    """Initializer of a (hidden, n, width) kernel: slice 0 from ``first_init``, the others from ``rest_init``."""
    first = stacked_init(first_init, 1)
    rest = stacked_init(rest_init, n - 1)

    def _init(key, shape, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        return jnp.concatenate([first(k1, shape[:-2] + (1,) + shape[-1:], dtype),
                                rest(k2, shape[:-2] + (n - 1,) + shape[-1:], dtype)], axis=-2)

    return _init


_LORA_SCOPES = ("none", "all", "qkv_proj", "output_proj", "mlp", "exclude_qkv_proj", "exclude_output_proj",
                "exclude_mlp")


def check_lora_scope(scope: str) -> None:
    """Validate ``low_rank_adaptation_scope``; anything but "none" is not implemented.

    Raises:
        ValueError: an unknown scope. NotImplementedError: a scope other than "none".
    """
    if str(scope).lower() not in _LORA_SCOPES:
        raise ValueError(f"low_rank_adaptation_scope must be one of {list(_LORA_SCOPES)}, got {scope!r}")
    if str(scope).lower() != "none":
        raise NotImplementedError("low-rank adaptation (LoRA) is not implemented; use low_rank_adaptation_scope='none'")


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention with a fused input LayerNorm; returns ``(out, ln_out)``.

    Attributes:
        head_dim, num_attention_heads, num_gqa_groups (None = num_attention_heads).
        attention_dropout, dropout_rng_name: attention dropout.
        input_layernorm, layernorm_type, layernorm_epsilon, zero_centered_gamma: the input norm.
        return_layernorm_output: also return the normalized input.
        kernel_init: None = variance_scaling(1.0, "fan_in", "normal"); use_bias, bias_init.
        attn_mask_type ("causal"), attn_bias_type (None = by presence of a bias).
        enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: rotary embedding.
        low_rank_adaptation_scope/dim/alpha: LoRA (only "none" is implemented).
        dtype: parameter dtype. fuse_qkv_params: fused qkv / kv kernels.
        transpose_batch_sequence: inputs are (s, b, hidden); None means False.
        enable_sequence_parallel: shard the sequence outside the GEMMs (sharding only).
        scale_attn_logits (False), scaled_query_init (True): the T5X scaling convention.
        float32_logits, window_size, softmax_type: passed to DotProductAttention.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> mha = MultiHeadAttention(head_dim=4, num_attention_heads=2)
        >>> x = jnp.ones((1, 3, 8))
        >>> variables = mha.init(jax.random.PRNGKey(0), x, x, deterministic=True)
        >>> nn.meta.unbox(variables)["params"]["qkv"]["kernel"].shape
        (8, 3, 8)
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Optional[Initializer] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: Optional[bool] = None
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"

    def _inits(self):
        kernel_init = self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "normal")
        depth = sqrt(self.head_dim) if self.scaled_query_init else 1.0

        def query_init(key, shape, dtype=jnp.float32):
            return kernel_init(key, shape, dtype) / jnp.asarray(depth, dtype)

        return kernel_init, query_init

    def _axes(self, sharded_seq: bool) -> Tuple[Optional[str], Optional[str]]:
        seq = SEQLEN_TP_AXES if sharded_seq else SEQLEN_AXES
        return (seq, BATCH_AXES) if self.transpose_batch_sequence else (BATCH_AXES, seq)

    def _ln_dense(self, features, kernel_init, kernel_axes, bias_axes, return_ln, name):
        return LayerNormDenseGeneral(
            features=features, enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,), kernel_init=kernel_init,
            kernel_axes=kernel_axes, use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=bias_axes,
            return_layernorm_output=return_ln, dtype=self.dtype,
            layernorm_input_axes=(*self._axes(self.enable_sequence_parallel), HIDDEN_AXES),
            dot_input_axes=(*self._axes(sharded_seq=False), HIDDEN_AXES),
            transpose_batch_sequence=bool(self.transpose_batch_sequence), name=name,
        )

    def _dense(self, features, kernel_init, kernel_axes, bias_axes, name):
        return DenseGeneral(
            features=features, kernel_init=kernel_init, kernel_axes=kernel_axes, use_bias=self.use_bias,
            bias_init=self.bias_init, bias_axes=bias_axes, dtype=self.dtype,
            transpose_batch_sequence=bool(self.transpose_batch_sequence), name=name,
        )

    def _project(self, inputs_q, inputs_kv):
        """Returns (q, k, v) each (.., s, heads, head_dim) and ln_out."""
        h, g, d = self.num_attention_heads, self.num_gqa_groups or self.num_attention_heads, self.head_dim
        kernel_init, query_init = self._inits()
        is_self_attn = inputs_q is inputs_kv
        joined_axes, joined_bias = (W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES), (W_JOINED_AXES, W_TP_AXES)
        if self.fuse_qkv_params and is_self_attn and h == g:
            qkv, ln_out = self._ln_dense((3, h * d), _split_init(query_init, kernel_init, 3), joined_axes,
                                         joined_bias, self.return_layernorm_output, "qkv")(inputs_q)
            qkv = checkpoint_name(qkv, "combined_qkv_proj")
            return tuple(qkv[..., i, :].reshape(qkv.shape[:-2] + (h, d)) for i in range(3)), ln_out
        query, ln_out = self._ln_dense(h * d, query_init, (W_FSDP_AXES, W_TP_AXES), (W_TP_AXES,),
                                       self.return_layernorm_output or is_self_attn, "query")(inputs_q)
        inputs_kv = ln_out if is_self_attn else inputs_kv
        if self.fuse_qkv_params:
            kv = self._dense((2, g * d), stacked_init(kernel_init, 2), joined_axes, joined_bias, "kv")(inputs_kv)
            key, value = kv[..., 0, :], kv[..., 1, :]
        else:
            key = self._dense(g * d, kernel_init, (W_FSDP_AXES, W_TP_AXES), (W_TP_AXES,), "key")(inputs_kv)
            value = self._dense(g * d, kernel_init, (W_FSDP_AXES, W_TP_AXES), (W_TP_AXES,), "value")(inputs_kv)
        ln_out = ln_out if self.return_layernorm_output else None
        split = lambda x, n: x.reshape(x.shape[:-1] + (n, d))  # noqa: E731
        return (split(query, h), split(key, g), split(value, g)), ln_out

    def _decode(self, key, value, mask, bias):
        """Autoregressive cache: write k/v at ``cache_index``; mask the unwritten positions.

        Returns (key, value, mask, bias, stepping): while stepping, causality comes from the cache
        index (a padding-type mask) and the bias is the row of the current position.
        """
        seq_axis = 0 if self.transpose_batch_sequence else 1
        is_initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if not is_initialized:
            return key, value, mask, bias, False
        length, index = cached_key.value.shape[seq_axis], cache_index.value
        one_hot = jax.nn.one_hot(index, length, dtype=key.dtype)
        one_hot = one_hot.reshape((length, 1, 1, 1) if seq_axis == 0 else (1, length, 1, 1))
        key = cached_key.value + key * one_hot
        value = cached_value.value + value * one_hot
        cached_key.value, cached_value.value = key, value
        cache_index.value = index + 1
        unwritten = jnp.broadcast_to(jnp.arange(length) > index, (key.shape[1 - seq_axis], 1, 1, length))
        mask = unwritten if mask is None else (mask.astype(bool) | unwritten)
        if bias is not None:
            bias = jax.lax.dynamic_slice_in_dim(bias, index, 1, axis=-2)
        return key, value, mask, bias, True

    @nn.compact
    def __call__(self, inputs_q, inputs_kv, mask=None, bias=None, *, decode: bool = False,
                 deterministic: bool = False):
        """Returns ``(out, ln_out)``: out has inputs_q's shape and dtype."""
        check_lora_scope(self.low_rank_adaptation_scope)
        h, g = self.num_attention_heads, self.num_gqa_groups or self.num_attention_heads
        if h % g:
            raise ValueError(f"MultiHeadAttention: num_attention_heads={h} must be a multiple of num_gqa_groups={g}")
        leading = self._axes(sharded_seq=False)
        (query, key, value), ln_out = self._project(inputs_q, inputs_kv)
        if self.enable_rotary_pos_emb:
            rope = lambda x: rotary_pos_emb(x, self.rotary_pos_emb_windows, bool(self.transpose_batch_sequence),  # noqa: E731
                                            self.rotary_pos_emb_group_method)
            query, key = rope(query), rope(key)
        mask_type = self.attn_mask_type
        if decode:
            key, value, mask, bias, stepping = self._decode(key, value, mask, bias)
            mask_type = "padding" if stepping else mask_type
        qkv_axes = (*leading, HEAD_AXES, HIDDEN_AXES)
        query, key, value = (with_sharding_constraint_by_logical_axes(t, qkv_axes) for t in (query, key, value))
        x = DotProductAttention(
            head_dim=self.head_dim, num_attention_heads=h, num_gqa_groups=g, attn_mask_type=mask_type,
            attn_bias_type=self.attn_bias_type, attention_dropout=self.attention_dropout,
            dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
            qkv_layout=QKVLayout.BSHD_BSHD_BSHD.name, window_size=self.window_size, softmax_type=self.softmax_type,
            scale_factor=1.0 / sqrt(self.head_dim) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=bool(self.transpose_batch_sequence),
        )(query, key, value, mask, bias, deterministic=deterministic)
        x = x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],))
        x = with_sharding_constraint_by_logical_axes(x, (*leading, HIDDEN_TP_AXES))
        kernel_init, _ = self._inits()
        out = self._dense(inputs_q.shape[-1], kernel_init, (W_TP_AXES, W_FSDP_AXES), (W_NO_SHARD_AXES,), "out")(x)
        return checkpoint_name(out, "out_proj"), ln_out
