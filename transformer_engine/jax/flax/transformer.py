"""Flax ``TransformerLayer``: a pre-LN encoder or decoder layer (T5X naming), FP8 under autocast.

    encoder:  x = x + dropout(attention(LN(x), relpos_bias))            ("attention")
    decoder:  x = x + dropout(self_attention(LN(x), relpos_bias))       ("self_attention")
              x = x + dropout(encoder_decoder_attention(LN(x), encoded, padding mask))
    both:     x = x + dropout(mlp(x))                                   ("mlp", LayerNormMLP)
              x = output_layernorm(x)                                   (only with output_layernorm)

``apply_residual_connection_post_layernorm`` takes each residual from the LN output instead.
Masks: 1 / True = masked out, shape [b, 1, sq, skv]. With the default dropouts (0.1) a "dropout" rng
is needed unless ``deterministic=True``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

from ..sharding import (
    BATCH_AXES,
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
from ._base import Initializer
from .attention import MultiHeadAttention, check_lora_scope
from .layernorm import LayerNorm
from .mlp import LayerNormMLP
from .relative_position import RelativePositionBiases

__all__ = ["TransformerLayer", "TransformerLayerType"]


class TransformerLayerType(Enum):
    """Encoder (self-attention + MLP) or decoder (adds cross-attention over ``encoded``)."""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):
    """One Transformer layer: attention block(s) and an MLP, with residuals and dropout.

    Attributes (TE's names and defaults):
        hidden_size (512), mlp_hidden_size (2048), num_attention_heads (8), num_gqa_groups (None).
        layernorm_type ("layernorm"), layernorm_epsilon (1e-6), zero_centered_gamma (False).
        hidden_dropout (0.1), hidden_dropout_dims, attention_dropout (0.1), intermediate_dropout (0.0),
            intermediate_dropout_dims, dropout_rng_name ("dropout").
        mha_kernel_init (None = normal fan_in), mlp_kernel_init (None = truncated_normal fan_in).
        mlp_activations (("gelu",)), mlp_activation_params (None), use_bias (False), bias_init (zeros).
        apply_residual_connection_post_layernorm (False), output_layernorm (False).
        float32_attention_logits (False), layer_type (ENCODER), self_attn_mask_type ("causal"),
            self_attn_bias_type (None).
        enable_relative_embedding (True), relative_embedding (None = 32 buckets, max distance 128).
        enable_rotary_pos_emb (False), rotary_pos_emb_windows ((1, 10000)), rotary_pos_emb_group_method.
        low_rank_adaptation_scope ("none"; others are not implemented), _dim, _alpha.
        dtype (parameter dtype, float32), drop_path (0.0), fuse_qkv_params (True),
        transpose_batch_sequence (False), enable_sequence_parallel (False), scale_attn_logits (False),
        scaled_query_init (True), window_size (None), softmax_type ("vanilla").

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2)
        >>> x = jnp.ones((2, 4, 16))
        >>> variables = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
        >>> layer.apply(variables, x, deterministic=True).shape
        (2, 4, 16)
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: Optional[dict] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    relative_embedding: Optional[nn.Module] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"

    def _axes(self, sharded_seq: Optional[bool] = None) -> Tuple[str, str, str]:
        sharded = self.enable_sequence_parallel if sharded_seq is None else sharded_seq
        seq = SEQLEN_TP_AXES if sharded else SEQLEN_AXES
        lead = (seq, BATCH_AXES) if self.transpose_batch_sequence else (BATCH_AXES, seq)
        return (*lead, HIDDEN_AXES)

    def _check(self, inputs, decode: bool) -> None:
        if inputs.ndim != 3:
            raise ValueError(f"TransformerLayer: inputs must be 3-D ([b, s, h] or [s, b, h]), got shape {inputs.shape}")
        if inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerLayer: inputs' last axis {inputs.shape[-1]} != hidden_size={self.hidden_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"TransformerLayer: hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if TransformerLayerType(self.layer_type) == TransformerLayerType.ENCODER and decode:
            raise ValueError("TransformerLayer: decode=True needs layer_type=TransformerLayerType.DECODER")
        check_lora_scope(self.low_rank_adaptation_scope)

    def _relative_bias(self, inputs, decode: bool, max_decode_length):
        if not self.enable_relative_embedding:
            return None
        rel_emb = self.relative_embedding or RelativePositionBiases(
            num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads, dtype=self.dtype,
            embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"), name="relpos_bias",
        )
        length = inputs.shape[0 if self.transpose_batch_sequence else 1]
        bidirectional = TransformerLayerType(self.layer_type) == TransformerLayerType.ENCODER
        if not bidirectional:
            length = max_decode_length if (decode and max_decode_length) else length
        return rel_emb(length, length, bidirectional)  # positional, as NVIDIA TE calls a user's relative_embedding

    def _attention(self, name: str, mask_type: str, bias_type, input_layernorm: bool) -> MultiHeadAttention:
        return MultiHeadAttention(
            head_dim=self.hidden_size // self.num_attention_heads, num_attention_heads=self.num_attention_heads,
            num_gqa_groups=self.num_gqa_groups, attention_dropout=self.attention_dropout,
            dropout_rng_name=self.dropout_rng_name, input_layernorm=input_layernorm,
            layernorm_type=self.layernorm_type, layernorm_epsilon=self.layernorm_epsilon,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            zero_centered_gamma=self.zero_centered_gamma, kernel_init=self.mha_kernel_init,
            use_bias=self.use_bias, bias_init=self.bias_init, attn_mask_type=mask_type, attn_bias_type=bias_type,
            enable_rotary_pos_emb=self.enable_rotary_pos_emb, rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method, dtype=self.dtype,
            fuse_qkv_params=self.fuse_qkv_params, transpose_batch_sequence=self.transpose_batch_sequence,
            enable_sequence_parallel=self.enable_sequence_parallel, scale_attn_logits=self.scale_attn_logits,
            scaled_query_init=self.scaled_query_init, float32_logits=self.float32_attention_logits,
            window_size=self.window_size, softmax_type=self.softmax_type, name=name,
        )

    def _mlp(self) -> LayerNormMLP:
        return LayerNormMLP(
            intermediate_dim=self.mlp_hidden_size, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,),
            kernel_init=self.mlp_kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
            kernel_axes_1=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES), kernel_axes_2=(W_TP_AXES, W_FSDP_AXES),
            use_bias=self.use_bias, bias_init=self.bias_init, bias_axes_1=(W_JOINED_AXES, W_TP_AXES),
            bias_axes_2=(W_NO_SHARD_AXES,), return_layernorm_output=self.apply_residual_connection_post_layernorm,
            activations=self.mlp_activations, activation_params=self.mlp_activation_params,
            intermediate_dropout_rng_name=self.dropout_rng_name, intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=self.intermediate_dropout_dims, dtype=self.dtype,
            layernorm_input_axes=self._axes(), dot_1_input_axes=self._axes(sharded_seq=False),
            dot_2_input_axes=(*self._axes(sharded_seq=False)[:2], HIDDEN_TP_AXES),
            transpose_batch_sequence=self.transpose_batch_sequence, name="mlp",
        )

    def _residual(self, y, residual, ln_out, deterministic: bool, drop_path: bool):
        """residual + dropout(y) (+ drop_path), with the residual taken post-LN when configured."""
        y = with_sharding_constraint_by_logical_axes(y, self._axes())
        y = nn.Dropout(rate=self.hidden_dropout, broadcast_dims=self.hidden_dropout_dims,
                       rng_collection=self.dropout_rng_name)(y, deterministic=deterministic)
        if drop_path and self.drop_path > 0.0:
            batch_dim = 1 if self.transpose_batch_sequence else 0
            dims = tuple(d for d in range(y.ndim) if d != batch_dim)
            y = nn.Dropout(rate=self.drop_path, broadcast_dims=dims,
                           rng_collection=self.dropout_rng_name)(y, deterministic=deterministic)
        if self.apply_residual_connection_post_layernorm:
            residual = ln_out
        return y + with_sharding_constraint_by_logical_axes(residual, self._axes())

    @nn.compact
    def __call__(self, inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
                 deterministic: bool = False, decode: bool = False, max_decode_length: Optional[int] = None):
        """Returns the layer output with the inputs' shape and dtype."""
        self._check(inputs, decode)
        is_decoder = TransformerLayerType(self.layer_type) == TransformerLayerType.DECODER
        attn_bias = self._relative_bias(inputs, decode, max_decode_length)
        x = with_sharding_constraint_by_logical_axes(inputs, self._axes())
        y, ln_out = self._attention("self_attention" if is_decoder else "attention", self.self_attn_mask_type,
                                    self.self_attn_bias_type, not self.output_layernorm)(
            x, x, attention_mask, attn_bias, deterministic=deterministic, decode=decode)
        x = self._residual(y, x, ln_out, deterministic, drop_path=True)
        if is_decoder:
            if encoded is None:
                raise ValueError("TransformerLayer: a DECODER layer needs `encoded` (the encoder output)")
            y, ln_out = self._attention("encoder_decoder_attention", "padding", "no_bias", input_layernorm=True)(
                x, encoded, encoder_decoder_mask, deterministic=deterministic)
            x = self._residual(y, x, ln_out, deterministic, drop_path=False)
        y, ln_out = self._mlp()(x, deterministic=deterministic)
        z = self._residual(y, x, ln_out, deterministic, drop_path=True)
        if self.output_layernorm:
            z = LayerNorm(layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
                          epsilon=self.layernorm_epsilon, scale_axes=(W_NO_SHARD_AXES,),
                          bias_axes=(W_NO_SHARD_AXES,), transpose_batch_sequence=self.transpose_batch_sequence,
                          dtype=self.dtype, name="output_layernorm")(z)
        return z
