"""Flash attention (FlashAttention-2, Dao 2023) in Triton: ``fused_attn_fwd`` and ``fused_attn_bwd``.

See plugin/catalog/attention.py for the op's contract. For one sequence and query head n (kv head
n // group, group = h / h_kv), with S = softmax_scale * Q K^T restricted to the band
``lo_off <= j - i <= hi_off`` (causal top-left: hi_off = 0; bottom-right: hi_off = s_kv - s_q;
window (left, right): lo_off = s_kv - s_q - left, hi_off <= s_kv - s_q + right):

Forward, per block of BLOCK_M query rows, streaming key blocks with an online softmax in fp32
(scores kept in base 2, s2 = S * log2(e)):
    m_new = max(m, rowmax(s2)),  alpha = 2^(m - m_new),  P~ = 2^(s2 - m_new)
    l = alpha * l + rowsum(P~),  acc = alpha * acc + P~ V,  m = m_new
    O = acc / l,  lse2 = m + log2(l)   (a fully masked row gives O = 0 and lse2 = +inf, so P = 0)
Backward (VJP), with P = 2^(s2 - lse2) recomputed from the saved lse2:
    D_i = sum_d dO_id O_id                                  (preprocess kernel)
    dV = P^T dO,  dS = P * (dO V^T - D),  dK = softmax_scale dS^T Q   (per key block, summed over the
                                                            query heads of its kv group: no atomics)
    dQ = softmax_scale dS K                                 (per query block, a second kernel)

Every loop runs over three ranges of blocks: the blocks that cross the band's edges or the sequence
ends, where scores are masked and loads bounds-checked, and between them the blocks fully inside,
which skip both. Layouts: "bshd" with any strides (so sbhd views need no copy) and "thd" (packed
sequences located through ``cu_seqlens``; one program per (sequence block, head), programs past a
short sequence's end return at once).

``ctx`` is a :class:`FlashAttnCtx` holding lse2 (fp32, [b, h, s_q] or [h, t_q]) and the longest
sequence lengths. Declined (``SUPPORTS``), so another backend runs them: attention masks, biases,
ALiBi, dropout, off-by-one / learnable softmax, fp32 inputs, head dims other than 16, 32, 64, 128,
d_qk != d_v, cu_seqlens other than int32; on CPU unless ``TRITON_INTERPRET=1``; in the backward, a ctx
that is not this forward's. Layout errors (the catalog's ``check_attention_layout``) are errors on
every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from transformer_engine.plugin.catalog.attention import attention_layout_error, check_attention_layout
from transformer_engine.plugin.core import Reject

from ._attention_kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel, _attn_fwd_kernel
from ._common import INTERPRET, cdiv

__all__ = ["fused_attn_fwd", "fused_attn_bwd"]

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16)
_UNBOUNDED = 2**30  # a window side of -1 becomes this many keys (sequences are shorter)
_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis, which runs over (sequence, head)
_CAUSAL_CODE = {"no_mask": 0, "causal": 1, "causal_bottom_right": 2}


# -- host side ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlashAttnCtx:
    """What ``fused_attn_bwd`` needs from the forward.

    Attributes:
        lse2: log2-sum-exp2 of the scaled scores per query row, fp32 ([b, h, s_q] or [h, t_q]);
            +inf for a row that sees no key.
        max_seqlen_q, max_seqlen_kv: longest sequences (thd), or s_q / s_kv (bshd).
    """

    lse2: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclass(frozen=True)
class _Geometry:
    """Sizes of one call: batch (sequences), heads, kv heads, head dim, the (longest) lengths."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seqlen_q: int
    seqlen_kv: int
    varlen: bool

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class _Band:
    """The mask settings as kernel arguments (see :func:`_band`)."""

    causal: int
    left: int
    right: int

    @classmethod
    def of(cls, config) -> "_Band":
        left, right = config.window_size
        return cls(_CAUSAL_CODE[config.mask_type], left, right)

    def kernel_kwargs(self) -> dict:
        """CAUSAL and whether the band has a lower edge (left window) or an upper one (causal, right window)."""
        return dict(CAUSAL=self.causal, HAS_LO=self.left >= 0, HAS_HI=self.causal != 0 or self.right >= 0)

    def window(self) -> Tuple[int, int]:
        """(left, right) as kernel scalars, an unbounded side as _UNBOUNDED."""
        return tuple(side if side >= 0 else _UNBOUNDED for side in (self.left, self.right))


