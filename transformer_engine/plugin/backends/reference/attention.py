"""Reference (pure PyTorch) implementations: fused attention. See plugin/catalog/attention.py.

For one batch entry and query head n (kv head n // (h / h_kv)), in float32:
    S = scale (Q K^T + B)  |  scale Q K^T + B  |  scale Q K^T - slope_n |i + s_kv - s_q - j|
    S_ij = -inf where masked (mask type, window, attn_mask)
    lse_i = log(sum_j exp S_ij + exp alpha_n)     (alpha term only for off-by-one (alpha = 0) / learnable)
    P = exp(S - lse) (0 on fully masked rows),  P' = P M / (1 - p),  O = P' V
Backward (VJP), with dP' = dO V^T, dP = dP' M / (1 - p), D_i = sum_j P_ij dP_ij (= sum dO_i O_i):
    dS = P (dP - D),  dQ = scale dS K,  dK = scale dS^T Q,  dV = P'^T dO  (dK, dV summed over a kv group)
    dB = dS (post-scale) or scale dS (pre-scale), summed to B's shape;  dalpha_n = -sum_i exp(alpha_n - lse_i) D_i

"thd" runs each packed sequence (cu_seqlens[i]:cu_seqlens[i+1]) as a batch of one; its attn_mask and
attn_bias are read as padded [b, h, max_seqlen_q, max_seqlen_kv] tensors (the top-left s_q x s_kv
block of entry i belongs to sequence i); rows outside every sequence get zero output and gradients.
The forward keeps only the dropout masks in ctx; the backward recomputes P (``out`` is not needed) and
declines (``SUPPORTS``) a ctx another backend's forward made, so that the dispatcher passes it on to that backend.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from transformer_engine.plugin.catalog.attention import AttentionConfig, check_attention_layout
from transformer_engine.plugin.core import Reject

from .misc import dropout_bwd, dropout_fwd

__all__ = ["attention_max_logit", "fused_attn_fwd", "fused_attn_bwd"]

_BIASED = ("pre_scale_bias", "post_scale_bias")


@dataclass(frozen=True, eq=False)
class _Operands:
    """The optional tensors of one call, as 4-D tensors that broadcast against scores [b, h, s_q, s_kv].

    Attributes:
        attn_mask: bool, True = masked out.
        attn_bias: the bias B in its own dtype.
        slopes: float32 ALiBi slopes [b or 1, h, 1, 1].
        alpha: float32 extra softmax logit [1, h, 1, 1] (off-by-one: 0, learnable: softmax_offset).
    """

    attn_mask: Optional[torch.Tensor]
    attn_bias: Optional[torch.Tensor]
    slopes: Optional[torch.Tensor]
    alpha: Optional[torch.Tensor]


@dataclass(frozen=True)
class _Segment:
    """One independent attention problem: the whole bshd batch (rows None) or one thd sequence."""

    batch: slice
    rows_q: Optional[slice]
    rows_kv: Optional[slice]


@dataclass(frozen=True, eq=False)
class _AttentionCtx:
    """What ``fused_attn_bwd`` needs from the forward: its config and the dropout masks per segment."""

    config: AttentionConfig
    keep_masks: Tuple[Optional[torch.Tensor], ...]


@dataclass(frozen=True, eq=False)
class _SegmentGrads:
    """Gradients of one segment in [b, h, s, d] layout, dS [b, h, s_q, s_kv] and dalpha [h] (or None)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    ds: torch.Tensor
    dalpha: Optional[torch.Tensor]


def _check_qkv(q, k, v, config, cu_seqlens_q, cu_seqlens_kv) -> Tuple[int, int, int, int]:
    """Validate the layouts (the catalog's shared check); return the (padded) score shape (b, h, s_q, s_kv)."""
    check_attention_layout(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    h = q.shape[-2]
    if config.qkv_format == "bshd":
        return q.shape[0], h, q.shape[1], k.shape[1]
    max_q = config.max_seqlen_q or int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    max_kv = config.max_seqlen_kv or int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max())
    return cu_seqlens_q.shape[0] - 1, h, max_q, max_kv


def _as_4d(name: str, t, shape) -> torch.Tensor:
    """t viewed as 4-D after checking that it broadcasts to ``shape``."""
    if t.dim() > 4 or any(a not in (1, b) for a, b in zip(reversed(t.shape), reversed(shape))):
        raise ValueError(f"{name} of shape {tuple(t.shape)} must broadcast to [b, h, s_q, s_kv] = {list(shape)}")
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def _require(name: str, value, needed: bool, rule: str) -> None:
    if needed and value is None:
        raise ValueError(f"{name} is required when {rule}")
    if not needed and value is not None:
        raise ValueError(f"{name} was given but is not used unless {rule}; pass None or change the config")


