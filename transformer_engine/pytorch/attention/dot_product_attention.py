"""DotProductAttention: TE's core attention module on the catalog's ``fused_attn_fwd`` / ``fused_attn_bwd``.

For each batch entry and query head n (kv head n // (h / h_kv) under GQA / MQA):

    O = dropout(softmax(softmax_scale * Q K^T + bias, masked)) V

with the mask, window, bias and softmax variants of ``plugin/catalog/attention.py``. The module
normalises TE's arguments (formats sbhd / bshd / thd, mask types, padding masks, windows, ALiBi,
KV caching) into one ``AttentionConfig`` call (see :mod:`._masks` and :mod:`._layout`); one
autograd Function runs the forward op on whichever backend the dispatcher picks and the backward
op through the dispatcher too: only the backend that made the forward's opaque context accepts it
(every other one declines it, see ``fused_attn_bwd`` in the catalog), whatever the policy says when
the backward runs. A call that PyTorch's SDPA expresses runs as SDPA with PyTorch's autograd where the
policy's first choice is SDPA's kernels (vendor.cuda) or torch.compile traces it (see ``_attend``).
Under an autocast whose recipe sets ``fp8_dpa`` (DelayedScaling), the attention runs in FP8 instead (see
:mod:`.fp8_attention`), for the calls FP8 attention implements; any other call under it raises NotImplementedError.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch

from transformer_engine.plugin import ops, runs_as_aten
from transformer_engine.plugin.catalog.attention import AttentionConfig

from ..distributed import checkpoint
from ..module.base import default_device
from .._checks import check_probability
from . import _layout, _masks
from . import context_parallel as _cp
from ._checks import check_heads, check_kv_channels
from .fp8_attention import FP8AttentionState, fp8_attention

__all__ = ["DotProductAttention"]

_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


@dataclass(frozen=True, eq=False)
class _Extras:
    """The non-differentiable tensors of one op call (see ``fused_attn_fwd``)."""

    attn_mask: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None


class _FusedAttnFunc(torch.autograd.Function):
    """O = fused_attn_fwd(q, k, v, ...); the backward's fused_attn_bwd reaches the forward's backend, the only
    one that accepts the forward's context."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, softmax_offset, extras: _Extras, config: AttentionConfig):
        out, attn_ctx = ops.fused_attn_fwd(
            q, k, v, config=config, attn_mask=extras.attn_mask, attn_bias=attn_bias, softmax_offset=softmax_offset,
            alibi_slopes=extras.alibi_slopes, cu_seqlens_q=extras.cu_seqlens_q, cu_seqlens_kv=extras.cu_seqlens_kv,
        )
        ctx.save_for_backward(q, k, v, out, attn_bias, softmax_offset)
        ctx.extras, ctx.config, ctx.attn_ctx = extras, config, attn_ctx
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, attn_bias, softmax_offset = ctx.saved_tensors
        extras = ctx.extras
        dq, dk, dv, dbias, doffset = ops.fused_attn_bwd(
            dout, q=q, k=k, v=v, out=out, ctx=ctx.attn_ctx, config=ctx.config,  # backends take any strides
            attn_mask=extras.attn_mask, attn_bias=attn_bias, softmax_offset=softmax_offset, alibi_slopes=extras.alibi_slopes,
            cu_seqlens_q=extras.cu_seqlens_q, cu_seqlens_kv=extras.cu_seqlens_kv,
        )
        needs = ctx.needs_input_grad
        return dq, dk, dv, dbias if needs[3] else None, doffset if needs[4] else None, None, None


def _attend(q, k, v, attn_bias, softmax_offset, extras: _Extras, config: AttentionConfig, rng_ctx: Callable):
    """The checkpointable core: the fused op under the dropout RNG context, or PyTorch's SDPA with its own autograd
    node (:func:`_sdpa`) where SDPA expresses the call and torch.compile traces it, or, in eager, where the policy's
    first choices for ``fused_attn_fwd`` and ``fused_attn_bwd`` are PyTorch's SDPA kernels (``plugin.runs_as_aten``:
    vendor.cuda's on CUDA) and the call is square or unmasked (SDPA's causal flag and the catalog's then agree)."""
    with rng_ctx():
        if _sdpa_expresses(attn_bias, softmax_offset, extras, config) and (torch.compiler.is_compiling() or _eager_sdpa(q, k, config)):
            return _sdpa(q, k, v, config)
        return _FusedAttnFunc.apply(q, k, v, attn_bias, softmax_offset, extras, config)


