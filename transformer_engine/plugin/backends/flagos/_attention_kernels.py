"""The Triton kernels of flagos flash attention: forward, the backward's preprocess (D = rowsum(dO * O)),
dK / dV per key block and dQ per query block, with their shared jit helpers. The math, layouts and
masking rules are in ``attention.py``'s docstring; the launch configurations in ``_attention_tuning``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_tuning import (
    _configs,
    _DKDV_FOOTPRINT,
    _DKDV_SHAPES,
    _DQ_FOOTPRINT,
    _DQ_SHAPES,
    _FWD_FOOTPRINT,
    _FWD_SHAPES,
    _TUNING_KEY,
)
from ._common import INTERPRET
from ._launch import cached_launch

__all__ = []

_LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: 2^(x log2 e) = e^x
# The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584): there the
# dot operands are widened to fp32 (each kernel's DOT_T), the same products since a bf16 / fp16
# product is exact in fp32; compiled kernels feed tensor cores the input dtype.
_DOT_IN_FP32 = tl.constexpr(INTERPRET)


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
                                     rows, lo_off, hi_off, seqlen_k, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_N, MASKED=True, DOT_T=dot_t,
                                     HAS_LO=HAS_LO, HAS_HI=HAS_HI)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                     rows, lo_off, hi_off, seqlen_k, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_N, MASKED=False,
                                     DOT_T=dot_t, HAS_LO=HAS_LO, HAS_HI=HAS_HI)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                     rows, lo_off, hi_off, seqlen_k, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_N, MASKED=True, DOT_T=dot_t,
                                     HAS_LO=HAS_LO, HAS_HI=HAS_HI)
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
                                       cols, lo_off, hi_off, seqlen_q, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_M, MASKED=True,
                                       DOT_T=dot_t, HAS_LO=HAS_LO, HAS_HI=HAS_HI)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_qd, stride_ds, stride_dd,
                                       cols, lo_off, hi_off, seqlen_q, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_M, MASKED=False,
                                       DOT_T=dot_t, HAS_LO=HAS_LO, HAS_HI=HAS_HI)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qs, stride_qd, stride_ds, stride_dd,
                                       cols, lo_off, hi_off, seqlen_q, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_M, MASKED=True,
                                       DOT_T=dot_t, HAS_LO=HAS_LO, HAS_HI=HAS_HI)
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
                             rows, lo_off, hi_off, seqlen_k, lo, full_lo, qk_scale, HEAD_DIM, BLOCK_N, MASKED=True, DOT_T=dot_t,
                             HAS_LO=HAS_LO, HAS_HI=HAS_HI)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                             rows, lo_off, hi_off, seqlen_k, full_lo, full_hi, qk_scale, HEAD_DIM, BLOCK_N, MASKED=False, DOT_T=dot_t,
                             HAS_LO=HAS_LO, HAS_HI=HAS_HI)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                             rows, lo_off, hi_off, seqlen_k, full_hi, hi, qk_scale, HEAD_DIM, BLOCK_N, MASKED=True, DOT_T=dot_t,
                             HAS_LO=HAS_LO, HAS_HI=HAS_HI)
    dq = dq * sm_scale
    dq_base = DQ + _head_offset(off_b, off_h, q_start, stride_dqb, stride_dqh, stride_dqs, IS_VARLEN)
    tl.store(dq_base + rows[:, None] * stride_dqs + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=in_rows)