def _geometry(q, k, config, cu_seqlens_q, cu_seqlens_kv, max_seqlens=None) -> _Geometry:
    """Sizes from q [b, s_q, h, d] / [t_q, h, d] and k; thd lengths from config, ``max_seqlens`` or cu_seqlens."""
    if config.qkv_format == "bshd":
        return _Geometry(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.shape[1], k.shape[1], varlen=False)
    if max_seqlens is None:
        max_seqlens = (config.max_seqlen_q or _longest(cu_seqlens_q), config.max_seqlen_kv or _longest(cu_seqlens_kv))
    return _Geometry(cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], q.shape[2], max_seqlens[0], max_seqlens[1], varlen=True)


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def _strides(t: torch.Tensor, geom: _Geometry) -> Tuple[int, int, int, int]:
    """(batch, row, head, feature) strides; batch stride 0 for thd (rows located through cu_seqlens)."""
    return ((0,) if geom.varlen else ()) + tuple(t.stride())


def _new_like(t: torch.Tensor, geom: _Geometry) -> torch.Tensor:
    """An output laid out like t; zeroed for thd, whose rows outside every sequence no program writes."""
    return torch.zeros_like(t) if geom.varlen else torch.empty_like(t)


def _new_stats(q: torch.Tensor, geom: _Geometry) -> torch.Tensor:
    """An fp32 per-(sequence, head, row) buffer: [b, h, s_q] (bshd) or [h, t_q] (thd)."""
    shape = (geom.heads, q.shape[0]) if geom.varlen else (geom.batch, geom.heads, geom.seqlen_q)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def _stat_strides(stats: torch.Tensor, geom: _Geometry) -> Tuple[int, int]:
    return (0, stats.stride(0)) if geom.varlen else (stats.stride(0), stats.stride(1))


def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                   cu_seqlens_kv=None):
    """O = softmax(softmax_scale Q K^T + band mask) V by the flash-attention forward kernel.

    Args: as in plugin/catalog/attention.py (the optional tensors must be None, bar cu_seqlens for thd).

    Returns:
        (out with q's shape and dtype, :class:`FlashAttnCtx`).

    Raises:
        ValueError / NotImplementedError: inconsistent shapes / settings this kernel declines
            (``SUPPORTS`` keeps the dispatcher from sending those here).
    """
    _raise_if_unsupported(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)
    geom = _geometry(q, k, config, cu_seqlens_q, cu_seqlens_kv)
    out = _new_like(q, geom)
    lse2 = _new_stats(q, geom)

    def grid(meta):
        return cdiv(geom.seqlen_q, meta["BLOCK_M"]), geom.batch * geom.heads

    _attn_fwd_kernel[grid](
        q, k, v, out, lse2, cu_seqlens_q, cu_seqlens_kv,
        *_strides(q, geom), *_strides(k, geom), *_strides(v, geom), *_strides(out, geom), *_stat_strides(lse2, geom),
        *_scalars(geom, config), HEAD_DIM=geom.head_dim, IS_VARLEN=geom.varlen, **_Band.of(config).kernel_kwargs(),
    )
    return out, FlashAttnCtx(lse2, geom.seqlen_q, geom.seqlen_kv)


def _scalars(geom: _Geometry, config) -> tuple:
    """The kernels' trailing runtime scalars: lengths, h, group, softmax_scale, window."""
    return (geom.seqlen_q, geom.seqlen_kv, geom.heads, geom.group, float(config.softmax_scale)) + _Band.of(config).window()


