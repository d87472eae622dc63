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
d_qk != d_v; on CPU unless ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.core import Reject

from ._common import cdiv
from ._launch import cached_launch

__all__ = ["fused_attn_fwd", "fused_attn_bwd"]

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16)
_LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: 2^(x log2 e) = e^x
_UNBOUNDED = 2**30  # a window side of -1 becomes this many keys (sequences are shorter)
_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis, which runs over (sequence, head)
_CAUSAL_CODE = {"no_mask": 0, "causal": 1, "causal_bottom_right": 2}
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584): there the
# dot operands are widened to fp32 (each kernel's DOT_T), the same products since a bf16 / fp16
# product is exact in fp32; compiled kernels feed tensor cores the input dtype.
_DOT_IN_FP32 = tl.constexpr(_INTERPRET)


# -- tuning -------------------------------------------------------------------------------------
# (BLOCK_M query rows, BLOCK_N key rows, num_warps, num_stages), pruned per head dim by
# _Footprint.fits. Under the interpreter one small config exercises the multi-block paths.
# (64, 64, 4, 3): 0.373 ms against 0.389 for (128, 64, 8, 3), the forward at b4 s2048 h32 d128 causal bf16
# on the H200 (autotuner timings, 2026-11-22, fourteenth run)
_FWD_SHAPES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4))
# (32, 64, 4, 3): 0.64 ms against 0.74 for the next best surviving config, dK / dV at b4 s2048 h32
# d128 causal bf16 on the H200 (autotuner timings, 2026-11-22)
_DKDV_SHAPES = ((32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 8, 3), (32, 64, 4, 3))
_DQ_SHAPES = ((128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4))
# of 255 per thread: room for pointers, masks and the bf16 copies of P / dS; checked against ptxas's
# counts for sm_90 (configs above it spilled registers, those at or below it did not, or barely)
_MAX_REGS_PER_THREAD = 160


def _configs(shapes):
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


@dataclass(frozen=True)
class _Footprint:
    """A kernel's tile model, for pruning configs that cannot fit before they are compiled.

    Attributes:
        resident: the block kept for the whole program ("BLOCK_M": queries, "BLOCK_N": keys); the
            other axis is streamed, two 2-byte tiles (K and V, or Q and dO) per pipeline stage.
        resident_tiles: 2-byte [resident, HEAD_DIM] tiles kept (Q; Q and dO; K and V).
        accumulators: fp32 [resident, HEAD_DIM] accumulators (O; dQ; dK and dV).
        scores: fp32 [BLOCK_M, BLOCK_N] tiles live at once (S; P and dP).
    """

    resident: str
    resident_tiles: int
    accumulators: int
    scores: int

    def fits(self, config, head_dim: int, smem_budget: int) -> bool:
        """shared memory = 2 D (resident_tiles kept + 2 stages streamed) bytes <= the device's, and
        registers = (accumulators kept D + scores BLOCK_M BLOCK_N) / threads <= _MAX_REGS_PER_THREAD."""
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        kept, streamed = (block_m, block_n) if self.resident == "BLOCK_M" else (block_n, block_m)
        smem = 2 * head_dim * (self.resident_tiles * kept + 2 * config.num_stages * streamed)
        regs = (self.accumulators * kept * head_dim + self.scores * block_m * block_n) / (32 * config.num_warps)
        return smem <= smem_budget and regs <= _MAX_REGS_PER_THREAD

    def pruner(self) -> dict:
        """``prune_configs_by`` for triton.autotune: the configs that fit (the last one if none does)."""

        def fits_device(configs, named_args, **kwargs):
            head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
            budget = _shared_memory_bytes(named_args["Q"].device.index or 0)
            return [c for c in configs if self.fits(c, head_dim, budget)] or configs[-1:]

        return {"early_config_prune": fits_device}


_FWD_FOOTPRINT = _Footprint("BLOCK_M", resident_tiles=1, accumulators=1, scores=1)
_DQ_FOOTPRINT = _Footprint("BLOCK_M", resident_tiles=2, accumulators=1, scores=2)
_DKDV_FOOTPRINT = _Footprint("BLOCK_N", resident_tiles=2, accumulators=2, scores=2)