def _score_operands(config, shape, attn_mask, attn_bias, alibi_slopes) -> _Operands:
    """Validate the tensors the scores read (mask, bias, ALiBi slopes) against ``config`` and the score shape;
    shape them for broadcasting (no softmax offset)."""
    b, h = shape[0], shape[1]
    _require("attn_bias", attn_bias, config.bias_type in _BIASED, f"bias_type is one of {_BIASED}")
    _require("alibi_slopes", alibi_slopes, config.bias_type == "alibi", "bias_type='alibi'")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = masked out), got {attn_mask.dtype}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes shape {tuple(alibi_slopes.shape)} must be [h] = [{h}] or [b, h] = [{b}, {h}]")
    return _Operands(
        attn_mask=None if attn_mask is None else _as_4d("attn_mask", attn_mask, shape),
        attn_bias=None if attn_bias is None else _as_4d("attn_bias", attn_bias, shape),
        slopes=None if alibi_slopes is None else alibi_slopes.float().reshape(-1, h, 1, 1),
        alpha=None,
    )


def _operands(config, shape, attn_mask, attn_bias, softmax_offset, alibi_slopes, device) -> _Operands:
    """:func:`_score_operands` and the softmax offset ``alpha`` (the zero offset of ``softmax_type='off-by-one'``
    made on ``device``)."""
    h = shape[1]
    learnable = config.softmax_type == "learnable"
    if config.softmax_type != "off-by-one":  # off-by-one ignores it: TE passes a zero buffer there
        _require("softmax_offset", softmax_offset, learnable, "softmax_type='learnable'")
    operands = _score_operands(config, shape, attn_mask, attn_bias, alibi_slopes)
    if learnable and softmax_offset.numel() != h:
        raise ValueError(f"softmax_offset has {softmax_offset.numel()} values; it needs one per head ({h})")
    if config.softmax_type == "vanilla":
        return operands
    alpha = softmax_offset.float().reshape(1, h, 1, 1) if learnable else torch.zeros(1, h, 1, 1, dtype=torch.float32, device=device)
    return _Operands(operands.attn_mask, operands.attn_bias, operands.slopes, alpha)


def _segments(config, cu_seqlens_q, cu_seqlens_kv) -> List[_Segment]:
    if config.qkv_format == "bshd":
        return [_Segment(slice(None), None, None)]
    cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    return [_Segment(slice(i, i + 1), slice(cq[i], cq[i + 1]), slice(ckv[i], ckv[i + 1])) for i in range(len(cq) - 1)]


def _heads_first(x, rows: Optional[slice]) -> torch.Tensor:
    """float32 [b, h, s, d] from bshd x [b, s, h, d] (rows None) or from rows of thd x [t, h, d]."""
    if rows is None:
        return x.float().transpose(1, 2)
    return x[rows].float().transpose(0, 1).unsqueeze(0)


def _put(dst, value, rows: Optional[slice]) -> None:
    """Write value [b, h, s, d] into dst in dst's layout and dtype (the inverse of :func:`_heads_first`)."""
    if rows is None:
        dst.copy_(value.transpose(1, 2))
    else:
        dst[rows] = value[0].transpose(0, 1).to(dst.dtype)


def _index(t, seg: _Segment, s_q: int, s_kv: int):
    """Index of the part of a 4-D operand [b|1, h|1, s_q|1, s_kv|1] that applies to ``seg``."""
    return (seg.batch if t.shape[0] > 1 else slice(None), slice(None), slice(0, s_q), slice(0, s_kv))


def _part(t, seg: _Segment, s_q: int, s_kv: int):
    return None if t is None else t[_index(t, seg, s_q, s_kv)]


def _mask(config, s_q: int, s_kv: int, attn_mask, device) -> torch.Tensor:
    """bool [..., s_q, s_kv], True = masked: mask type, sliding window (bottom-right aligned), attn_mask."""
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_kv, device=device)[None, :]
    diag = i + s_kv - s_q
    masked = torch.zeros(s_q, s_kv, dtype=torch.bool, device=device)
    if config.mask_type == "causal":
        masked |= j > i
    elif config.mask_type == "causal_bottom_right":
        masked |= j > diag
    left, right = config.window_size
    if left >= 0:
        masked |= j < diag - left
    if right >= 0:
        masked |= j > diag + right
    return masked if attn_mask is None else masked | attn_mask.to(device)


