"""MultiheadAttention: QKV projection (optionally with the input norm), RoPE, q/k norm, core attention, projection.

    q, k, v = split(W_qkv norm(x))         self-attention (k, v from the encoder output for cross)
    q, k    = qk_norm(rope(q, k))           (or rope(qk_norm(q, k)) with qk_norm_before_rope)
    out     = proj(DotProductAttention(q, k, v))

Submodule and parameter names are TE's (``layernorm_qkv`` / ``qkv``, ``layernorm_query`` /
``query_layer`` and ``key_value`` for cross-attention, ``core_attention``, ``proj``, ``q_norm`` /
``k_norm``); the QKV GEMMs and the projection are TE ``Linear`` / ``LayerNormLinear`` modules, so they
run in FP8 under ``te.autocast`` while the attention itself stays in high precision.

Fused QKV layout (``fuse_qkv_params=True``): with ``qkv_weight_interleaved`` the output features are
grouped per kv head, [ng, (np/ng + 2), hn] (np/ng query heads, then k, then v of that group);
otherwise they are [Q; K; V], [(np/ng + 2), ng, hn], as ``torch.nn.MultiheadAttention.in_proj_weight``;
column-parallel, each rank then holds [Q_r; K_r; V_r] of that weight (``partition_sections``).
With ``fuse_qkv_params=False`` the weights are ``query_weight`` / ``key_weight`` / ``value_weight``
and the layout is [Q; K; V].
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Tuple, Union

import torch

from ..module import LayerNorm, LayerNormLinear, Linear, RMSNorm
from .._checks import check_eps
from ..module.base import default_device, resolve_params_dtype
from ..parallel.tensor_parallel import resolve_tp_size, set_partition_sections, set_tensor_parallel_group, sum_grads_over_group
from ._checks import check_heads, head_size
from .context_parallel import CPGroup, check_cp_group
from .dot_product_attention import DotProductAttention
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention"]

_QK_NORM_TYPES = (None, "L2Normalization", "RMSNorm", "LayerNorm")


class _L2Normalization(torch.nn.Module):
    """y = x / sqrt(sum_i x_i^2 + eps) over the last dim (parameter-free; TE's ``ops.L2Normalization``)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().sum(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


def _qk_norms(qk_norm_type: Optional[str], eps: float, head_dim: int, dtype, device):
    """(q_norm, k_norm) modules for ``qk_norm_type`` (one shared, parameter-free module for L2)."""
    if qk_norm_type not in _QK_NORM_TYPES:
        raise ValueError(f"qk_norm_type={qk_norm_type!r} is not one of {_QK_NORM_TYPES}")
    if qk_norm_type is None:
        return None, None
    if qk_norm_type == "L2Normalization":
        norm = _L2Normalization(eps)
        return norm, norm
    cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
    return cls(head_dim, eps=eps, dtype=dtype, device=device), cls(head_dim, eps=eps, dtype=dtype, device=device)


def _split_heads(mixed: torch.Tensor, groups: Tuple[int, int], sizes: Tuple[int, ...], head_dim: int, dim: int):
    """View ``mixed`` [..., F] as [..., groups[0], groups[1], head_dim], split ``sizes`` along ``dim`` (-3 or -2)
    and flatten each part to [..., heads, head_dim].

    Views and a split of ``mixed`` as 2-D [rows, columns] (a row: one group of ``groups[1]`` heads for ``dim`` -2, all
    of a token's features for -3), with PyTorch's autograd: its split backward then joins the parts' gradients with one
    ``torch.cat`` of 2-D pieces. A split of the 5-D view instead would have autograd write each part by a strided copy
    of its own (torch's fast concatenation kernel takes at most 4 dims): for the fused QKV gradient of the headline
    layer ([8192, 12288] bf16, H200) three copies of 80 us.
    """
    lead = mixed.shape[:-1]
    inner = head_dim if dim == -2 else groups[1] * head_dim  # columns of one unit of ``sizes``
    rows = mixed.view(-1, (groups[1] if dim == -2 else groups[0] * groups[1]) * head_dim)
    pieces = rows.split([size * inner for size in sizes], dim=1)
    if dim == -2:
        return tuple(piece.view(*lead, groups[0], size, head_dim).reshape(*lead, -1, head_dim) for piece, size in zip(pieces, sizes))
    return tuple(piece.view(*lead, size * groups[1], head_dim) for piece, size in zip(pieces, sizes))


class MultiheadAttention(torch.nn.Module):
    """TE's multi-head attention block (self or cross), see the module docstring.

    Args: TE 2.x's ``MultiheadAttention`` arguments, same order and defaults (``attention_dropout``
    0.1, ``attn_mask_type`` "causal", ``qkv_format`` "sbhd"). Tensor-parallel and communication
    overlap arguments are stored (tensor parallelism comes later).

    Forward returns the output, then the projection bias if ``return_bias``, then the input norm's
    output if ``input_layernorm`` and ``return_layernorm_output``.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> mha = te.MultiheadAttention(32, 4, attention_dropout=0.0)
        >>> mha(torch.randn(6, 2, 32)).shape
        torch.Size([6, 2, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        tp_group=None,
        tp_size: int = 1,
        num_gqa_groups: Optional[int] = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        sequence_parallel: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Union[torch.device, str, None] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        softmax_type: str = "vanilla",
    ) -> None:
        tp_size = resolve_tp_size(tp_group, tp_size)  # the group's size wins (TE's rule)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type={attention_type!r} must be 'self' or 'cross'")
        groups = check_heads("MultiheadAttention", num_attention_heads, num_gqa_groups, tp_size)
        head_dim = head_size("MultiheadAttention", hidden_size, num_attention_heads, kv_channels)
        if input_layernorm:
            check_eps("MultiheadAttention", layernorm_epsilon, "layernorm_epsilon")
        if qk_norm_type is not None:
            check_eps("MultiheadAttention", qk_norm_eps, "qk_norm_eps")
        super().__init__()
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm, self.attention_type = input_layernorm, attention_type
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.get_rng_state_tracker, self.tp_group, self.tp_size = get_rng_state_tracker, tp_group, tp_size
        self.sequence_parallel = tp_size > 1 and sequence_parallel
        self.params_dtype = resolve_params_dtype(params_dtype, None)
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.num_attention_heads_per_partition = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = groups // tp_size
        self.hidden_size_per_attention_head = head_dim
        self.hidden_size_q = self.hidden_size_per_attention_head * num_attention_heads
        self.hidden_size_kv = self.hidden_size_per_attention_head * groups
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved, self.qk_norm_before_rope = rotary_pos_interleaved, qk_norm_before_rope
        self.softmax_type, self.name = softmax_type, name
        self.cp_size, self.cp_rank = 1, 0  # set by set_context_parallel_group (rotary positions of this rank's chunks)
        device = default_device(device)
        gemm_kwargs = dict(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
            params_dtype=self.params_dtype, device=device, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )
        norm_kwargs = dict(eps=layernorm_epsilon, zero_centered_gamma=zero_centered_gamma, normalization=normalization,
                           return_layernorm_output=return_layernorm_output)
        self.q_norm, self.k_norm = _qk_norms(qk_norm_type, qk_norm_eps, self.hidden_size_per_attention_head, self.params_dtype, device)
        if tp_size > 1:  # each rank normalizes 1/tp_size of the heads: the norms' gradients are partial sums
            for norm in {self.q_norm, self.k_norm} - {None}:
                sum_grads_over_group(norm, lambda: self.tp_group)
        self._build_projections(hidden_size, init_method, bias, fuse_qkv_params, set_parallel_mode, gemm_kwargs, norm_kwargs)
        self.core_attention = DotProductAttention(
            num_attention_heads, self.hidden_size_per_attention_head, num_gqa_groups=groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type,
            attn_mask_type=attn_mask_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
        )
        self.proj = Linear(
            self.hidden_size_q, hidden_size, init_method=output_layer_init_method, bias=bias, return_bias=return_bias,
            parallel_mode="row" if set_parallel_mode else None, name=None if name is None else name + ".proj", **gemm_kwargs,
        )

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel group of this block and of every TE module inside (TE's method)."""
        set_tensor_parallel_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split the sequence over ``cp_group`` (TE's method): the core attention's setting, and rotary
        embeddings at the positions of this rank's chunks. See ``DotProductAttention.set_context_parallel_group``."""
        check_cp_group(cp_group, cp_global_ranks, cp_comm_type)
        group = None if cp_group is None else CPGroup(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_size, self.cp_rank = (1, 0) if group is None else (group.size, group.rank)
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _build_projections(self, hidden_size, init_method, bias, fuse_qkv_params, set_parallel_mode, gemm_kwargs, norm_kwargs):
        """``layernorm_qkv`` / ``qkv`` (self), or ``layernorm_query`` / ``query_layer`` and ``key_value`` (cross)."""
        common = dict(init_method=init_method, bias=bias, return_bias=False,
                      parallel_mode="column" if set_parallel_mode else None, **gemm_kwargs)
        hq, hkv = self.hidden_size_q, self.hidden_size_kv
        if self.attention_type == "self":
            split = None if fuse_qkv_params else collections.OrderedDict([("query", hq), ("key", hkv), ("value", hkv)])
            sections = (hq, hkv, hkv)
            if self.input_layernorm:
                self.layernorm_qkv = self._fused(LayerNormLinear, sections, hidden_size, hq + 2 * hkv, parameters_split=split,
                                                 **norm_kwargs, **common)
            else:
                self.qkv = self._fused(Linear, sections, hidden_size, hq + 2 * hkv, parameters_split=split, **common)
            return
        if self.input_layernorm:
            split = None if fuse_qkv_params else ("query",)
            self.layernorm_query = LayerNormLinear(hidden_size, hq, parameters_split=split, **norm_kwargs, **common)
        else:
            self.query_layer = Linear(hidden_size, hq, **common)
        split = None if fuse_qkv_params else ("key", "value")
        self.key_value = self._fused(Linear, (hkv, hkv), hidden_size, 2 * hkv, parameters_split=split, **common)

    def _fused(self, cls, sections: Tuple[int, ...], *args, **kwargs):
        """A projection whose output features are ``sections`` (e.g. [Q; K; V]) side by side.

        Column-parallel with one fused [Q; K; V] weight (``fuse_qkv_params`` without interleaving), a rank's
        heads are not one block of it: the rank holds [Q_r; K_r; V_r], so the weight and bias are built on
        "meta", marked with their sections, then initialized (each rank keeps its part of a full-size
        init, drawing the random numbers the unsharded model draws).
        """
        sectioned = kwargs["parameters_split"] is None and not self.qkv_weight_interleaved
        if not (sectioned and kwargs["parallel_mode"] == "column" and self.tp_size > 1):
            return cls(*args, **kwargs)
        device = kwargs["device"]
        module = cls(*args, **{**kwargs, "device": "meta"})
        for param in (module.weight, module.bias):
            if param is not None:
                set_partition_sections(param, sections, self.tp_size)
        module.reset_parameters()
        return module.to(device)

    def _qkv(self, hidden_states, encoder_output, is_first_microbatch):
        """(q [.., np, hn], k [.., ng, hn], v [.., ng, hn], layernorm output or None)."""
        ng, hn = self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        per_group = self.num_attention_heads_per_partition // ng
        ln_out = None
        if self.attention_type == "self":
            mixed = (self.layernorm_qkv if self.input_layernorm else self.qkv)(hidden_states, is_first_microbatch=is_first_microbatch)
            if self.input_layernorm and self.return_layernorm_output:
                mixed, ln_out = mixed
            if self.qkv_weight_interleaved:
                q, k, v = _split_heads(mixed, (ng, per_group + 2), (per_group, 1, 1), hn, dim=-2)
            else:
                q, k, v = _split_heads(mixed, (per_group + 2, ng), (per_group, 1, 1), hn, dim=-3)
            return q, k, v, ln_out
        if encoder_output is None:
            raise ValueError("cross-attention (attention_type='cross') needs encoder_output")
        mixed_kv = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
        if self.qkv_weight_interleaved:
            k, v = _split_heads(mixed_kv, (ng, 2), (1, 1), hn, dim=-2)
        else:
            k, v = _split_heads(mixed_kv, (2, ng), (1, 1), hn, dim=-3)
        query = (self.layernorm_query if self.input_layernorm else self.query_layer)(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.input_layernorm and self.return_layernorm_output:
            query, ln_out = query
        return query.reshape(*query.shape[:-1], -1, hn), k, v, ln_out

    def _rope(self, q, k, rotary_pos_emb, inference_params, cu_seqlens_q, cu_seqlens_kv):
        """q and k rotated by ``rotary_pos_emb`` (one table, or a (q, k) pair) at their positions."""
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        start = inference_params.get_seqlens_pre_step() if inference_params is not None else None
        common = dict(tensor_format=self.qkv_format, fused=True, start_positions=start, interleaved=self.rotary_pos_interleaved,
                      cp_size=self.cp_size, cp_rank=self.cp_rank)
        return (
            apply_rotary_pos_emb(q, q_freqs, cu_seqlens=cu_seqlens_q, **common),
            apply_rotary_pos_emb(k, k_freqs, cu_seqlens=cu_seqlens_kv, **common),
        )

    def _qk_norm(self, q, k):
        return (q, k) if self.q_norm is None else (self.q_norm(q), self.k_norm(k))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
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
    ):
        """Attention block output [s, b, hidden] (sbhd; [b, s, hidden] bshd; [t, hidden] thd), TE's return order.

        Raises:
            ValueError / TypeError: from the projections or the core attention (named in the message).
        """
        if inference_params is not None and self.layer_number not in inference_params.cache_manager.cache:
            inference_params.allocate_memory(self.layer_number)
        q, k, v, ln_out = self._qkv(hidden_states, encoder_output, is_first_microbatch)
        if self.qk_norm_before_rope:
            q, k = self._qk_norm(q, k)
        if rotary_pos_emb is not None:
            padded = bool(pad_between_seqs)
            q, k = self._rope(q, k, rotary_pos_emb, inference_params,
                              cu_seqlens_q_padded if padded else cu_seqlens_q, cu_seqlens_kv_padded if padded else cu_seqlens_kv)
        if not self.qk_norm_before_rope:
            q, k = self._qk_norm(q, k)
        context = self.core_attention(
            q, k, v, attention_mask=attention_mask, qkv_format=self.qkv_format,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
            checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, inference_params=inference_params,
        )
        projected = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = projected if isinstance(projected, tuple) else (projected,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs = outputs + (ln_out,)
        return outputs if len(outputs) > 1 else outputs[0]