_TUNING_KEY = ["HEAD_DIM", "CAUSAL", "HAS_LO", "HAS_HI", "IS_VARLEN"]


# -- shared jit helpers -------------------------------------------------------------------------
@triton.jit
def _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first row of q, first row of k, s_q, s_kv) of sequence ``off_b`` (thd: from cu_seqlens)."""
    q_start = off_b * 0
    k_start = off_b * 0
    if IS_VARLEN:
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        seqlen_q = tl.load(CU_Q + off_b + 1) - q_start
        seqlen_k = tl.load(CU_K + off_b + 1) - k_start
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def _head_offset(off_b, off_h, row0, stride_b, stride_h, stride_s, IS_VARLEN: tl.constexpr):
    """int64 element offset of row 0 of (sequence ``off_b``, head ``off_h``)."""
    offset = off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
    if IS_VARLEN:
        offset += row0.to(tl.int64) * stride_s
    return offset


@triton.jit
def _band(seqlen_q, seqlen_k, window_left, window_right, CAUSAL: tl.constexpr):
    """(lo_off, hi_off): key j is visible from query i iff lo_off <= j - i <= hi_off (an unbounded
    window side arrives as _UNBOUNDED, which puts that edge beyond every key)."""
    diag = seqlen_k - seqlen_q
    lo_off = diag - window_left
    hi_off = diag + window_right
    if CAUSAL == 1:
        hi_off = tl.minimum(hi_off, 0)
    if CAUSAL == 2:
        hi_off = tl.minimum(hi_off, diag)
    return lo_off, hi_off


@triton.jit
def _block_range(start, BLOCK: tl.constexpr, lo_off, hi_off, n_other, BLOCK_OTHER: tl.constexpr):
    """For own rows [start, start + BLOCK) and other rows c visible iff lo_off <= c - own <= hi_off,
    c < n_other: (lo, full_lo, full_hi, hi), the other-axis ranges [lo, full_lo) and [full_hi, hi)
    that need masks and [full_lo, full_hi) whose blocks are visible from every own row."""
    lo = tl.maximum(start + lo_off, 0)
    lo = (lo // BLOCK_OTHER) * BLOCK_OTHER
    hi = tl.maximum(tl.minimum(start + BLOCK + hi_off, n_other), lo)
    full_lo = tl.maximum(start + BLOCK - 1 + lo_off, lo)
    full_lo = tl.minimum((full_lo + BLOCK_OTHER - 1) // BLOCK_OTHER * BLOCK_OTHER, hi)
    full_hi = tl.maximum(tl.minimum(start + hi_off + 1, n_other), 0)
    full_hi = tl.maximum((full_hi // BLOCK_OTHER) * BLOCK_OTHER, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _mask_scores(s, rows, cols, lo_off, hi_off, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """s with -inf where key ``cols`` lies outside the band of query ``rows`` (index vectors shaped to
    broadcast). Sequence ends need no mask in the backward: the out-of-range rows of Q, dO, K, V
    are loaded as zeros and add 0 to every stored gradient; the forward masks keys past the end."""
    if HAS_LO:
        s = tl.where(cols >= rows + lo_off, s, float("-inf"))
    if HAS_HI:
        s = tl.where(cols <= rows + hi_off, s, float("-inf"))
    return s


# -- forward ------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd_blocks(
    acc, l_i, m_i, q,  # running state [BLOCK_M, HEAD_DIM], [BLOCK_M], [BLOCK_M]; q tile
    k_base, v_base,  # K, V pointers at row 0 of this sequence and kv head
    stride_ks, stride_kd, stride_vs, stride_vd,  # row and feature strides of K and V
    rows, lo_off, hi_off, seqlen_k,  # query indices [BLOCK_M], the band, keys in the sequence
    start, end, qk_scale,  # key range [start, end) and softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_T: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + offs_d[:, None] * stride_kd + cols[None, :] * stride_ks
        v_ptrs = v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < seqlen_k, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        s2 = tl.dot(q, kt.to(DOT_T)) * qk_scale
        if MASKED:
            s2 = _mask_scores(s2, rows[:, None], cols[None, :], lo_off, hi_off, HAS_LO, HAS_HI)
            s2 = tl.where(cols[None, :] < seqlen_k, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        p = tl.exp2(s2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < seqlen_k, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(DOT_T), v.to(DOT_T), acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs(_FWD_SHAPES), key=_TUNING_KEY, prune_configs_by=_FWD_FOOTPRINT.pruner())
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,  # q [.., s_q, h, d], k/v [.., s_kv, h_kv, d], out like q, lse2 fp32
    CU_Q, CU_K,  # int32 cu_seqlens [b + 1] (thd) or None
    stride_qb, stride_qs, stride_qh, stride_qd,  # q strides (batch stride 0 for thd)
    stride_kb, stride_ks, stride_kh, stride_kd,  # k strides
    stride_vb, stride_vs, stride_vh, stride_vd,  # v strides
    stride_ob, stride_os, stride_oh, stride_od,  # out strides
    stride_lb, stride_lh,  # lse2 strides over (batch, head); rows are contiguous
    seqlen_q, seqlen_k, num_heads, group,  # bshd lengths (thd: per sequence), h, h / h_kv
    sm_scale, window_left, window_right,  # softmax_scale and the sliding window
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the blocks of one head run side by side (K, V stay in L2), the last (causal: largest) first
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_b = tl.program_id(1) // num_heads
    off_h = tl.program_id(1) % num_heads
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    q_base = Q + _head_offset(off_b, off_h, q_start, stride_qb, stride_qh, stride_qs, IS_VARLEN)
    k_base = K + _head_offset(off_b, off_h // group, k_start, stride_kb, stride_kh, stride_ks, IS_VARLEN)
    v_base = V + _head_offset(off_b, off_h // group, k_start, stride_vb, stride_vh, stride_vs, IS_VARLEN)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=rows[:, None] < seqlen_q, other=0.0)
    dot_t = tl.float32 if _DOT_IN_FP32 else Q.dtype.element_ty
    q = q.to(dot_t)
    # m starts finite so that a row with every key masked keeps alpha = 2^(m - m_new) = 1, not NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * _LOG2E
    lo_off, hi_off = _band(seqlen_q, seqlen_k, window_left, window_right, CAUSAL)
    lo, full_lo, full_hi, hi = _block_range(start_m, BLOCK_M, lo_off, hi_off, seqlen_k, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                     rows, lo_off, hi_off, seqlen_k, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_N, True, dot_t, HAS_LO, HAS_HI)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                     rows, lo_off, hi_off, seqlen_k, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_N, False, dot_t, HAS_LO, HAS_HI)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                     rows, lo_off, hi_off, seqlen_k, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_N, True, dot_t, HAS_LO, HAS_HI)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    o_base = O + _head_offset(off_b, off_h, q_start, stride_ob, stride_oh, stride_os, IS_VARLEN)
    o_ptrs = o_base + rows[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None] < seqlen_q)
    l_base = LSE + _head_offset(off_b, off_h, q_start, stride_lb, stride_lh, 1, IS_VARLEN)
    tl.store(l_base + rows, lse2, mask=rows < seqlen_q)


# -- backward -----------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _attn_bwd_preprocess_kernel(
    O, DO, DELTA, CU_Q,  # out and dout (q's layout), D = rowsum(dO * O) fp32 (lse2's layout), cu_seqlens_q
    stride_ob, stride_os, stride_oh, stride_od,  # out strides
    stride_db, stride_ds, stride_dh, stride_dd,  # dout strides
    stride_lb, stride_lh,  # D strides over (batch, head)
    seqlen_q, num_heads,  # bshd length (thd: per sequence), h
    HEAD_DIM: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_b = tl.program_id(1) // num_heads
    off_h = tl.program_id(1) % num_heads
    q_start, _, seqlen_q, _ = _sequence(CU_Q, CU_Q, off_b, seqlen_q, seqlen_q, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o_base = O + _head_offset(off_b, off_h, q_start, stride_ob, stride_oh, stride_os, IS_VARLEN)
    do_base = DO + _head_offset(off_b, off_h, q_start, stride_db, stride_dh, stride_ds, IS_VARLEN)
    in_rows = rows[:, None] < seqlen_q
    o = tl.load(o_base + rows[:, None] * stride_os + offs_d[None, :] * stride_od, mask=in_rows, other=0.0)
    do = tl.load(do_base + rows[:, None] * stride_ds + offs_d[None, :] * stride_dd, mask=in_rows, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    d_base = DELTA + _head_offset(off_b, off_h, q_start, stride_lb, stride_lh, 1, IS_VARLEN)
    tl.store(d_base + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _attn_bwd_dkdv_blocks(
    dk, dv, k, v,  # fp32 accumulators [BLOCK_N, HEAD_DIM]; the key block's K and V tiles
    q_base, do_base, l_base, d_base,  # Q, dO, lse2, D pointers at row 0 of this sequence and head
    stride_qs, stride_qd, stride_ds, stride_dd,  # row and feature strides of Q and dO
    cols, lo_off, hi_off, seqlen_q,  # key indices [BLOCK_N], the band, queries in the sequence
    start, end, qk_scale,  # query range [start, end) and softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, DOT_T: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        qt_ptrs = q_base + offs_d[:, None] * stride_qd + rows[None, :] * stride_qs
        do_ptrs = do_base + rows[:, None] * stride_ds + offs_d[None, :] * stride_dd
        if MASKED:
            qt = tl.load(qt_ptrs, mask=rows[None, :] < seqlen_q, other=0.0)
            do = tl.load(do_ptrs, mask=rows[:, None] < seqlen_q, other=0.0)
            lse2 = tl.load(l_base + rows, mask=rows < seqlen_q, other=0.0)
            delta = tl.load(d_base + rows, mask=rows < seqlen_q, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(l_base + rows)
            delta = tl.load(d_base + rows)
        qt = qt.to(DOT_T)
        do = do.to(DOT_T)
        st = tl.dot(k, qt) * qk_scale  # S^T (base 2) [BLOCK_N, BLOCK_M]
        if MASKED:
            st = _mask_scores(st, rows[None, :], cols[:, None], lo_off, hi_off, HAS_LO, HAS_HI)
        pt = tl.exp2(st - lse2[None, :])
        dv = tl.dot(pt.to(DOT_T), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(DOT_T), tl.trans(qt), dk)
    return dk, dv


@triton.autotune(configs=_configs(_DKDV_SHAPES), key=_TUNING_KEY, prune_configs_by=_DKDV_FOOTPRINT.pruner())
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA,  # inputs, dout, outputs dk/dv (k's / v's layout), lse2 and D
    CU_Q, CU_K,  # int32 cu_seqlens [b + 1] (thd) or None
    stride_qb, stride_qs, stride_qh, stride_qd,  # q strides
    stride_kb, stride_ks, stride_kh, stride_kd,  # k strides
    stride_vb, stride_vs, stride_vh, stride_vd,  # v strides
    stride_db, stride_ds, stride_dh, stride_dd,  # dout strides
    stride_dkb, stride_dks, stride_dkh, stride_dkd,  # dk strides
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,  # dv strides
    stride_lb, stride_lh,  # lse2 / D strides over (batch, head)
    seqlen_q, seqlen_k, num_heads, group,  # bshd lengths (thd: per sequence), h, h / h_kv
    sm_scale, window_left, window_right,  # softmax_scale and the sliding window
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    num_kv_heads = num_heads // group
    off_b = tl.program_id(1) // num_kv_heads
    off_hk = tl.program_id(1) % num_kv_heads
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, IS_VARLEN)
    if start_n >= seqlen_k:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_cols = cols[:, None] < seqlen_k
    k_base = K + _head_offset(off_b, off_hk, k_start, stride_kb, stride_kh, stride_ks, IS_VARLEN)
    v_base = V + _head_offset(off_b, off_hk, k_start, stride_vb, stride_vh, stride_vs, IS_VARLEN)
    k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=in_cols, other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=in_cols, other=0.0)
    dot_t = tl.float32 if _DOT_IN_FP32 else Q.dtype.element_ty
    k = k.to(dot_t)
    v = v.to(dot_t)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * _LOG2E
    lo_off, hi_off = _band(seqlen_q, seqlen_k, window_left, window_right, CAUSAL)
    # query i sees key j iff -hi_off <= i - j <= -lo_off: the band seen from the keys
    lo, full_lo, full_hi, hi = _block_range(start_n, BLOCK_N, -hi_off, -lo_off, seqlen_q, BLOCK_M)
    for g in range(group):
        off_h = off_hk * group + g
        q_base = Q + _head_offset(off_b, off_h, q_start, stride_qb, stride_qh, stride_qs, IS_VARLEN)
        do_base = DO + _head_offset(off_b, off_h, q_start, stride_db, stride_dh, stride_ds, IS_VARLEN)
        l_base = LSE + _head_offset(off_b, off_h, q_start, stride_lb, stride_lh, 1, IS_VARLEN)
        d_base = DELTA + _head_offset(off_b, off_h, q_start, stride_lb, stride_lh, 1, IS_VARLEN)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_qd, stride_ds, stride_dd,
                                       cols, lo_off, hi_off, seqlen_q, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_M, True, dot_t, HAS_LO, HAS_HI)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_qd, stride_ds, stride_dd,
                                       cols, lo_off, hi_off, seqlen_q, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_M, False, dot_t, HAS_LO, HAS_HI)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_qd, stride_ds, stride_dd,
                                       cols, lo_off, hi_off, seqlen_q, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_M, True, dot_t, HAS_LO, HAS_HI)
    dk = dk * sm_scale
    dk_base = DK + _head_offset(off_b, off_hk, k_start, stride_dkb, stride_dkh, stride_dks, IS_VARLEN)
    dv_base = DV + _head_offset(off_b, off_hk, k_start, stride_dvb, stride_dvh, stride_dvs, IS_VARLEN)
    tl.store(dk_base + cols[:, None] * stride_dks + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=in_cols)
    tl.store(dv_base + cols[:, None] * stride_dvs + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=in_cols)


@triton.jit
def _attn_bwd_dq_blocks(
    dq, q, do, lse2, delta,  # fp32 accumulator [BLOCK_M, HEAD_DIM]; the query block's Q, dO, lse2, D
    k_base, v_base,  # K, V pointers at row 0 of this sequence and kv head
    stride_ks, stride_kd, stride_vs, stride_vd,  # row and feature strides of K and V
    rows, lo_off, hi_off, seqlen_k,  # query indices [BLOCK_M], the band, keys in the sequence
    start, end, qk_scale,  # key range [start, end) and softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_T: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + offs_d[:, None] * stride_kd + cols[None, :] * stride_ks
        vt_ptrs = v_base + offs_d[:, None] * stride_vd + cols[None, :] * stride_vs
        if MASKED:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < seqlen_k, other=0.0)
            vt = tl.load(vt_ptrs, mask=cols[None, :] < seqlen_k, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        kt = kt.to(DOT_T)
        s2 = tl.dot(q, kt) * qk_scale
        if MASKED:
            s2 = _mask_scores(s2, rows[:, None], cols[None, :], lo_off, hi_off, HAS_LO, HAS_HI)
        p = tl.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, vt.to(DOT_T))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(DOT_T), tl.trans(kt), dq)
    return dq


@triton.autotune(configs=_configs(_DQ_SHAPES), key=_TUNING_KEY, prune_configs_by=_DQ_FOOTPRINT.pruner())
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,  # inputs, dout, output dq (q's layout), lse2 and D
    CU_Q, CU_K,  # int32 cu_seqlens [b + 1] (thd) or None
    stride_qb, stride_qs, stride_qh, stride_qd,  # q strides
    stride_kb, stride_ks, stride_kh, stride_kd,  # k strides
    stride_vb, stride_vs, stride_vh, stride_vd,  # v strides
    stride_db, stride_ds, stride_dh, stride_dd,  # dout strides
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dq strides
    stride_lb, stride_lh,  # lse2 / D strides over (batch, head)
    seqlen_q, seqlen_k, num_heads, group,  # bshd lengths (thd: per sequence), h, h / h_kv
    sm_scale, window_left, window_right,  # softmax_scale and the sliding window
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the blocks of one head run side by side (K, V stay in L2), the last (causal: largest) first
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_b = tl.program_id(1) // num_heads
    off_h = tl.program_id(1) % num_heads
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_rows = rows[:, None] < seqlen_q
    q_base = Q + _head_offset(off_b, off_h, q_start, stride_qb, stride_qh, stride_qs, IS_VARLEN)
    do_base = DO + _head_offset(off_b, off_h, q_start, stride_db, stride_dh, stride_ds, IS_VARLEN)
    l_off = _head_offset(off_b, off_h, q_start, stride_lb, stride_lh, 1, IS_VARLEN)
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=in_rows, other=0.0)
    do = tl.load(do_base + rows[:, None] * stride_ds + offs_d[None, :] * stride_dd, mask=in_rows, other=0.0)
    lse2 = tl.load(LSE + l_off + rows, mask=rows < seqlen_q, other=0.0)
    delta = tl.load(DELTA + l_off + rows, mask=rows < seqlen_q, other=0.0)
    dot_t = tl.float32 if _DOT_IN_FP32 else Q.dtype.element_ty
    q = q.to(dot_t)
    do = do.to(dot_t)
    k_base = K + _head_offset(off_b, off_h // group, k_start, stride_kb, stride_kh, stride_ks, IS_VARLEN)
    v_base = V + _head_offset(off_b, off_h // group, k_start, stride_vb, stride_vh, stride_vs, IS_VARLEN)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * _LOG2E
    lo_off, hi_off = _band(seqlen_q, seqlen_k, window_left, window_right, CAUSAL)
    lo, full_lo, full_hi, hi = _block_range(start_m, BLOCK_M, lo_off, hi_off, seqlen_k, BLOCK_N)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                             rows, lo_off, hi_off, seqlen_k, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_N, True, dot_t, HAS_LO, HAS_HI)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                             rows, lo_off, hi_off, seqlen_k, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_N, False, dot_t, HAS_LO, HAS_HI)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                             rows, lo_off, hi_off, seqlen_k, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_N, True, dot_t, HAS_LO, HAS_HI)
    dq = dq * sm_scale
    dq_base = DQ + _head_offset(off_b, off_h, q_start, stride_dqb, stride_dqh, stride_dqs, IS_VARLEN)
    tl.store(dq_base + rows[:, None] * stride_dqs + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=in_rows)


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
        return _Geometry(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.shape[1], k.shape[1], False)
    if max_seqlens is None:
        max_seqlens = (config.max_seqlen_q or _longest(cu_seqlens_q), config.max_seqlen_kv or _longest(cu_seqlens_kv))
    return _Geometry(cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], q.shape[2], max_seqlens[0], max_seqlens[1], True)


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


def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
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


def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """(dQ, dK, dV) of the flash-attention forward: preprocess D, then dK/dV per key block, dQ per query block.

    Args: as in plugin/catalog/attention.py; ``ctx`` is the forward's :class:`FlashAttnCtx`.

    Returns:
        (dq, dk, dv, None, None): no bias and no softmax offset here.

    Raises:
        TypeError: ``ctx`` does not come from this backend's forward.
        ValueError / NotImplementedError: as :func:`fused_attn_fwd`.
    """
    if not isinstance(ctx, FlashAttnCtx):
        raise TypeError(f"ctx is a {type(ctx).__name__}, not the FlashAttnCtx of flagos fused_attn_fwd: run the backward on the forward's backend")
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
    block_m = 16 if _INTERPRET else 64
    grid = (cdiv(geom.seqlen_q, block_m), geom.batch * geom.heads)
    _attn_bwd_preprocess_kernel[grid](
        out, dout, delta, cu_seqlens_q, *_strides(out, geom), *_strides(dout, geom), *_stat_strides(delta, geom),
        geom.seqlen_q, geom.heads, HEAD_DIM=geom.head_dim, IS_VARLEN=geom.varlen, BLOCK_M=block_m,
    )
    return delta


# -- what this backend declines -----------------------------------------------------------------
def _feature_gap(q, k, v, config, extras, cu_seqlens_q) -> Optional[str]:
    """Settings this kernel does not implement (another backend runs them), or None."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _INTERPRET):
        return f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {q.device.type}"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"needs q, k, v all float16 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    names = ("attn_mask", "attn_bias", "softmax_offset", "alibi_slopes")
    given = [name for name, value in zip(names, extras) if value is not None]
    if given:
        return f"{', '.join(given)} not supported"
    if config.bias_type != "no_bias" or config.softmax_type != "vanilla" or config.dropout_p > 0.0:
        return f"bias_type={config.bias_type!r}, softmax_type={config.softmax_type!r}, dropout_p={config.dropout_p}: only no_bias, vanilla, 0"
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_qk != d_v or d_qk not in HEAD_DIMS:
        return f"head dims d_qk={d_qk}, d_v={d_v}: needs d_qk == d_v in {HEAD_DIMS}"
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    if batch * q.shape[-2] > _MAX_GRID_Y:
        return f"batch x heads = {batch * q.shape[-2]} exceeds the launch grid's {_MAX_GRID_Y} rows"
    return None