def _scores(qh, kh, config, operands: _Operands, seg: _Segment) -> torch.Tensor:
    """The masked scores S [b, h, s_q, s_kv] float32 (-inf where masked) of one segment from qh [b, h, s_q, d] and
    kh [b, h, s_kv, d] (kv heads expanded)."""
    s_q, s_kv, device = qh.shape[-2], kh.shape[-2], qh.device
    scores = qh @ kh.transpose(-1, -2)
    bias = _part(operands.attn_bias, seg, s_q, s_kv)
    if config.bias_type == "pre_scale_bias":
        scores = scores + bias.float()
    scores = scores * config.softmax_scale
    if config.bias_type == "post_scale_bias":
        scores = scores + bias.float()
    elif config.bias_type == "alibi":
        distance = (torch.arange(s_q, device=device)[:, None] + s_kv - s_q - torch.arange(s_kv, device=device)).abs()
        scores = scores - _part(operands.slopes, seg, 1, 1).to(device) * distance
    return scores.masked_fill(_mask(config, s_q, s_kv, _part(operands.attn_mask, seg, s_q, s_kv), device), float("-inf"))


def _probs(qh, kh, config, operands: _Operands, seg: _Segment):
    """(P, lse) of one segment from qh [b, h, s_q, d] and kh [b, h, s_kv, d] (kv heads expanded)."""
    scores = _scores(qh, kh, config, operands, seg)
    if operands.alpha is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    else:
        extra = operands.alpha.to(scores.device).expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat((scores, extra), dim=-1), dim=-1, keepdim=True)
    # a fully masked row has lse = -inf (vanilla): subtracting 0 instead keeps exp(-inf) = 0, not NaN
    return torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)), lse


def _qkv_heads(q, k, v, seg: _Segment):
    """float32 qh [b, h, s_q, d] and kh, vh expanded from h_kv to h heads (GQA / MQA)."""
    qh = _heads_first(q, seg.rows_q)
    group = q.shape[-2] // k.shape[-2]
    kh = _heads_first(k, seg.rows_kv).repeat_interleave(group, dim=1)
    vh = _heads_first(v, seg.rows_kv).repeat_interleave(group, dim=1)
    return qh, kh, vh


def _segment_fwd(q, k, v, seg: _Segment, config, operands: _Operands):
    """(O [b, h, s_q, d_v] float32, dropout keep mask or None) of one segment."""
    qh, kh, vh = _qkv_heads(q, k, v, seg)
    p, _ = _probs(qh, kh, config, operands, seg)
    keep = None
    if config.dropout_p > 0:
        p, keep = dropout_fwd(p, config.dropout_p)
    return p @ vh, keep


def _segment_bwd(dout, q, k, v, seg: _Segment, config, operands: _Operands, keep) -> _SegmentGrads:
    """Gradients of one segment (see the module docstring for the formulas)."""
    qh, kh, vh = _qkv_heads(q, k, v, seg)
    do = _heads_first(dout, seg.rows_q)
    p, lse = _probs(qh, kh, config, operands, seg)
    p_drop, dp = p, do @ vh.transpose(-1, -2)  # dP' = dO V^T
    if keep is not None:
        p_drop, dp = dropout_bwd(p, keep, config.dropout_p), dropout_bwd(dp, keep, config.dropout_p)
    delta = (p * dp).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    h_kv = k.shape[-2]
    dalpha = None
    if config.softmax_type == "learnable":
        dalpha = -(torch.exp(operands.alpha.to(lse.device) - lse) * delta).sum(dim=(0, 2, 3))
    return _SegmentGrads(
        dq=config.softmax_scale * (ds @ kh),
        dk=(config.softmax_scale * (ds.transpose(-1, -2) @ qh)).unflatten(1, (h_kv, -1)).sum(dim=2),
        dv=(p_drop.transpose(-1, -2) @ do).unflatten(1, (h_kv, -1)).sum(dim=2),
        ds=ds,
        dalpha=dalpha,
    )