def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_kv=None):
    """(dQ, dK, dV) of the flash-attention forward: preprocess D, then dK/dV per key block, dQ per query block.

    Args: as in plugin/catalog/attention.py; ``ctx`` is the forward's :class:`FlashAttnCtx`.

    Returns:
        (dq, dk, dv, None, None): no bias and no softmax offset here.

    Raises:
        TypeError: ``ctx`` does not come from this backend's forward.
        ValueError / NotImplementedError: as :func:`fused_attn_fwd`.
    """
    if not isinstance(ctx, FlashAttnCtx):
        raise TypeError(f"ctx is a {type(ctx).__name__}, not the FlashAttnCtx of flagos fused_attn_fwd: "
                        "run the backward on the forward's backend")
    _raise_if_unsupported(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)
    geom = _geometry(q, k, config, cu_seqlens_q, cu_seqlens_kv, (ctx.max_seqlen_q, ctx.max_seqlen_kv))
    delta = _bwd_preprocess(out, dout, cu_seqlens_q, geom, ctx.lse2)
    dq, dk, dv = _new_like(q, geom), _new_like(k, geom), _new_like(v, geom)
    common = (*_strides(q, geom), *_strides(k, geom), *_strides(v, geom), *_strides(dout, geom))
    kwargs = dict(HEAD_DIM=geom.head_dim, IS_VARLEN=geom.varlen, **_Band.of(config).kernel_kwargs())

    def dkdv_grid(meta):
        return cdiv(geom.seqlen_kv, meta["BLOCK_N"]), geom.batch * geom.kv_heads

    def dq_grid(meta):
        return cdiv(geom.seqlen_q, meta["BLOCK_M"]), geom.batch * geom.heads

    _attn_bwd_dkdv_kernel[dkdv_grid](
        q, k, v, dout, dk, dv, ctx.lse2, delta, cu_seqlens_q, cu_seqlens_kv,
        *common, *_strides(dk, geom), *_strides(dv, geom), *_stat_strides(ctx.lse2, geom), *_scalars(geom, config), **kwargs,
    )
    _attn_bwd_dq_kernel[dq_grid](
        q, k, v, dout, dq, ctx.lse2, delta, cu_seqlens_q, cu_seqlens_kv,
        *common, *_strides(dq, geom), *_stat_strides(ctx.lse2, geom), *_scalars(geom, config), **kwargs,
    )
    return dq, dk, dv, None, None


def _bwd_preprocess(out, dout, cu_seqlens_q, geom: _Geometry, lse2: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32, laid out like lse2."""
    delta = torch.empty_like(lse2)
    block_m = 16 if INTERPRET else 64
    grid = (cdiv(geom.seqlen_q, block_m), geom.batch * geom.heads)
    _attn_bwd_preprocess_kernel[grid](
        out, dout, delta, cu_seqlens_q, *_strides(out, geom), *_strides(dout, geom), *_stat_strides(delta, geom),
        geom.seqlen_q, geom.heads, HEAD_DIM=geom.head_dim, IS_VARLEN=geom.varlen, BLOCK_M=block_m,
    )
    return delta


# -- what this backend declines -----------------------------------------------------------------
def _feature_gap(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv) -> Optional[str]:
    """Settings this kernel does not implement (another backend runs them), or None; the layout is checked
    first (:func:`~transformer_engine.plugin.catalog.attention.attention_layout_error`)."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and INTERPRET):
        return f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {q.device.type}"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"needs q, k, v all float16 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    names = ("attn_mask", "attn_bias", "softmax_offset", "alibi_slopes")
    given = [name for name, value in zip(names, extras) if value is not None]
    if given:
        return f"{', '.join(given)} not supported"
    if config.bias_type != "no_bias" or config.softmax_type != "vanilla" or config.dropout_p > 0.0:
        return f"bias_type={config.bias_type!r}, softmax_type={config.softmax_type!r}, dropout_p={config.dropout_p}: " \
            "only no_bias, vanilla, 0"
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_qk != d_v or d_qk not in HEAD_DIMS:
        return f"head dims d_qk={d_qk}, d_v={d_v}: needs d_qk == d_v in {HEAD_DIMS}"
    if cu_seqlens_q is not None and (cu_seqlens_q.dtype != torch.int32 or cu_seqlens_kv.dtype != torch.int32):
        return f"cu_seqlens of dtype {cu_seqlens_q.dtype} / {cu_seqlens_kv.dtype}: the kernels read int32 offsets"
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    if batch * q.shape[-2] > _MAX_GRID_Y:
        return f"batch x heads = {batch * q.shape[-2]} exceeds the launch grid's {_MAX_GRID_Y} rows"
    return None


def _raise_if_unsupported(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv) -> None:
    check_attention_layout(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    gap = _feature_gap(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv)
    if gap:
        raise NotImplementedError(f"flagos attention: {gap}; use another backend for this call")


def _verdict(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv):
    reason = attention_layout_error(q, k, v, config, cu_seqlens_q, cu_seqlens_kv) or _feature_gap(
        q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv)
    return Reject(reason) if reason else True


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                  cu_seqlens_kv=None):
    return _verdict(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)


def _supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_kv=None):
    if not isinstance(ctx, FlashAttnCtx):
        return Reject("ctx does not come from the flagos forward")
    return _verdict(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)


SUPPORTS = {"fused_attn_fwd": _supports_fwd, "fused_attn_bwd": _supports_bwd}
