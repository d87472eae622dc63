"""TransformerLayer: attention block + MLP block with residuals, TE's layer (GPT, BERT, T5, Falcon styles).

Dataflow (BDA(y, b, r) = r + drop_path(dropout(y + b)), dropout p = ``hidden_dropout``):

    h   = BDA(attn(LN(x)), b_proj, x)                    self-attention
    h   = BDA(cross_attn(LN(h), enc), b_proj, h)          decoder only (``layer_type="decoder"``)
    out = BDA(MLP(LN(h)), b_fc2, h)
    out = LN(out)                                         only with ``output_layernorm`` (BERT)

- ``parallel_attention_mlp`` (Falcon): out = x + dropout(attn(LN(x)) + MLP(LN'(x))), both from x;
- ``apply_residual_connection_post_layernorm``: each residual is the block's norm output instead;
- ``output_layernorm``: no input norms; the norm is applied to the output.

The blocks are TE modules (``MultiheadAttention`` and ``LayerNormMLP``), so every GEMM runs in FP8
under ``te.autocast``; dropout runs on the catalog's dropout ops.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from ._dropout import bias_dropout_add
from .attention import MultiheadAttention, check_heads, head_size
from ._checks import check_eps, check_probability, check_sizes
from .module import LayerNorm, LayerNormMLP, RMSNorm
from .module.base import default_device, resolve_params_dtype
from .parallel.tensor_parallel import resolve_tp_size, set_tensor_parallel_group

__all__ = ["DropPath", "TransformerLayer"]

_LAYER_TYPES = ("encoder", "decoder")


class DropPath(torch.nn.Module):
    """Stochastic depth: zero the whole sample with probability ``drop_prob``, scale the rest by 1 / keep.

    As TE, a "sample" is an index of the first dimension (a sequence position for "sbhd" inputs).
    """

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        check_probability("TransformerLayer", "drop_path_rate", drop_prob)
        self.drop_prob = drop_prob

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        """x / keep * floor(keep + U[0, 1)) per index of dim 0 (identity in eval or for rate 0).

        Rate 1 drops every sample in training: the branch contributes zeros (still in the graph, so its
        parameters get zero gradients). TE accepts rate 1 too, but its x / 0 * 0 gives NaN.
        """
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        if self.drop_prob >= 1.0:
            return hidden_state * 0.0
        keep = 1.0 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        mask = torch.floor(keep + torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device))
        return hidden_state / keep * mask


def _check_sizes(hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, kv_channels, tp_size) -> int:
    """Sizes and head counts (see attention/_checks.py for the rules); returns the head size."""
    check_sizes("TransformerLayer", hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
    check_heads("TransformerLayer", num_attention_heads, num_gqa_groups, tp_size)
    return head_size("TransformerLayer", hidden_size, num_attention_heads, kv_channels)


def _check_rates(layernorm_epsilon, hidden_dropout, attention_dropout, drop_path_rate) -> None:
    check_eps("TransformerLayer", layernorm_epsilon, "layernorm_epsilon")
    for name, p in (("hidden_dropout", hidden_dropout), ("attention_dropout", attention_dropout), ("drop_path_rate", drop_path_rate)):
        check_probability("TransformerLayer", name, p)


def _check_layer(layer_type, parallel_attention_mlp, post_ln_residual, output_layernorm, fuse_qkv_params, fuse_wgrad) -> None:
    if layer_type not in _LAYER_TYPES:
        raise ValueError(f"layer_type={layer_type!r} must be 'encoder' or 'decoder'")
    if parallel_attention_mlp and (layer_type != "encoder" or post_ln_residual or output_layernorm):
        raise ValueError(
            "parallel_attention_mlp=True needs layer_type='encoder', apply_residual_connection_post_layernorm=False "
            "and output_layernorm=False"
        )
    if fuse_wgrad and not fuse_qkv_params:
        raise ValueError("fuse_wgrad_accumulation=True needs fuse_qkv_params=True (a single QKV weight)")


class TransformerLayer(torch.nn.Module):
    """One transformer layer (see the module docstring), TE 2.x's ``TransformerLayer``.

    Args: TE's, in TE's order and with TE's defaults (``hidden_dropout`` = ``attention_dropout`` = 0.1,
    ``self_attn_mask_type`` "causal", ``activation`` "gelu" (tanh), ``attn_input_format`` "sbhd").
    Submodules: ``self_attention``, ``inter_attention`` (decoder), ``layernorm_mlp`` and
    ``layernorm`` (with ``output_layernorm``); parameter names follow TE's (e.g.
    ``self_attention.layernorm_qkv.query_weight``, ``layernorm_mlp.fc1_weight``).
    ``ub_tp_comm_overlap=True`` pipelines the sequence-parallel collectives with the GEMMs next to them
    (``ub_overlap_ag``, ``ub_overlap_rs`` and ``ub_bulk_wgrad`` on by default; see ``Linear``).

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
        >>> layer(torch.randn(6, 2, 32)).shape
        torch.Size([6, 2, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        tp_group=None,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        normalization: str = "LayerNorm",
        device: Union[torch.device, str, None] = None,
        attn_input_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        tp_size = resolve_tp_size(tp_group, tp_size)  # the group's size wins (TE's rule)
        head_dim = _check_sizes(hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, kv_channels, tp_size)
        _check_rates(layernorm_epsilon, hidden_dropout, attention_dropout, drop_path_rate)
        _check_layer(layer_type, parallel_attention_mlp, apply_residual_connection_post_layernorm, output_layernorm,
                     fuse_qkv_params, fuse_wgrad_accumulation)
        super().__init__()
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.enc_dec_attn_mask_type, self.enc_dec_window_size = enc_dec_attn_mask_type, enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.layer_number, self.layer_type = layer_number, layer_type
        self.output_layernorm, self.parallel_attention_mlp = output_layernorm, parallel_attention_mlp
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.hidden_dropout, self.attn_input_format, self.name = hidden_dropout, attn_input_format, name
        self.kv_channels = head_dim
        self.tp_size, self.seq_length, self.get_rng_state_tracker = tp_size, seq_length, get_rng_state_tracker
        self.sequence_parallel = tp_size > 1 and sequence_parallel
        params_dtype = resolve_params_dtype(params_dtype, None)
        device = default_device(device)
        ub = ub_tp_comm_overlap
        attention_args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout, layernorm_epsilon,
                          init_method, output_layer_init_method)
        common = dict(
            layer_number=layer_number, tp_group=tp_group, tp_size=tp_size, num_gqa_groups=num_gqa_groups,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, get_rng_state_tracker=get_rng_state_tracker,
            sequence_parallel=self.sequence_parallel, params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm, set_parallel_mode=set_parallel_mode,
            fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved, rotary_pos_interleaved=rotary_pos_interleaved,
            ub_overlap_ag=ub and ub_overlap_ag, ub_overlap_rs=ub and ub_overlap_rs,
            ub_overlap_rs_dgrad=ub and ub_overlap_rs_dgrad, ub_bulk_dgrad=ub and ub_bulk_dgrad,
            ub_bulk_wgrad=ub and ub_bulk_wgrad, qkv_format=attn_input_format, bias=bias, normalization=normalization,
            device=device, qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope,
            softmax_type=softmax_type, seq_length=seq_length, micro_batch_size=micro_batch_size,
        )
        self.self_attention = MultiheadAttention(
            *attention_args, **common, attn_mask_type=self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, input_layernorm=not output_layernorm, attention_type="self",
            return_bias=not parallel_attention_mlp, name=None if name is None else name + ".self_attention",
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args, **common, attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal, input_layernorm=True, attention_type="cross",
                return_bias=True, name=None if name is None else name + ".inter_attention",
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
            return_bias=not parallel_attention_mlp, get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group,
            tp_size=tp_size, init_method=init_method, bias=bias, normalization=normalization, activation=activation,
            activation_params=activation_params, output_layer_init_method=output_layer_init_method,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm, seq_length=seq_length,
            micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, device=device, ub_overlap_ag=ub and ub_overlap_ag,
            ub_overlap_rs=ub and ub_overlap_rs, ub_overlap_rs_dgrad=ub and ub_overlap_rs_dgrad,
            ub_bulk_wgrad=ub and ub_bulk_wgrad, name=None if name is None else name + ".layernorm_mlp",
        )
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                                  sequence_parallel=self.sequence_parallel, dtype=params_dtype, device=device)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel group of every TE module inside (TE's method)."""
        set_tensor_parallel_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split the sequence of the attention blocks over ``cp_group`` (TE's method; see
        ``DotProductAttention.set_context_parallel_group``). The caller feeds each rank its load-balanced
        part of the sequence (chunks r and 2P-1-r of 2P); every other part of the layer is token-wise."""
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _bda(self, out, bias, residual, drop_path=None):
        return bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training, drop_path)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask=None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
    ) -> torch.Tensor:
        """The layer's output, same shape as ``hidden_states`` (TE's arguments; None means the init value).

        Raises:
            TypeError: a non-bool attention mask.
            ValueError: from the blocks (shapes, masks, formats; named in the message).
        """
        _check_bool_masks(attention_mask, enc_dec_attn_mask)
        x = hidden_states.contiguous()
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        shared = dict(is_first_microbatch=is_first_microbatch, checkpoint_core_attention=checkpoint_core_attention,
                      core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                      alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill)
        attn = self.self_attention(
            x, attention_mask=attention_mask, attn_mask_type=_pick(self_attn_mask_type, self.self_attn_mask_type),
            window_size=_pick(window_size, self.window_size),
                                   bottom_right_diagonal=_pick(bottom_right_diagonal, self.bottom_right_diagonal),
            inference_params=inference_params, rotary_pos_emb=rotary_pos_emb, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, pad_between_seqs=pad_between_seqs, **shared,
        )
        h = x
        if not self.parallel_attention_mlp:
            h = self._residual_block(attn, x, self.drop_path)
        if self.layer_type == "decoder":
            cross = self.inter_attention(
                h, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                attn_mask_type=_pick(enc_dec_attn_mask_type, self.enc_dec_attn_mask_type),
                window_size=_pick(enc_dec_window_size, self.enc_dec_window_size),
                bottom_right_diagonal=_pick(enc_dec_bottom_right_diagonal, self.enc_dec_bottom_right_diagonal), **shared,
            )
            h = self._residual_block(cross, h)
        mlp = self.layernorm_mlp(h, is_first_microbatch=is_first_microbatch)
        if self.parallel_attention_mlp:
            out = self._bda(attn, mlp, x, self.drop_path)  # x + dropout(attn + mlp)
        else:
            out = self._residual_block(mlp, h, self.drop_path)
        return self.layernorm(out) if self.output_layernorm else out

    def _residual_block(self, outputs, residual, drop_path=None):
        """BDA of a block's (out, bias[, norm output]): the residual is the norm output when the block returns it."""
        if len(outputs) == 3:
            out, bias, residual = outputs
        else:
            out, bias = outputs
        return self._bda(out, bias, residual, drop_path)


def _pick(value, default):
    return default if value is None else value


def _check_bool_masks(*masks) -> None:
    for mask in masks:
        for m in mask if isinstance(mask, (tuple, list)) else (mask,):
            if m is not None and m.dtype != torch.bool:
                raise TypeError(f"attention masks must be bool tensors (True = masked out), got {m.dtype}")