def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                   cu_seqlens_kv=None):
    """O = dropout(softmax(S)) V for the settings in ``config`` (see the module docstring).

    Args:
        q, k, v: bshd [b, s, h, d] or thd [t, h, d] tensors (k, v with h_kv heads, h % h_kv == 0).
        config: :class:`AttentionConfig`.
        attn_mask: optional bool tensor broadcastable to [b, h, s_q, s_kv], True = masked out.
        attn_bias: bias broadcastable to [b, h, s_q, s_kv] for the pre/post-scale bias types.
        softmax_offset: alpha [h] for softmax_type "learnable" (ignored for "off-by-one", where alpha = 0).
        alibi_slopes: float [h] or [b, h] for bias_type "alibi".
        cu_seqlens_q, cu_seqlens_kv: int32 [b + 1] sequence offsets for "thd".

    Returns:
        (out in q's layout and dtype with v's head dim, ctx for :func:`fused_attn_bwd`).

    Raises:
        ValueError / TypeError: inconsistent shapes, or optional tensors missing or given against the config.
    """
    shape = _check_qkv(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    operands = _operands(config, shape, attn_mask, attn_bias, softmax_offset, alibi_slopes, q.device)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    keep_masks = []
    for seg in _segments(config, cu_seqlens_q, cu_seqlens_kv):
        o, keep = _segment_fwd(q, k, v, seg, config, operands)
        _put(out, o, seg.rows_q)
        keep_masks.append(keep)
    return out, _AttentionCtx(config, tuple(keep_masks))


def _reduce_to(g, shape) -> torch.Tensor:
    """Sum g [b, h, s_q, s_kv] over the dims where ``shape`` broadcasts (size 1)."""
    dims = tuple(d for d in range(4) if shape[d] == 1 and g.shape[d] != 1)
    return g.sum(dim=dims, keepdim=True) if dims else g


def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_kv=None):
    """Gradients of :func:`fused_attn_fwd` given dO (see the module docstring for the VJP).

    Args:
        dout: gradient of the output, in the output's layout.
        q, k, v, config and the optional tensors: exactly as given to :func:`fused_attn_fwd`.
        out: the forward output (unused: D is recomputed in float32 from P).
        ctx: the ctx returned by this backend's :func:`fused_attn_fwd`.

    Returns:
        (dq, dk, dv in their inputs' dtypes, dbias with attn_bias's shape or None,
        dsoftmax_offset with softmax_offset's shape for "learnable", else None).

    Raises:
        ValueError / TypeError: as the forward, or a ctx from another backend or another config.
    """
    if not isinstance(ctx, _AttentionCtx) or ctx.config != config:
        raise ValueError("ctx must come from the reference fused_attn_fwd called with the same config")
    shape = _check_qkv(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    operands = _operands(config, shape, attn_mask, attn_bias, softmax_offset, alibi_slopes, q.device)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = None if attn_bias is None else torch.zeros(operands.attn_bias.shape, dtype=torch.float32, device=q.device)
    dalpha = torch.zeros(shape[1], dtype=torch.float32, device=q.device) if config.softmax_type == "learnable" else None
    bias_factor = config.softmax_scale if config.bias_type == "pre_scale_bias" else 1.0
    for seg, keep in zip(_segments(config, cu_seqlens_q, cu_seqlens_kv), ctx.keep_masks):
        grads = _segment_bwd(dout, q, k, v, seg, config, operands, keep)
        _put(dq, grads.dq, seg.rows_q)
        _put(dk, grads.dk, seg.rows_kv)
        _put(dv, grads.dv, seg.rows_kv)
        if dbias is not None:
            index = _index(dbias, seg, grads.ds.shape[-2], grads.ds.shape[-1])
            dbias[index] += _reduce_to(bias_factor * grads.ds, dbias[index].shape)
        if dalpha is not None:
            dalpha += grads.dalpha
    return (
        dq,
        dk,
        dv,
        None if dbias is None else dbias.reshape(attn_bias.shape).to(attn_bias.dtype),
        None if dalpha is None else dalpha.reshape(softmax_offset.shape).to(softmax_offset.dtype),
    )


def _supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_kv=None):
    """Only a ctx made by this backend's :func:`fused_attn_fwd` (the catalog's rule: the backward runs where the ctx was made)."""
    return True if isinstance(ctx, _AttentionCtx) else Reject("ctx was not made by the reference fused_attn_fwd")


SUPPORTS = {"fused_attn_bwd": _supports_bwd}


def attention_max_logit(q, k, config, attn_mask=None, attn_bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """max over the batch and positions of each head's masked scores (the forward's S, see the module docstring)."""
    shape = _check_qkv(q, k, k, config, cu_seqlens_q, cu_seqlens_kv)
    operands = _score_operands(config, shape, attn_mask, attn_bias, alibi_slopes)
    max_logit = torch.full((shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
    for seg in _segments(config, cu_seqlens_q, cu_seqlens_kv):
        qh, kh, _ = _qkv_heads(q, k, k, seg)
        scores = _scores(qh, kh, config, operands, seg)
        if scores.numel():
            max_logit = torch.maximum(max_logit, scores.amax(dim=(0, 2, 3)))
    return max_logit