def _layout_error(q, k, v, config, cu_seqlens_q, cu_seqlens_kv) -> Optional[str]:
    """Inconsistent shapes for ``config.qkv_format`` (an error on any backend), or None."""
    rank = 4 if config.qkv_format == "bshd" else 3
    if not q.dim() == k.dim() == v.dim() == rank:
        return f"qkv_format {config.qkv_format!r} needs {rank}-D q, k, v, got {q.dim()}, {k.dim()}, {v.dim()}"
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}"
    if q.shape[-2] % k.shape[-2]:
        return f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} kv heads"
    if config.qkv_format == "bshd":
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            return "cu_seqlens are for qkv_format 'thd'; bshd padding needs attn_mask"
        return None if q.shape[0] == k.shape[0] else f"batch {q.shape[0]} of q differs from {k.shape[0]} of k"
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        return "qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv"
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_kv.dtype != torch.int32 or cu_seqlens_q.shape != cu_seqlens_kv.shape:
        return "cu_seqlens_q and cu_seqlens_kv must be int32 tensors of one shape [b + 1]"
    return None


def _raise_if_unsupported(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv) -> None:
    error = _layout_error(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    if error:
        raise ValueError(f"flagos attention: {error}")
    gap = _feature_gap(q, k, v, config, extras, cu_seqlens_q)
    if gap:
        raise NotImplementedError(f"flagos attention: {gap}; use another backend for this call")


def _verdict(q, k, v, config, extras, cu_seqlens_q, cu_seqlens_kv):
    reason = _layout_error(q, k, v, config, cu_seqlens_q, cu_seqlens_kv) or _feature_gap(q, k, v, config, extras, cu_seqlens_q)
    return Reject(reason) if reason else True


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    return _verdict(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)


def _supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    if not isinstance(ctx, FlashAttnCtx):
        return Reject("ctx does not come from the flagos forward")
    return _verdict(q, k, v, config, (attn_mask, attn_bias, softmax_offset, alibi_slopes), cu_seqlens_q, cu_seqlens_kv)


SUPPORTS = {"fused_attn_fwd": _supports_fwd, "fused_attn_bwd": _supports_bwd}