def _eager_sdpa(q: torch.Tensor, k: torch.Tensor, config: AttentionConfig) -> bool:
    """True when an eager call that SDPA expresses may run as SDPA itself (see :func:`_attend`)."""
    return ((config.mask_type == "no_mask" or q.shape[1] == k.shape[1]) and runs_as_aten("fused_attn_fwd", q.device, q.dtype)
            and runs_as_aten("fused_attn_bwd", q.device, q.dtype))


def _sdpa_expresses(attn_bias, softmax_offset, extras: _Extras, config: AttentionConfig) -> bool:
    """True for a "bshd" call without bias, window, extra masks or softmax offset, causal (top-left) or not."""
    return (config.qkv_format == "bshd" and config.mask_type in ("no_mask", "causal") and not config.has_window
            and config.bias_type == "no_bias" and config.softmax_type == "vanilla" and attn_bias is None
            and softmax_offset is None and extras.attn_mask is None and extras.alibi_slopes is None)


def _sdpa(q, k, v, config: AttentionConfig) -> torch.Tensor:
    """The attention of a call as ``F.scaled_dot_product_attention``, with PyTorch's autograd.

    Traced by torch.compile: the catalog's attention ops return a context object that only their own backend
    reads, which a compiled graph cannot carry; SDPA is the same math (for these calls), and Inductor lowers it
    to the cuDNN / flash kernels the vendor backend calls, with dropout from the device generator. In eager, where
    the vendor backend's SDPA kernels are the policy's choice: the same kernels (PyTorch 2.11 picks cuDNN first on
    sm_90, as vendor.cuda does) without a Python autograd node. q, k, v are [b, s, h, d] ("bshd"); so is the result.
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=config.dropout_p,
        is_causal=config.mask_type == "causal", scale=config.softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


@dataclass(frozen=True, eq=False)
class _Problem:
    """One call in the catalog's layout.

    Attributes:
        q, k, v: "bshd" or "thd" tensors for the op.
        thd: the op runs on packed sequences.
        s_q, s_kv: (padded) score lengths.
        padding: real tokens (padded "bshd" batch, or the packed sequences' lengths), or None.
        cu_seqlens_q, cu_seqlens_kv: packed offsets for "thd".
        restore: maps the op's output back to the caller's layout with heads flattened.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    thd: bool
    s_q: int
    s_kv: int
    padding: Optional[_masks.Padding]
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_kv: Optional[torch.Tensor]
    restore: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class _Sequences:
    """TE's sequence arguments of one call (``cu_seqlens_*``, ``cu_seqlens_*_padded``, ``max_seqlen_*``)."""

    cu_q: Optional[torch.Tensor] = None
    cu_kv: Optional[torch.Tensor] = None
    cu_q_padded: Optional[torch.Tensor] = None
    cu_kv_padded: Optional[torch.Tensor] = None
    max_q: Optional[int] = None
    max_kv: Optional[int] = None


def _flatten_heads(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[:-2] + (-1,))


def _padded_problem(q, k, v, fmt: str, padding: Optional[_masks.Padding]) -> _Problem:
    """sbhd / bshd: a transposed view of the batch (no copy)."""
    qb, kb, vb = (_layout.to_bshd(x, fmt) for x in (q, k, v))
    restore = lambda out: _flatten_heads(_layout.from_bshd(out, fmt))  # noqa: E731
    return _Problem(qb, kb, vb, thd=False, s_q=qb.shape[1], s_kv=kb.shape[1], padding=padding, cu_seqlens_q=None, cu_seqlens_kv=None,
                    restore=restore)


def _compact(x, cu, cu_padded):
    """Real rows of a thd tensor whose sequences start at cu_padded (None: already compact)."""
    if cu_padded is None or cu_padded is cu or torch.equal(cu_padded, cu):
        return x, None
    rows = _layout.token_rows(cu, cu_padded[:-1])
    return _layout.gather_rows(x, rows), rows


def _thd_problem(q, k, v, seqs: _Sequences) -> _Problem:
    """thd: the packed sequences, with padding between sequences (``cu_seqlens_*_padded``) removed."""
    cu_q, cu_kv = seqs.cu_q, seqs.cu_kv
    if cu_q is None or cu_kv is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (int32 [b + 1])")
    if cu_q.shape != cu_kv.shape or cu_q.dim() != 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_kv {tuple(cu_kv.shape)} must both be [b + 1]")
    total_q = q.shape[0]
    q, rows_q = _compact(q, cu_q, seqs.cu_q_padded)
    k, _ = _compact(k, cu_kv, seqs.cu_kv_padded)
    v, _ = _compact(v, cu_kv, seqs.cu_kv_padded)
    s_q, s_kv = _layout.max_seqlen(cu_q, seqs.max_q), _layout.max_seqlen(cu_kv, seqs.max_kv)
    padding = _masks.padding_from_lengths(_layout.seqlens(cu_q), _layout.seqlens(cu_kv), s_q, s_kv)

    def restore(out):
        out = out if rows_q is None else _layout.scatter_rows(out, rows_q, total_q)
        return _flatten_heads(out)

    return _Problem(q, k, v, thd=True, s_q=s_q, s_kv=s_kv, padding=padding, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, restore=restore)


def _inference_problem(q, fmt: str, step) -> _Problem:
    """KV caching: q (the new tokens, any format) against the cached keys/values ("bshd").

    ``step`` is what ``InferenceParams.step`` returned; the result is a padded "bshd" problem with
    per-sequence lengths (new tokens for q, cached tokens for k/v).
    """
    k_cache, v_cache, cu_q, cu_kv = step[:4]
    b = k_cache.shape[0]
    cu_q, cu_kv = cu_q[: b + 1], cu_kv[: b + 1]
    if fmt == "thd":
        qb = _layout.unpack_to_bshd(q[: int(cu_q[-1])], cu_q, _layout.max_seqlen(cu_q, None))
    else:
        qb = _layout.to_bshd(q, fmt)

    def restore(out):
        if fmt != "thd":
            return _flatten_heads(_layout.from_bshd(out, fmt))
        packed = _layout.pack_bshd(out, cu_q)
        rows = torch.arange(packed.shape[0], device=packed.device)
        return _flatten_heads(_layout.scatter_rows(packed, rows, q.shape[0]))

    padding = _masks.padding_from_lengths(_layout.seqlens(cu_q), _layout.seqlens(cu_kv), qb.shape[1], k_cache.shape[1])
    return _Problem(qb, k_cache, v_cache, thd=False, s_q=qb.shape[1], s_kv=k_cache.shape[1], padding=padding, cu_seqlens_q=None,
                    cu_seqlens_kv=None, restore=restore)


def _inference_mask_type(mask_type: str) -> str:
    """Under KV caching every mask is a padding mask and causal masks align bottom-right (as TE)."""
    if mask_type == "arbitrary":
        raise ValueError("attn_mask_type='arbitrary' cannot be used with inference_params (KV caching)")
    return "padding_causal_bottom_right" if "causal" in mask_type else "padding"


def _unpack_packed(qkv_layer, kv_layer, q, k, v, dim: int):
    """q, k, v from TE's packed ``qkv_layer`` ([.., 3, ..] at ``dim``) or ``kv_layer`` ([.., 2, ..])."""
    if qkv_layer is not None and kv_layer is not None:
        raise ValueError("qkv_layer and kv_layer are mutually exclusive; pass one of them")
    if dim not in (-3, -2):
        raise ValueError(f"qkv_interleave_dim must be -3 or -2, got {dim}")
    if qkv_layer is not None:
        q, k, v = (qkv_layer.select(dim, i) for i in range(3))
    elif kv_layer is not None:
        k, v = (kv_layer.select(dim, i) for i in range(2))
    if q is None or k is None or v is None:
        raise ValueError("query_layer, key_layer and value_layer are required (or qkv_layer / kv_layer)")
    return q, k, v


class DotProductAttention(torch.nn.Module):
    """Scaled dot-product attention with TE's formats, masks, windows, biases and softmax variants.

    O = dropout(softmax(softmax_scale Q K^T (+ bias), masked)) V, per head; keys/values may have
    ``num_gqa_groups`` heads (GQA / MQA). Arguments, defaults and shapes follow TE 2.x
    ``transformer_engine.pytorch.DotProductAttention``. Under ``te.autocast`` with a DelayedScaling recipe of
    ``fp8_dpa=True`` it computes in FP8 with TE's scaling roles (:mod:`.fp8_attention`; its state is ``fp8_meta``): causal
    or unmasked, GQA, one head size, no dropout, bias, window, padding or extra mask, not with context parallelism, KV
    caching or ``checkpoint_core_attention`` (each of those raises NotImplementedError under ``fp8_dpa``).
    ``return_max_logit=True``: forward returns (output, max_logit), max_logit [h] float32 the largest masked score of
    each head (``ops.attention_max_logit``; not differentiable, and not with context parallelism or KV caching).
    Context parallelism (``cp_group`` or :meth:`set_context_parallel_group`) splits the sequence over a group's ranks
    in TE's load-balanced layout, "bshd" / "sbhd" with no_mask or causal masks, and packed "thd" sequences with
    padding masks (TE's global ``cu_seqlens_*`` and ``cu_seqlens_*_padded``; see :mod:`.context_parallel`).

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> dpa = te.DotProductAttention(4, 8, qkv_format="bshd")
        >>> q = k = v = torch.randn(2, 5, 4, 8)
        >>> dpa(q, k, v).shape
        torch.Size([2, 5, 32])
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group=None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
        name: Optional[str] = None,
    ) -> None:
        _check_init(num_attention_heads, num_gqa_groups, tp_size, qkv_format, softmax_type, attention_type)
        d_qk, d_v = check_kv_channels("DotProductAttention", kv_channels)
        check_probability("DotProductAttention", "attention_dropout", attention_dropout)
        super().__init__()
        self.return_max_logit = bool(return_max_logit)
        self.qkv_format = qkv_format
        self.attn_mask_type = _masks.canonical_mask_type(attn_mask_type)
        self.window_size = _masks.check_set_window_size(self.attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.tp_size, self.tp_group, self.sequence_parallel = tp_size, tp_group, sequence_parallel
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type = attention_type
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = self.num_gqa_groups // tp_size
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = d_qk, d_v
        self.softmax_scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
        self.attention_dropout = float(attention_dropout)
        self.softmax_type = softmax_type
        self.name = name
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self._fp8_attention = FP8AttentionState()
        self.fp8_meta = self._fp8_attention.fp8_meta  # TE's name for the module's FP8 scaling state
        self.softmax_offset = None
        if softmax_type == "learnable":
            heads = num_attention_heads // tp_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, device=default_device()))

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split the sequence of later calls over ``cp_group`` (TE's method and arguments).

        Args:
            cp_group: the context-parallel ProcessGroup (None: no context parallelism).
            cp_global_ranks: the group's global ranks (None: asked from torch.distributed).
            cp_stream: accepted for TE compatibility (communication is asynchronous p2p here).
            cp_comm_type: "p2p" (ring), "all_gather" (K/V gathered) or "a2a" (Ulysses); "a2a+p2p" is
                not implemented.

        Raises:
            ValueError / TypeError / NotImplementedError: see :func:`.context_parallel.check_cp_group`.
        """
        _cp.check_cp_group(cp_group, cp_global_ranks, cp_comm_type)
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = cp_group, cp_global_ranks, cp_stream, cp_comm_type
        self._cp_group_settings = None if cp_group is None else _cp.CPGroup(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def get_extra_state(self) -> torch.Tensor:
        """The FP8 attention state (``fp8_meta``) in TE's ``core_attention._extra_state`` format; empty before any call
        under ``fp8_dpa``."""
        return self._fp8_attention.extra_state()

    def set_extra_state(self, state) -> None:
        """Restore the FP8 attention state :meth:`get_extra_state` (or NVIDIA TE's DotProductAttention) saved.

        Raises:
            ValueError: a payload that is not TE's scaling state, of another recipe type or GEMM count (TE's 3).
        """
        device = self.softmax_offset.device if self.softmax_offset is not None else default_device()
        self._fp8_attention.load_extra_state(state, device, type(self).__name__)

    def _mask_spec(self, attn_mask_type, window_size, bottom_right_diagonal, inference: bool) -> _masks.MaskSpec:
        mask_type = self.attn_mask_type if attn_mask_type is None else _masks.canonical_mask_type(attn_mask_type)
        if inference:
            mask_type = _inference_mask_type(mask_type)
        window = _masks.check_set_window_size(mask_type, self.window_size if window_size is None else window_size)
        brd = self.bottom_right_diagonal if bottom_right_diagonal is None else bottom_right_diagonal
        return _masks.MaskSpec(mask_type, window, _masks.resolve_bottom_right(mask_type, bottom_right_diagonal=brd))

    def _check_heads(self, q, k, v) -> None:
        heads_q = self.num_attention_heads // self.tp_size
        d_qk, d_v = self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.shape[-2:] != (heads_q, d_qk) or k.shape[-2:] != (self.num_gqa_groups_per_partition, d_qk):
            raise ValueError(
                f"query {tuple(q.shape)} / key {tuple(k.shape)}: expected {heads_q} query heads and "
                f"{self.num_gqa_groups_per_partition} key/value heads of size {d_qk} (num_attention_heads, "
                "num_gqa_groups, kv_channels)"
            )
        if v.shape[-1] != d_v or k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"value {tuple(v.shape)} must match key {tuple(k.shape)} with head size {d_v}")

    def _rng_ctx(self, dropout_p: float) -> Callable:
        if dropout_p == 0.0 or self.get_rng_state_tracker is None or self.sequence_parallel:
            return nullcontext
        return self.get_rng_state_tracker().fork

    def forward(
        self,
        query_layer: Optional[torch.Tensor] = None,
        key_layer: Optional[torch.Tensor] = None,
        value_layer: Optional[torch.Tensor] = None,
        attention_mask=None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        bf16_backward: Optional[bool] = False,
        num_splits: Optional[int] = 1,
        score_mod: Optional[Callable] = None,
        score_mod_bprop: Optional[Callable] = None,
        score_mod_tensors=None,
        score_mod_bprop_tensors=None,
        qkv_layer: Optional[torch.Tensor] = None,
        kv_layer: Optional[torch.Tensor] = None,
        qkv_interleave_dim: int = -3,
    ) -> torch.Tensor:
        """Attention output with heads flattened: [s, b, h*d_v] (sbhd), [b, s, h*d_v] (bshd), [t, h*d_v] (thd).

        Arguments follow TE's ``DotProductAttention.forward``. ``attention_mask`` is used for the
        padding types ([b, 1, 1, s] bool, or a (q, kv) pair) and "arbitrary" (bool broadcastable to
        [b, h, s_q, s_kv]); True means masked out. Unused TE arguments (``fast_zero_fill``,
        ``pad_between_seqs``, ``num_splits``, ``bf16_backward``) are accepted and ignored.

        Raises:
            ValueError / TypeError: inconsistent shapes, dtypes or settings (the message names them).
            NotImplementedError: FP8 output or score_mod; ``return_max_logit`` with context parallelism or KV caching.
            NoImplementationError: no backend accepts the call (each backend's reason is listed).
        """
        if fp8_output or score_mod is not None or score_mod_bprop is not None:
            raise NotImplementedError("fp8_output and score_mod are not supported yet; pass fp8_output=False, score_mod=None")
        q, k, v = _unpack_packed(qkv_layer, kv_layer, query_layer, key_layer, value_layer, qkv_interleave_dim)
        fmt = self.qkv_format if qkv_format is None else qkv_format
        if fmt not in _layout.FORMATS:
            raise ValueError(f"qkv_format={fmt!r} is not one of {', '.join(_layout.FORMATS)}")
        self._check_heads(q, k, v)
        spec = self._mask_spec(attn_mask_type, window_size, bottom_right_diagonal, inference=inference_params is not None)
        cp = self._cp_group_settings is not None and self._cp_group_settings.size > 1
        if self.return_max_logit and (cp or inference_params is not None):
            raise NotImplementedError("DotProductAttention(return_max_logit=True) with context parallelism or KV caching "
                                      "(inference_params) is not implemented yet")
        fp8 = self._fp8_attention.requested()
        if fp8 and (cp or inference_params is not None or checkpoint_core_attention):
            raise NotImplementedError("DotProductAttention under fp8_dpa=True does not implement context parallelism, KV caching "
                                      "(inference_params) or checkpoint_core_attention yet; set fp8_dpa=False for this module's calls")
        seqs = _Sequences(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
        if cp:
            bias_type = "alibi" if alibi_slopes is not None else core_attention_bias_type
            return self._cp_forward(q, k, v, fmt, spec, seqs, bias_type, core_attention_bias,
                                    inference=inference_params is not None, checkpointed=checkpoint_core_attention)
        problem = self._problem(q, k, v, fmt, spec, attention_mask, seqs, inference_params)
        bias = _Bias.resolve(core_attention_bias_type, core_attention_bias, alibi_slopes, q.shape[-2], q.device)
        user_mask = attention_mask if spec.mask_type == "arbitrary" else None
        plan = _masks.plan_masks(spec, s_q=problem.s_q, s_kv=problem.s_kv, padding=problem.padding, user_mask=user_mask,
                                 alibi_slopes=bias.slopes, thd=problem.thd, device=q.device)
        config, attn_bias, extras = self._op_call(plan, bias, problem)
        if fp8:
            out = self._fp8_attend(problem, attn_bias, extras, config)
        else:
            args = (problem.q, problem.k, problem.v, attn_bias, self.softmax_offset, extras, config, self._rng_ctx(config.dropout_p))
            if checkpoint_core_attention:
                out = checkpoint(_attend, *args, get_rng_state_tracker=self.get_rng_state_tracker)
            else:
                out = _attend(*args)
        if not self.return_max_logit:
            return problem.restore(out)
        with torch.no_grad():  # traced by torch.compile as the op's compiled form (the catalog declares it traced)
            max_logit = ops.attention_max_logit(problem.q, problem.k, config, attn_mask=extras.attn_mask, attn_bias=attn_bias,
                                                alibi_slopes=extras.alibi_slopes, cu_seqlens_q=extras.cu_seqlens_q,
                                                cu_seqlens_kv=extras.cu_seqlens_kv)
        return problem.restore(out), max_logit

    def _fp8_attend(self, problem: _Problem, attn_bias, extras: _Extras, config: AttentionConfig) -> torch.Tensor:
        """The FP8 attention of a call (checked first: what the op's config does not say is checked here)."""
        if attn_bias is not None or extras.attn_mask is not None or extras.alibi_slopes is not None or self.softmax_offset is not None:
            raise NotImplementedError("DotProductAttention under fp8_dpa=True does not implement padding or arbitrary masks, "
                                      "biases, ALiBi or learnable softmax offsets; set fp8_dpa=False for this module's calls")
        quantizers = self._fp8_attention.quantizers(problem.q.device, type(self).__name__)
        return fp8_attention(problem.q, problem.k, problem.v, quantizers, config)

    def _cp_forward(self, q, k, v, fmt: str, spec: _masks.MaskSpec, seqs: _Sequences, bias_type: str,
                    bias_tensor: Optional[torch.Tensor], inference: bool, checkpointed: bool):
        """Context-parallel attention of this rank's tokens (checked before any communication); "thd" as a batch of one
        packed row, its sequences told apart by the ring's masks (see :mod:`.context_parallel_packed`)."""
        dropout_p = self.attention_dropout if self.training else 0.0
        group = self._cp_group_settings
        if fmt == "thd":
            problem = _Problem(q[None], k[None], v[None], thd=True, s_q=q.shape[0], s_kv=k.shape[0], padding=None, cu_seqlens_q=None,
                               cu_seqlens_kv=None, restore=lambda out: _flatten_heads(out[0]))
        else:
            problem = _padded_problem(q, k, v, fmt, None)
        _cp.check_cp_call(group, fmt, spec.mask_type, spec.window_size, bias_type=bias_type, inference=inference,
                          softmax_type=self.softmax_type, dropout_p=dropout_p, q=problem.q, k=problem.k)
        packed = None
        if fmt == "thd":
            packed = _cp.PackedSequences.from_offsets(seqs.cu_q, seqs.cu_kv, seqs.cu_q_padded, seqs.cu_kv_padded,
                                                      bottom_right=spec.mask_type.endswith("bottom_right"), size=group.size,
                                                      tokens_q=q.shape[0], tokens_kv=k.shape[0],
                                                      name=f"context parallelism (cp_comm_type={group.comm_type!r})")
        if bias_type != "no_bias":
            bias_tensor = _Bias.resolve(bias_type, bias_tensor, None, q.shape[-2], q.device).tensor
            _cp.check_cp_bias(bias_tensor, problem.q, problem.k, group.size)
        settings = _cp.CPAttention(causal="causal" in spec.mask_type, window_size=spec.window_size, softmax_scale=self.softmax_scale,
                                   dropout_p=dropout_p, softmax_type=self.softmax_type, packed=packed, bias_type=bias_type)
        rng_ctx = self._rng_ctx(dropout_p)

        def attend(qc, kc, vc, softmax_offset, config):
            if isinstance(config, _cp.PackedCall):  # "a2a", "all_gather" over packed sequences: thd in, thd out
                return self._packed_attention(qc, kc, vc, softmax_offset, config, rng_ctx)
            return _attend(qc, kc, vc, None, softmax_offset, _Extras(), config, rng_ctx)

        args = (problem.q, problem.k, problem.v, settings, self._cp_group_settings, attend, self.softmax_offset, rng_ctx, bias_tensor)
        if checkpointed:
            out = checkpoint(_cp.context_parallel_attention, *args, get_rng_state_tracker=self.get_rng_state_tracker)
        else:
            out = _cp.context_parallel_attention(*args)
        return problem.restore(out)

    def _packed_attention(self, q, k, v, softmax_offset, call: "_cp.PackedCall", rng_ctx) -> torch.Tensor:
        """[t, h, d_v]: the "thd" attention ``call`` of context parallelism (offsets, mask, window), padding rows 0."""
        seqs = _Sequences(call.cu_q, call.cu_kv, call.cu_q_padded, call.cu_kv_padded)
        spec = _masks.MaskSpec(call.mask_type, call.window, call.mask_type.endswith("bottom_right"))
        problem = _thd_problem(q, k, v, seqs)
        plan = _masks.plan_masks(spec, s_q=problem.s_q, s_kv=problem.s_kv, padding=problem.padding, user_mask=None,
                                 alibi_slopes=None, thd=True, device=q.device)
        config, attn_bias, extras = self._op_call(plan, _Bias("no_bias", None, None), problem)
        out = _attend(problem.q, problem.k, problem.v, attn_bias, softmax_offset, extras, config, rng_ctx)
        return problem.restore(out).unflatten(-1, (q.shape[1], -1))

    def _problem(self, q, k, v, fmt: str, spec: _masks.MaskSpec, attention_mask, seqs: _Sequences, inference_params) -> _Problem:
        """The call in the catalog's layout: KV-cached, packed (thd) or a (padded) sbhd / bshd batch."""
        if inference_params is not None:
            return _inference_problem(q, fmt, inference_params.step(self.layer_number, k, v, fmt))
        if fmt == "thd":
            return _thd_problem(q, k, v, seqs)
        seq_dim = 1 if fmt == "bshd" else 0
        return _padded_problem(q, k, v, fmt, _bshd_padding(spec, attention_mask, seqs, q.shape[seq_dim], k.shape[seq_dim]))

    def _op_call(self, plan: _masks.MaskPlan, bias: "_Bias", problem: _Problem):
        """(AttentionConfig, attn_bias, extras) for the op."""
        bias_type, attn_bias, slopes = bias.bias_type, bias.tensor, bias.slopes
        if plan.alibi_bias is not None:
            bias_type, attn_bias, slopes = "post_scale_bias", plan.alibi_bias, None
        config = AttentionConfig(
            softmax_scale=self.softmax_scale,
            mask_type=plan.mask_type,
            window_size=plan.window_size,
            dropout_p=self.attention_dropout if self.training else 0.0,
            softmax_type=self.softmax_type,
            bias_type=bias_type,
            qkv_format="thd" if problem.thd else "bshd",
            max_seqlen_q=problem.s_q if problem.thd else 0,
            max_seqlen_kv=problem.s_kv if problem.thd else 0,
        )
        extras = _Extras(plan.attn_mask, slopes, problem.cu_seqlens_q, problem.cu_seqlens_kv)
        return config, attn_bias, extras


@dataclass(frozen=True, eq=False)
class _Bias:
    """The resolved ``core_attention_bias_type`` and its tensors."""

    bias_type: str
    tensor: Optional[torch.Tensor]
    slopes: Optional[torch.Tensor]

    @staticmethod
    def resolve(bias_type: str, bias, alibi_slopes, num_heads: int, device) -> "_Bias":
        """Check TE's rules: pre/post-scale need a bias tensor, alibi takes slopes (TE's defaults when None)."""
        if bias_type not in _BIAS_TYPES:
            raise ValueError(f"core_attention_bias_type={bias_type!r} is not one of {', '.join(_BIAS_TYPES)}")
        if alibi_slopes is not None and bias_type != "alibi":
            raise ValueError("alibi_slopes needs core_attention_bias_type='alibi'")
        if bias_type == "alibi":
            if bias is not None:
                raise ValueError("core_attention_bias must be None when core_attention_bias_type='alibi'")
            slopes = _masks.default_alibi_slopes(num_heads, device) if alibi_slopes is None else alibi_slopes
            return _Bias("alibi", None, slopes)
        if bias_type == "no_bias":
            return _Bias("no_bias", None, None)
        if bias is None:
            raise ValueError(f"core_attention_bias_type={bias_type!r} needs core_attention_bias ([1 or b, h or 1, s_q, s_kv])")
        return _Bias(bias_type, bias, None)


def _bshd_padding(spec: _masks.MaskSpec, attention_mask, seqs: _Sequences, s_q: int, s_kv: int) -> Optional[_masks.Padding]:
    """Real tokens of a padded sbhd / bshd batch, from the padding mask or the cu_seqlens."""
    if not spec.padded:
        return None
    if attention_mask is not None:
        return _masks.padding_from_mask(attention_mask, s_q, s_kv)
    if seqs.cu_q is not None and seqs.cu_kv is not None:
        return _masks.padding_from_lengths(_layout.seqlens(seqs.cu_q), _layout.seqlens(seqs.cu_kv), s_q, s_kv)
    raise ValueError(
        f"attn_mask_type={spec.mask_type!r} needs attention_mask ([b, 1, 1, s] bool, True = padding) "
        "or cu_seqlens_q and cu_seqlens_kv"
    )


def _check_init(heads: int, groups: Optional[int], tp_size: int, qkv_format: str, softmax_type: str, attention_type: str) -> None:
    check_heads("DotProductAttention", heads, groups, tp_size)
    if qkv_format not in _layout.FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} is not one of {', '.join(_layout.FORMATS)}")
    if softmax_type not in _SOFTMAX_TYPES:
        raise ValueError(f"softmax_type={softmax_type!r} is not one of {', '.join(_SOFTMAX_TYPES)}")
    if attention_type not in ("self", "cross"):
        raise ValueError(f"attention_type={attention_type!r} must be 'self' or 'cross'")
