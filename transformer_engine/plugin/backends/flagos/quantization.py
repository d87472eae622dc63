"""FP8 casts in Triton: per tensor (quantize, dequantize, cast_transpose(_dbias), fp8_transpose,
compute_amax, delayed_scaling_update(_)) and per block (quantize_blockwise, cast_transpose_blockwise).

Math (plugin/catalog/quantization.py), float32 throughout:

    quantize        q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),  scale_inv = 1 / scale,
                    amax = max |x| over the finite elements of x
    dequantize      x = q * scale_inv, cast to out_dtype
    cast_transpose  q as quantize and q_t = q^T, both written from one read of each x tile
    quantize_transposed
                    q_t alone (the same kernel, the row-major store left out)
    cast_transpose_dbias
                    cast_transpose plus dbias[j] = sum_i x[i, j] in float32: each tile writes its
                    column sums to partials [cdiv(M, BLOCK_M), N], which ``column_sums`` adds over
                    dim 0 in a fixed order (no atomics: the result is deterministic)
    fp8_transpose   q_t[j, i] = q[i, j]
    compute_amax    amax = max |x| over the finite elements of x
    delayed_scaling_update
                    amax = max_l H[l] ("max") or H[0] ("most_recent"), read before the roll;
                    s_new = (fp8_max / amax) / 2^margin where amax is finite and > 0, else the old s;
                    +-inf -> float32 max; H_new = roll(H, -1, dim 0) with row 0 zeroed. One launch:
                    a program owns a block of columns and walks down the L rows (IEEE divisions,
                    so s_new is bit-identical to the reference's)
    delayed_scaling_update_
                    the same step in place where H[0] != 0 (NaN included; idle columns keep H and s),
                    then scale_inv = 1 / s: the same kernel (IN_PLACE), one launch; each chunk of rows
                    is loaded, then a barrier, then stored one row up, so no row is written unread
    quantize_blockwise
                    per tile T of 1 x B or B x B (B a power of two in [16, 256]): a = max(max |T|, eps),
                    scale = fp8_max / a (1 if a is 0 or not finite, float32 max on overflow, optionally
                    2^floor(log2(scale))), q = cast_fp8(clip(T * scale)), scale_inv = 1 / scale;
                    kernels in _blockwise.py (bit-identical to the reference)
    cast_transpose_blockwise
                    quantize_blockwise(x, 1 x B) and quantize_blockwise(x^T, 1 x B): the 1 x B kernel,
                    then one over [B, C] tiles quantizing their columns (or one fused kernel doing
                    both from one read; q_t has its own scales: it is not q^T)
    cast_transpose_blockwise_dbias
                    the same plus dbias[j] = sum_i x[i, j] in float32: the [B, C] tile kernel also
                    writes its tile's column sums, column_sums adds the partial rows

There is no VJP: these are casts (the module layer treats them as straight-through). The cast is
``_fp8_encode`` (bit-identical to torch's saturating round-to-nearest-even cast, see _common.py).
Every kernel but the [B, C] tile kernel of the block cast-transpose (persistent, see _blockwise.py)
handles one block (or tile) per program, so the hardware keeps every SM full whatever a kernel's
register count; a program reduces max |x| over its block and commits it with one relaxed
atomic (a fire-and-forget RED: no fence, nothing waits on it).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import (
    check_amax_epsilon,
    check_delayed_scaling_update,
    check_delayed_scaling_update_,
    check_delayed_scaling_update_many_,
    check_shared_update_args,
    check_update_lists,
)
from transformer_engine.plugin.backends._fp8 import (
    check_amax_out,
    check_fp8_dtype,
    check_high_precision,
    check_out_dtype,
    check_scalar,
    check_tensor,
    is_fp8,
)
from transformer_engine.plugin.core import Reject

from ._blockwise import _cast_transpose_blockwise_kernel, _quantize_blockwise_kernel
from ._column_sums import column_sums
from ._common import (
    INTERPRET,
    NO_FP8,
    _amax_commit,
    _finite_abs,
    _fp8_decode,
    _fp8_encode,
    _scale_inv_store,
    cdiv,
    device_guard,
    fp8_format,
    fp8_outputs,
    hw_fp8_cast,
    next_power_of_2,
    num_programs_hint,
    stream_counters,
)
from ._launch import cached_launch
from ._tables import TableCache

__all__ = [
    "quantize", "dequantize", "cast_transpose", "quantize_transposed", "cast_transpose_dbias", "fp8_transpose",
    "compute_amax", "current_scale", "delayed_scaling_update", "delayed_scaling_update_", "delayed_scaling_update_many_", "quantize_blockwise", "cast_transpose_blockwise",
    "cast_transpose_blockwise_dbias",
]

_BLOCK = 8192  # elements per program of the 1-D kernels (32 per thread at 8 warps; measured best, benchmarks/sweep_fp8_casts.py)
_TILE = 64  # square tile of fp8_transpose
# tile (rows, columns) of _cast_transpose_kernel; benchmarks/sweep_fp8_casts.py, H200, 2026-11-22, 8192 x 8192 bf16
# at 4 warps: 128 x 64 gives cast_transpose 0.90 of copy, q_t alone 0.91, with dbias 0.82 (64 x 64: 0.89 / 0.88 / 0.70)
_CT_TILE_M, _CT_TILE_N = 128, 64
_UPDATE_COLS = 32  # columns per program of the delayed-scaling update (one 128-byte row segment)
_UPDATE_TILE = 4096  # history elements per loop step of that update (L = 1024 takes 8 steps)
_STATE_TABLES = TableCache(64)  # the state tables of delayed_scaling_update_many_ (one per set of modules updated together)
_BLOCK_LENS = frozenset(16 << k for k in range(5))  # block lengths of the blockwise kernels: 16 ... 256
# Launch settings of the blockwise casts, swept on the H200 by benchmarks/sweep_fp8_casts.py --kernels blockwise.
# num_warps = tile elements / (32 * PER_THREAD), a power of two clamped to [2, 16].
_BLOCKWISE_TILE = 16384  # elements per program of the B x B quantize (128 x 128 tiles: one tile)
_BLOCKWISE_PER_THREAD = 64  # values per thread of the B x B quantize (8 warps at 16K)
# 1 x B quantize (2026-11-22, second sweep): one block per row (2-D tile, no [R, G, B] view) 0.98-1.01 of copy at
# [16384, 4096] / [8192, 16384]; 512-column rows (the earlier choice) 0.79-0.81
_BLOCKWISE_ROW = 128  # columns per program of the 1 x B quantize (one block: no 3-D row view)
_BLOCKWISE_ROW_TILE = 4096  # elements per program of the 1 x B quantize (rows = this / _BLOCKWISE_ROW)
_BLOCKWISE_ROW_PER_THREAD = 32  # values per thread of the 1 x B quantize (4 warps)
# cast_transpose_blockwise (same sweep): split, the column kernel on [128, 64] tiles at 2 warps, 4 persistent programs
# per SM: 0.55-0.57 of copy for the whole op (column kernel alone 0.71-0.73); fused 128 x 128 at 4 warps, one
# program per tile, was 0.47 before its loop loaded the next tile ahead (then it spills: 0.05; 8 warps 0.38-0.40)
_CT_BLOCKWISE_SPLIT = True  # True: two launches, the 1 x B quantize (q) and a column kernel (q_t); False: one fused read
_CT_BLOCKWISE_COL_TILE = 64  # split: columns per program of the column kernel (B x this tile)
_CT_BLOCKWISE_TILE_N = 128  # fused (not split): columns per program (B x this tile, at least B; above B: 3-D row view)
_CT_BLOCKWISE_PER_THREAD = 128  # values per thread of the column / fused kernel (2 warps at 128 x 64, 4 at 128 x 128)
_CT_BLOCKWISE_CODES = True  # 16-bit x: transpose the 8-bit codes (False: transpose the values, as float32 x does)
_CT_BLOCKWISE_PROGRAMS_PER_SM = 4  # persistent programs per SM of the column / fused kernel


@cached_launch
@triton.jit
def _quantize_kernel(
    x_ptr,  # *x, contiguous, n elements
    q_ptr,  # *uint8 view of q, n elements (unused without WRITE_Q)
    scale_ptr,  # *float32, one element: scale
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale
    amax_ptr,  # *int32, 0-d, zeroed: receives the bits of max |x| (finite)
    n,  # number of elements
    BLOCK: tl.constexpr,
    WRITE_Q: tl.constexpr,  # False: compute_amax only
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WRITE_Q:
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(q_ptr + offs, _fp8_encode(x * scale, FP8_MAX, MBITS, EBIAS, HW_CAST), mask=mask)
        _scale_inv_store(scale_inv_ptr, scale)
    _amax_commit(amax_ptr, _finite_abs(x))  # masked lanes hold 0


@cached_launch
@triton.jit
def _current_scale_kernel(
    x_ptr,  # *x, contiguous, n elements
    counters_ptr,  # *int32 [2], zero: the bits of max |x| so far, programs finished (left zero again)
    amax_ptr,  # *float32, 0-d: receives max |x| (finite)
    scale_ptr,  # *float32, 0-d: receives the scale
    n,  # number of elements
    amax_epsilon,  # lower bound of the amax the scale divides by
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    POWER_2: tl.constexpr,
):
    """amax as ``_quantize_kernel`` without q; the last program to finish turns it into the scale.

    Each program commits its max, then (after a barrier, so the commit of whichever thread made it
    comes first) counts itself done with an acq_rel atomic: the program that counts last sees every
    committed max, takes amax and zeroes both counters for the next launch on the stream (no other
    program touches them again), and writes amax and scale = fp8_max / max(amax, eps) by the catalog's rules.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    _amax_commit(counters_ptr, _finite_abs(x))
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        amax_bits = tl.atomic_xchg(counters_ptr, 0, sem="acquire")  # the final value, the counter zeroed
        tl.atomic_xchg(counters_ptr + 1, 0)
        amax = amax_bits.to(tl.float32, bitcast=True)
        tl.store(amax_ptr, amax)
        # the correctly rounded float32 quotient via float64, as in the delayed-scaling update; usable
        # amax on the bit pattern: 0 < amax < inf (finite by construction, a subnormal counts)
        usable = amax_bits > 0
        quotient = FP8_MAX / tl.where(usable, tl.maximum(amax, amax_epsilon), 1.0).to(tl.float64)
        scale = tl.minimum(quotient, 3.4028234663852886e38).to(tl.float32)  # overflow: float32 max
        scale = tl.where(usable, scale, 1.0)
        if POWER_2:  # 2^floor(log2(scale)): the exponent bits alone (every reachable scale is normal)
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        tl.store(scale_ptr, scale)


@cached_launch
@triton.jit
def _dequantize_kernel(
    q_ptr,  # *uint8 view of q, n elements
    x_ptr,  # *out_dtype, n elements
    scale_inv_ptr,  # *float32, one element
    n,  # number of elements
    BLOCK: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    code = tl.load(q_ptr + offs, mask=mask, other=0)
    x = _fp8_decode(code, MBITS, EBIAS, HW_CAST) * tl.load(scale_inv_ptr).to(tl.float32)
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous
    scale_ptr,  # *float32, one element
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale
    amax_ptr,  # *int32, 0-d, zeroed: receives the bits of max |x| (finite)
    partials_ptr,  # *float32 [cdiv(M, BLOCK_M), N], contiguous: column sums of each tile row (None without DBIAS)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DBIAS: tl.constexpr,  # also write this tile's column sums of x (the bias gradient's partials)
    WRITE_Q: tl.constexpr,  # False: only q_t (quantize_transposed); q_ptr is unused
    WRITE_QT: tl.constexpr,  # False: q_t is left to the caller (see _launch_cast_transpose)
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = ((pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    code = _fp8_encode(x * scale, FP8_MAX, MBITS, EBIAS, HW_CAST)
    if WRITE_Q:
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], code, mask=mask)
    if WRITE_QT:
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
    if DBIAS:  # column sums of the tile: masked lanes hold 0, NaN and inf propagate as in torch's sum
        tile_m = (pid // tiles_n).to(tl.int64)
        tl.store(partials_ptr + tile_m * N + cols, tl.sum(x, axis=0), mask=cols < N)
    _amax_commit(amax_ptr, tl.max(_finite_abs(x), axis=1))  # masked lanes hold 0
    _scale_inv_store(scale_inv_ptr, scale)


@cached_launch
@triton.jit
def _transpose_kernel(
    q_ptr,  # *uint8 [M, N], row stride stride_qm, unit column stride
    qt_ptr,  # *uint8 [N, M], contiguous
    M,  # rows of q
    N,  # columns of q
    stride_qm,  # elements between rows of q
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = ((pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tile = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0)
    tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


@triton.jit
def _update_columns(
    history_ptr, scale_ptr, fp8_max, history_new_ptr, scale_new_ptr, scale_inv_ptr, margin_scale, L, N,
    stride_hl, stride_hn, stride_s, stride_si, fp8_max_stride, block,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX_IS_PTR: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """The update of columns [block * BLOCK_N, (block + 1) * BLOCK_N) of one state (arguments as
    ``_delayed_scaling_update_kernel``'s)."""
    # IN_PLACE is race-free: a program owns its columns, and every row is read before any thread
    # writes it. Chunk c (rows [a, b)) is loaded, then a barrier, then stored to rows [a - 1, b - 1),
    # rows read by chunks <= c, each before its barrier; later chunks read rows >= b only, so load
    # prefetching cannot see a new value either. Row 0's value goes to row L - 1 after the loop (after
    # the last chunk's barrier, and no chunk stores row L - 1); s is read before the first barrier.
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    h0 = tl.load(history_ptr + cols * stride_hn, mask=col_mask, other=0.0).to(tl.float32)  # H[0]
    if IN_PLACE:  # H and s themselves, in the active columns only: H[0] != 0 on the bit pattern (NaN is
        # active; a float compare may flush a subnormal to zero on the GPU)
        stride_nl, stride_nn, stride_ns = stride_hl, stride_hn, stride_s
        active = col_mask & ((h0.to(tl.int32, bitcast=True) & 0x7FFFFFFF) != 0)
    else:  # new contiguous tensors, every column
        stride_nl, stride_nn, stride_ns = N, 1, 1
        active = col_mask
    s_old = tl.load(scale_ptr + cols * stride_s, mask=col_mask, other=1.0).to(tl.float32)
    if FP8_MAX_IS_PTR:
        fp8_max_v = tl.load(fp8_max + cols * fp8_max_stride, mask=col_mask, other=1.0)
    else:
        fp8_max_v = tl.zeros_like(h0) + fp8_max
    amax = h0
    nan_seen = amax != amax  # torch's max propagates NaN; tl.max may drop it
    for start in range(0, L, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        mask = (rows < L)[:, None] & col_mask[None, :]
        h = tl.load(history_ptr + rows[:, None] * stride_hl + cols[None, :] * stride_hn, mask=mask, other=0.0)
        h = h.to(tl.float32)
        if AMAX_MAX:
            amax = tl.maximum(amax, tl.max(tl.where(mask, h, float("-inf")), axis=0))
            nan_seen = nan_seen | (tl.max((h != h).to(tl.int32), axis=0) > 0)
        if IN_PLACE:
            tl.debug_barrier()  # every thread has read this chunk before any thread overwrites a row of it
        # roll by -1: H_new[l - 1] = H[l] for l >= 1 (H_new[0] = 0); H[0] goes to row L - 1 below
        dest = rows - 1
        store = (rows > 0)[:, None] & mask & active[None, :]
        tl.store(history_new_ptr + dest[:, None] * stride_nl + cols[None, :] * stride_nn,
                 tl.where(dest[:, None] == 0, 0.0, h), mask=store)  # fmt: skip
    tl.store(history_new_ptr + (L - 1) * stride_nl + cols * stride_nn, tl.where(L == 1, 0.0, h0), mask=active)
    # each float32 quotient is taken in float64 and rounded once: the correctly rounded float32 division
    # (53 >= 2 * 24 + 2 bits makes the double rounding innocuous), bit-identical to torch's on every
    # device, where Triton's float32 division was seen to differ by one ulp on the H200
    s_new = (fp8_max_v.to(tl.float64) / amax.to(tl.float64)).to(tl.float32)
    s_new = (s_new.to(tl.float64) / (tl.zeros_like(amax) + margin_scale).to(tl.float64)).to(tl.float32)
    # 0 < amax < inf on the bit pattern: a float compare may flush a subnormal amax to zero on the GPU
    amax_bits = amax.to(tl.int32, bitcast=True)
    valid = (amax_bits > 0) & (amax_bits < 0x7F800000) & ~nan_seen
    s_new = tl.where(valid, s_new, s_old)
    s_new = tl.where(tl.abs(s_new) == float("inf"), 3.4028234663852886e38, s_new)  # float32 max
    tl.store(scale_new_ptr + cols * stride_ns, s_new, mask=active)
    if IN_PLACE:  # scale_inv = 1 / s of every column (torch.reciprocal's correctly rounded float32)
        s_now = tl.where(active, s_new, s_old)
        tl.store(scale_inv_ptr + cols * stride_si, (1.0 / s_now.to(tl.float64)).to(tl.float32), mask=col_mask)

@cached_launch
@triton.jit
def _delayed_scaling_update_kernel(
    history_ptr,  # *H [L, N], strides (stride_hl, stride_hn), any float dtype (float32 when IN_PLACE)
    scale_ptr,  # *s [N], stride stride_s, any float dtype (float32 when IN_PLACE)
    fp8_max,  # float32 scalar; with FP8_MAX_IS_PTR a *float32 read at cols * fp8_max_stride
    history_new_ptr,  # *float32 [L, N] receiving H_new: a new contiguous tensor, or H itself when IN_PLACE
    scale_new_ptr,  # *float32 [N] receiving s_new: a new tensor, or s itself when IN_PLACE
    scale_inv_ptr,  # *float32 [N], stride stride_si: receives 1 / s (IN_PLACE only)
    margin_scale,  # float32 scalar: 2^margin
    L,  # rows of H (>= 1)
    N,  # columns of H
    stride_hl,  # elements between rows of H
    stride_hn,  # elements between columns of H
    stride_s,  # elements between entries of s
    stride_si,  # elements between entries of scale_inv
    fp8_max_stride,  # elements between entries of fp8_max: 0 (one value for all) or its stride
    BLOCK_L: tl.constexpr,  # rows per loop step
    BLOCK_N: tl.constexpr,  # columns per program
    AMAX_MAX: tl.constexpr,  # True: amax = max over the L rows ("max"); False: amax = H[0] ("most_recent")
    FP8_MAX_IS_PTR: tl.constexpr,
    IN_PLACE: tl.constexpr,  # True: delayed_scaling_update_ (idle rule, H and s overwritten, scale_inv written)
):
    _update_columns(history_ptr, scale_ptr, fp8_max, history_new_ptr, scale_new_ptr, scale_inv_ptr, margin_scale, L, N,
                    stride_hl, stride_hn, stride_s, stride_si, fp8_max_stride, tl.program_id(0),
                    BLOCK_L, BLOCK_N, AMAX_MAX, FP8_MAX_IS_PTR, IN_PLACE)  # fmt: skip


@cached_launch
@triton.jit
def _delayed_scaling_update_many_kernel(
    table_ptr,  # *int64 [S, 9], per state: the addresses of H, s, scale_inv; L, N; strides of H (2), s, scale_inv
    fp8_max,  # float32 scalar, every state's
    margin_scale,  # float32 scalar: 2^margin
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    AMAX_MAX: tl.constexpr,
):
    """``delayed_scaling_update_`` of state program_id(1), columns of block program_id(0) (in place)."""
    row = table_ptr + tl.program_id(1) * 9
    n = tl.load(row + 4)
    if tl.program_id(0) * BLOCK_N < n:
        history = tl.load(row).to(tl.pointer_type(tl.float32))
        scale = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        scale_inv = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        _update_columns(history, scale, fp8_max, history, scale, scale_inv, margin_scale, tl.load(row + 3), n,
                        tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8), 0, tl.program_id(0),
                        BLOCK_L, BLOCK_N, AMAX_MAX, False, True)  # fmt: skip


def _check_scale_args(x, scale, fp8_dtype, amax_out) -> None:
    check_high_precision(x)
    check_scalar(scale, "scale")
    check_fp8_dtype(fp8_dtype)
    check_amax_out(amax_out, x)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (any row stride works), else a contiguous copy."""
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[-1] else t.contiguous()


def _launch_quantize(x: torch.Tensor, scale, fp8_dtype, write_q: bool, amax_out=None):
    """Run ``_quantize_kernel`` on x (any shape); returns the Fp8Outputs (q unused without write_q)."""
    x_flat = x.contiguous().view(-1)
    out = fp8_outputs(x.shape if write_q else (0,), fp8_dtype, x.device, amax_out)
    fmt = out.fmt.constexprs(hw_fp8_cast(x.device)) if write_q else NO_FP8
    scale_arg = scale if write_q else out.scale_inv
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _quantize_kernel[(max(1, cdiv(x_flat.numel(), _BLOCK)),)](
            x_flat, out.q_bits, scale_arg, out.scale_inv, out.amax_bits, x_flat.numel(),
            BLOCK=_BLOCK, WRITE_Q=write_q, num_warps=8, **fmt,
        )  # fmt: skip
    return out


def quantize(x, scale, fp8_dtype, amax_out=None):
    """q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)), scale_inv = 1 / scale, amax = max |x| (finite).

    Args:
        x: float32/bfloat16/float16 tensor of any shape.
        scale: one-element float32 tensor on x's device.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: None, or a float32 slot on x's device holding a value >= 0: the kernel's atomic
            max lands there (amax_out = max(amax_out, amax)) and it is returned as amax.

    Returns:
        (q with x's shape in ``fp8_dtype``, scale_inv 0-d float32, amax 0-d float32).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad scale or fp8_dtype.
    """
    _check_scale_args(x, scale, fp8_dtype, amax_out)
    out = _launch_quantize(x, scale, fp8_dtype, write_q=True, amax_out=amax_out)
    return out.q, out.scale_inv, out.amax


def compute_amax(x):
    """amax = max |x| over the finite elements of x, a 0-d float32 tensor (0 for an empty x).

    Raises:
        TypeError: x is not a high-precision float tensor.
    """
    check_high_precision(x)
    return _launch_quantize(x, None, torch.float8_e4m3fn, write_q=False).amax


def current_scale(x, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """(scale, amax) of current scaling in one launch (see ``_current_scale_kernel`` and the catalog).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad fp8_dtype or amax_epsilon.
    """
    check_high_precision(x)
    check_fp8_dtype(fp8_dtype)
    check_amax_epsilon(amax_epsilon)
    x_flat = x.contiguous().view(-1)
    scale, amax = torch.empty(2, dtype=torch.float32, device=x.device)  # both written by the kernel: no fill
    with device_guard(x):  # one program even for an empty x: it writes amax (0) and the scale (1)
        _current_scale_kernel[(max(1, cdiv(x_flat.numel(), _BLOCK)),)](
            x_flat, stream_counters(x.device), amax, scale, x_flat.numel(), float(amax_epsilon),
            BLOCK=_BLOCK, FP8_MAX=fp8_format(fp8_dtype).fp8_max, POWER_2=bool(power_2_scale), num_warps=8,
        )  # fmt: skip
    return scale, amax


def dequantize(q, scale_inv, out_dtype):
    """x = q * scale_inv in float32, cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8. ValueError: scale_inv is not one element or out_dtype not a float dtype.
    """
    check_tensor(q, "q")
    if not is_fp8(q):
        raise TypeError(f"q has dtype {q.dtype}; it must be torch.float8_e4m3fn or torch.float8_e5m2")
    check_scalar(scale_inv, "scale_inv")
    check_out_dtype(out_dtype)
    codes = q.contiguous().view(torch.uint8).view(-1)
    x = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    fmt = fp8_format(q.dtype)
    if codes.numel():
        with device_guard(q):
            _dequantize_kernel[(cdiv(codes.numel(), _BLOCK),)](
                codes, x.view(-1), scale_inv, codes.numel(), BLOCK=_BLOCK,
                MBITS=fmt.mbits, EBIAS=fmt.ebias, HW_CAST=hw_fp8_cast(q.device), num_warps=8,
            )  # fmt: skip
    return x


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}; reshape it to 2-D first")


def _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias: bool, rowwise: bool = True):
    """Validate, then run ``_cast_transpose_kernel`` on x [M, N].

    Returns:
        (Fp8Outputs, q_t [N, M], partials): the outputs' q is empty without ``rowwise`` (only q_t
        written); partials is float32 [cdiv(M, _CT_TILE_M), N], row t holding the column sums of tile
        row t, with ``dbias``; None without.
    """
    _check_scale_args(x, scale, fp8_dtype, amax_out)
    _check_2d(x, "x")
    x = _rows_contiguous(x)
    m, n = x.shape
    # float32 x on the GPU: Triton 3.6 wrote a wrong q_t on sm_90 when transposing the 8-bit tile of
    # 32-bit loads (full tiles; found on the H200, see the gpu test), so q_t is made from q afterwards
    transpose_after = x.dtype == torch.float32 and x.is_cuda and not INTERPRET
    write_q = rowwise or transpose_after
    out = fp8_outputs((m, n) if write_q else (0,), fp8_dtype, x.device, amax_out)
    q_t = None if transpose_after else torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    partials = torch.empty((cdiv(m, _CT_TILE_M), n), dtype=torch.float32, device=x.device) if dbias else None
    write_partials = partials is not None and partials.numel() > 0  # an empty x: its column sums are 0 already
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _cast_transpose_kernel[(max(1, cdiv(m, _CT_TILE_M) * cdiv(n, _CT_TILE_N)),)](
            x, out.q_bits, out.q_bits if q_t is None else q_t.view(torch.uint8),  # unused without WRITE_Q / WRITE_QT
            scale, out.scale_inv, out.amax_bits, partials, m, n, x.stride(0),
            BLOCK_M=_CT_TILE_M, BLOCK_N=_CT_TILE_N, DBIAS=write_partials, num_warps=4,
            WRITE_Q=write_q, WRITE_QT=not transpose_after,
            **out.fmt.constexprs(hw_fp8_cast(x.device)),
        )  # fmt: skip
    if q_t is None:
        q_t = fp8_transpose(out.q)
    return out, q_t, partials


def cast_transpose(x, scale, fp8_dtype, amax_out=None):
    """q = quantize(x) and its contiguous transpose q_t, from one read of x.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride).
        scale, fp8_dtype, amax_out: as :func:`quantize`.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax) as in :func:`quantize`.

    Raises:
        TypeError / ValueError: as :func:`quantize`, or x not 2-D.
    """
    out, q_t, _ = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=False)
    return out.q, q_t, out.scale_inv, out.amax


def quantize_transposed(x, scale, fp8_dtype, amax_out=None):
    """Only the transposed half of :func:`cast_transpose`: q_t = quantize(x)^T, the row-major q never written.

    Args / Raises: as :func:`cast_transpose`.

    Returns:
        (q_t [N, M], scale_inv, amax) as in :func:`quantize`.
    """
    out, q_t, _ = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=False, rowwise=False)
    return q_t, out.scale_inv, out.amax


def cast_transpose_dbias(x, scale, fp8_dtype, amax_out=None):
    """:func:`cast_transpose` plus the bias gradient dbias[j] = sum_i x[i, j] in float32, from one read of x.

    The kernel writes each tile row's column sums (tiles of _CT_TILE_M = 128 rows); ``column_sums`` adds
    the cdiv(M, 128) partial rows in a fixed order (no atomics: the result is deterministic).

    Args:
        x: [M, N] float32/bfloat16/float16, dy of a linear layer (rows may be strided).
        scale, fp8_dtype, amax_out: as :func:`quantize`.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax, dbias float32 [N]); NaN / inf propagate into dbias.

    Raises:
        TypeError / ValueError: as :func:`cast_transpose`.
    """
    out, q_t, partials = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=True)
    return out.q, q_t, out.scale_inv, out.amax, column_sums(partials, torch.float32)[0]


def fp8_transpose(q):
    """Contiguous transpose of a 2-D FP8 tensor, no rescaling: q_t[j, i] = q[i, j].

    Raises:
        TypeError: q is not FP8. ValueError: q is not 2-D.
    """
    check_tensor(q, "q")
    if not is_fp8(q):
        raise TypeError(f"q has dtype {q.dtype}; it must be torch.float8_e4m3fn or torch.float8_e5m2")
    _check_2d(q, "q")
    codes = _rows_contiguous(q).view(torch.uint8)
    m, n = codes.shape
    q_t = torch.empty((n, m), dtype=q.dtype, device=q.device)
    if q.numel():
        with device_guard(q):
            grid = (cdiv(m, _TILE) * cdiv(n, _TILE),)
            _transpose_kernel[grid](codes, q_t.view(torch.uint8), m, n, codes.stride(0), BLOCK_M=_TILE, BLOCK_N=_TILE)
    return q_t


def _fp8_max_arg(fp8_max, device: torch.device, n: int):
    """(kernel argument, stride) for fp8_max: a float as is, a tensor as float32 [1 or n] on ``device``."""
    if not isinstance(fp8_max, torch.Tensor):
        return float(fp8_max), 0
    vector = fp8_max.to(device=device, dtype=torch.float32).reshape(-1)
    return vector, (vector.stride(0) if vector.numel() == n else 0)


def delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo):
    """One delayed-scaling step for N tensors in one launch: s_new = (fp8_max / amax) / 2^margin, then roll H.

    amax = max over the L rows of H ("max") or H[0] ("most_recent"), read before the roll; s_new keeps
    the old s where amax is not finite or <= 0; +-inf becomes float32 max; H_new = roll(H, -1, dim 0)
    with row 0 zeroed. Bit-identical to the reference backend.

    Args:
        amax_history: H [L, N] (any strides); row 0 holds this step's amaxes.
        scale: s [N] on H's device.
        fp8_max: float, or float32 tensor of 1 or N elements.
        margin: float.
        amax_compute_algo: "max" or "most_recent".

    Returns:
        (H_new [L, N], s_new [N]), new float32 tensors.

    Raises:
        ValueError: shapes that do not match, a non-finite margin or an unknown amax_compute_algo.
    """
    check_delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo)
    length, n = amax_history.shape
    history_new = torch.empty((length, n), dtype=torch.float32, device=amax_history.device)
    scale_new = torch.empty(n, dtype=torch.float32, device=amax_history.device)
    if n == 0:
        return history_new, scale_new
    _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, (history_new, scale_new, None))
    return history_new, scale_new


def delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo) -> None:
    """The catalog's ``delayed_scaling_update_`` (H, s and scale_inv of the active columns, in place; H
    may have any strides) in one launch of ``delayed_scaling_update``'s kernel (IN_PLACE), bit-identical
    to the reference backend's. Raises as the reference backend does (float32 tensors, matching shapes
    and devices, a finite margin, a known amax_compute_algo)."""
    check_delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo)
    if amax_history.shape[1]:
        _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, (amax_history, scale, scale_inv))



def delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo) -> None:
    """The catalog's ``delayed_scaling_update_many_``: every state's in-place update in one launch of
    ``_delayed_scaling_update_many_kernel``, which reads the states' addresses, sizes and strides from a
    device table (built and checked once per layout, see :mod:`._tables`). Inside a CUDA-graph capture
    that meets a new layout, one ``delayed_scaling_update_`` launch per state. Bit-identical to the
    reference backend; raises as it does."""
    check_update_lists(amax_histories, scales, scale_invs)  # (each call: the table's key does not cover these)
    check_shared_update_args(fp8_max, margin, amax_compute_algo)
    states = list(zip(amax_histories, scales, scale_invs))
    if not states:
        return
    device = amax_histories[0].device
    key = tuple((h.data_ptr(), h.dtype, h.device, h.shape, h.stride(), s.data_ptr(), s.dtype, s.device, s.shape, s.stride(),
                 i.data_ptr(), i.dtype, i.device, i.shape, i.stride()) for h, s, i in states)

    def build() -> torch.Tensor:
        check_delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo)
        rows = [[h.data_ptr(), s.data_ptr(), i.data_ptr(), *h.shape, *h.stride(), s.stride(0), i.stride(0)] for h, s, i in states]
        return torch.tensor(rows, dtype=torch.int64, device=device)

    table = _STATE_TABLES.get(key, build, device)
    if table is None:  # a new layout inside a capture
        for state in states:
            delayed_scaling_update_(*state, fp8_max, margin, amax_compute_algo)
        return
    length, n = max(h.shape[0] for h in amax_histories), max(h.shape[1] for h in amax_histories)
    if n == 0:
        return
    block_n = min(_UPDATE_COLS, next_power_of_2(n))
    with device_guard(amax_histories[0]):
        _delayed_scaling_update_many_kernel[(cdiv(n, block_n), len(states))](
            table, float(fp8_max), 2.0 ** float(margin),
            BLOCK_L=min(next_power_of_2(length), _UPDATE_TILE // block_n), BLOCK_N=block_n, AMAX_MAX=amax_compute_algo == "max",
        )  # fmt: skip

def _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, outputs) -> None:
    """One launch of ``_delayed_scaling_update_kernel`` on checked arguments with N > 0.

    ``outputs`` = (H_new, s_new, None): new contiguous float32 tensors; or (H, s, scale_inv): in place.
    """
    history_new, scale_new, scale_inv = outputs
    length, n = amax_history.shape
    fp8_max_arg, fp8_max_stride = _fp8_max_arg(fp8_max, amax_history.device, n)
    block_n = min(_UPDATE_COLS, next_power_of_2(n))
    block_l = min(next_power_of_2(length), _UPDATE_TILE // block_n)
    in_place = scale_inv is not None
    with device_guard(amax_history):
        _delayed_scaling_update_kernel[(cdiv(n, block_n),)](
            amax_history, scale, fp8_max_arg, history_new, scale_new, scale_inv if in_place else scale_new,
            2.0 ** float(margin), length, n, amax_history.stride(0), amax_history.stride(1), scale.stride(0),
            scale_inv.stride(0) if in_place else 0, fp8_max_stride,
            BLOCK_L=block_l, BLOCK_N=block_n, AMAX_MAX=amax_compute_algo == "max",
            FP8_MAX_IS_PTR=isinstance(fp8_max_arg, torch.Tensor), IN_PLACE=in_place,
        )  # fmt: skip


# ---------------------------------------------------------------- block scaling


def _blockwise_tiles(block_rows, block_cols):
    """True for 1 x B and B x B tiles with B a power of two in [16, 256], else a Reject saying so."""
    if type(block_cols) is int and block_cols in _BLOCK_LENS and type(block_rows) is int and block_rows in (1, block_cols):
        return True
    return Reject(
        f"{block_rows!r} x {block_cols!r} tiles: the flagos kernels take 1 x B or B x B tiles with B a power of two "
        "in [16, 256] (Float8BlockScaling uses 1 x 128 and 128 x 128); the reference backend runs any other tile"
    )


def _eps_bits(amax_epsilon) -> int:
    """The int32 bit pattern of amax_epsilon rounded to float32, as the reference's clamp rounds it."""
    check_amax_epsilon(amax_epsilon)
    return struct.unpack("<i", struct.pack("<f", float(amax_epsilon)))[0]


def _check_blockwise(x, fp8_dtype, block_rows, block_cols, amax_epsilon) -> int:
    """Validate a blockwise cast before any work; returns the bits of amax_epsilon."""
    check_high_precision(x)
    _check_2d(x, "x")
    check_fp8_dtype(fp8_dtype)
    tiles = _blockwise_tiles(block_rows, block_cols)
    if not tiles:
        raise ValueError(tiles.reason)
    return _eps_bits(amax_epsilon)


def _blockwise_warps(elements: int, per_thread: int) -> int:
    """num_warps of a program holding ``elements`` values, ``per_thread`` each: a power of two in [2, 16]."""
    return min(16, max(2, next_power_of_2(cdiv(elements, 32 * per_thread))))


def _column_major_scales(blocks: int, rows: int, device) -> torch.Tensor:
    """float32 scale_inv [rows, blocks] on column-major storage [blocks, rows] (what 1 x B kernels write)."""
    return torch.empty((blocks, rows), dtype=torch.float32, device=device).t()


def quantize_blockwise(x, fp8_dtype, block_rows, block_cols, power_2_scale, amax_epsilon):
    """Block-scaled FP8 cast, one scale per ``block_rows x block_cols`` tile: q = cast_fp8(clip(T * scale_T)).

    scale_T = fp8_max / max(max |T|, eps) (1 when that is 0 or not finite, float32 max on overflow),
    rounded down to a power of two with ``power_2_scale``; bit-identical to the reference backend.
    1 x B tiles: a program quantizes W = _BLOCKWISE_ROW columns (fewer for a narrow x) of
    _BLOCKWISE_ROW_TILE / W rows, wide rows for long contiguous runs; B x B tiles: as many side by
    side as fill _BLOCKWISE_TILE values (at least one). B x B tiles of a column-major x (x = w^T, e.g.
    a weight's transpose for dgrad) are read from w row by row, one tile per program, and stored
    transposed: no copy of x, no separate FP8 transpose.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride; any other
            layout is copied first, except the column-major x of B x B tiles).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        block_rows, block_cols: 1 x B or B x B, B a power of two in [16, 256].
        power_2_scale: round each scale down to a power of two.
        amax_epsilon: float >= 0, lower bound of each tile's amax.

    Returns:
        (q [M, N] in ``fp8_dtype``, scale_inv float32 [cdiv(M, block_rows), cdiv(N, block_cols)]):
        scale_inv is column-major (strides (1, M)) for 1 x B tiles, row-major for B x B tiles.

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: x not 2-D, another tile shape,
        a bad fp8_dtype or a negative amax_epsilon.
    """
    eps_bits = _check_blockwise(x, fp8_dtype, block_rows, block_cols, amax_epsilon)
    square, b = block_rows != 1, block_cols
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    if square:
        scale_inv = torch.empty((cdiv(m, b), cdiv(n, b)), dtype=torch.float32, device=x.device)
    else:
        scale_inv = _column_major_scales(cdiv(n, b), m, x.device)
    if square and x.stride(0) == 1 and x.stride(1) >= m and n > 1:  # x = w^T of a row-major w: read w
        _launch_quantize_blockwise(x.t(), q, scale_inv, square, b, power_2_scale, eps_bits, transposed=True)
    else:
        _launch_quantize_blockwise(_rows_contiguous(x), q, scale_inv, square, b, power_2_scale, eps_bits)
    return q, scale_inv


def _launch_quantize_blockwise(x, q, scale_inv, square: bool, block_len: int, power_2_scale, eps_bits: int, transposed: bool = False) -> None:
    """Run _quantize_blockwise_kernel on x [M, N] (unit column stride) into q [M, N] and scale_inv.

    scale_inv as quantize_blockwise returns it (storage [cdiv(N, B), M] for 1 x B, [cdiv(M, B), cdiv(N, B)]
    for B x B); the tile per program as quantize_blockwise describes. ``transposed`` (B x B only): q [N, M]
    and scale_inv [cdiv(N, B), cdiv(M, B)] receive the quantization of x^T, one tile per program.
    """
    (m, n), b = x.shape, block_len
    if square:
        groups = 1 if transposed else max(1, min(_BLOCKWISE_TILE // (b * b), next_power_of_2(cdiv(n, b))))
        block_m, per_thread = b, _BLOCKWISE_PER_THREAD
    else:
        groups = max(b, min(_BLOCKWISE_ROW, next_power_of_2(n))) // b
        block_m = max(1, min(_BLOCKWISE_ROW_TILE // (groups * b), next_power_of_2(m)))
        per_thread = _BLOCKWISE_ROW_PER_THREAD
    if q.numel():
        with device_guard(x):
            _quantize_blockwise_kernel[(cdiv(m, block_m) * cdiv(n, groups * b),)](
                x, q.view(torch.uint8), scale_inv, m, n, x.stride(0), eps_bits,
                BLOCK_M=block_m, GROUPS=groups, B=b, SQUARE=square, TRANSPOSED=transposed, POW2=bool(power_2_scale),
                num_warps=_blockwise_warps(block_m * groups * b, per_thread),
                **fp8_format(q.dtype).constexprs(hw_fp8_cast(x.device)),
            )  # fmt: skip


def _ct_blockwise_tile_n(n: int, block_len: int) -> int:
    """Columns per program of the cast_transpose_blockwise kernel: its mode's setting, shrunk to x's width.

    Split: _CT_BLOCKWISE_COL_TILE (at least 16); fused: _CT_BLOCKWISE_TILE_N (at least B, so a multiple of B).
    """
    if _CT_BLOCKWISE_SPLIT:
        return max(16, min(_CT_BLOCKWISE_COL_TILE, next_power_of_2(n)))
    return max(block_len, min(_CT_BLOCKWISE_TILE_N, next_power_of_2(n)))


def _transpose_codes(x: torch.Tensor) -> bool:
    """Whether cast_transpose_blockwise may transpose 8-bit codes (not the values) for this x.

    float32 x on the GPU: Triton 3.6 wrote a wrong transposed tile on sm_90 when transposing 8-bit codes
    computed from 32-bit loads (see _launch_cast_transpose), so it transposes the values.
    """
    return _CT_BLOCKWISE_CODES and not (x.dtype == torch.float32 and x.is_cuda and not INTERPRET)


def cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """1 x ``block_len`` block-scaled FP8 casts of x and of x^T.

    (q, scale_inv) = quantize_blockwise(x, 1 x B), (q_t, scale_inv_t) = quantize_blockwise(x^T, 1 x B).
    Split (the default, _CT_BLOCKWISE_SPLIT): quantize_blockwise gives (q, scale_inv), then a kernel
    quantizes the columns of [B, _CT_BLOCKWISE_COL_TILE] tiles of x (x read twice, both passes
    streaming). Fused: one kernel loads [B, _CT_BLOCKWISE_TILE_N] tiles once and quantizes their rows
    and their columns (measured slower on the H200: its registers spill; kept for other GPUs' sweeps).
    The tile kernel is persistent (_CT_BLOCKWISE_PROGRAMS_PER_SM programs per SM, each loading its next
    tile before it quantizes the current one). The columns' codes are transposed as 8-bit codes
    (16-bit x) or the values are transposed first (float32 x on the GPU). Bit-identical to the
    reference backend.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride).
        fp8_dtype, power_2_scale, amax_epsilon: as :func:`quantize_blockwise`.
        block_len: B, a power of two in [16, 256].

    Returns:
        (q [M, N], scale_inv [M, cdiv(N, B)], q_t [N, M], scale_inv_t [N, cdiv(M, B)]); both scale_inv
        are float32 column-major (strides (1, M) and (1, N)).

    Raises:
        TypeError / ValueError: as :func:`quantize_blockwise`.
    """
    return _launch_cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias=False)[:4]


def cast_transpose_blockwise_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """:func:`cast_transpose_blockwise` plus the bias gradient dbias[j] = sum_i x[i, j] in float32.

    The column kernel also writes each B-row tile's column sums; ``column_sums`` adds the cdiv(M, B)
    partial rows in a fixed order (deterministic, no atomics).

    Returns:
        (q, scale_inv, q_t, scale_inv_t, dbias float32 [N]); NaN / inf propagate into dbias.

    Raises:
        TypeError / ValueError: as :func:`quantize_blockwise`.
    """
    *casts, partials = _launch_cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias=True)
    return (*casts, column_sums(partials, torch.float32)[0])


def _launch_cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias: bool):
    """(q, scale_inv, q_t, scale_inv_t, float32 column sums of each B-row tile [cdiv(M, B), N] or None)."""
    eps_bits = _check_blockwise(x, fp8_dtype, 1, block_len, amax_epsilon)
    x = _rows_contiguous(x)
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    scale_inv = _column_major_scales(cdiv(n, block_len), m, x.device)
    if _CT_BLOCKWISE_SPLIT:
        _launch_quantize_blockwise(x, q, scale_inv, False, block_len, power_2_scale, eps_bits)
    q_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    scale_inv_t = _column_major_scales(cdiv(m, block_len), n, x.device)
    partials = torch.empty((cdiv(m, block_len), n), dtype=torch.float32, device=x.device) if dbias else None  # every tile writes its row
    tile_n = _ct_blockwise_tile_n(n, block_len)
    if q.numel():
        with device_guard(x):
            tiles = cdiv(m, block_len) * cdiv(n, tile_n)
            _cast_transpose_blockwise_kernel[(min(tiles, num_programs_hint(x.device, _CT_BLOCKWISE_PROGRAMS_PER_SM)),)](
                x, q.view(torch.uint8), scale_inv, q_t.view(torch.uint8), scale_inv_t, scale_inv_t if partials is None else partials,
                m, n, x.stride(0), eps_bits, TILE_N=tile_n, B=block_len, ROWS=not _CT_BLOCKWISE_SPLIT, DBIAS=dbias,
                TRANSPOSE_CODES=_transpose_codes(x), POW2=bool(power_2_scale),
                num_warps=_blockwise_warps(block_len * tile_n, _CT_BLOCKWISE_PER_THREAD),
                **fp8_format(fp8_dtype).constexprs(hw_fp8_cast(x.device)),
            )  # fmt: skip
    return q, scale_inv, q_t, scale_inv_t, partials


def _scale_on_device(x, scale, fp8_dtype, amax_out=None):
    """Reject a scale the kernels would misread: not float32, or on another device than x."""
    if isinstance(scale, torch.Tensor) and isinstance(x, torch.Tensor):
        if scale.dtype != torch.float32 or scale.device != x.device:
            return Reject(f"scale must be float32 on {x.device}, got {scale.dtype} on {scale.device}")
    return True


def _scale_inv_on_device(q, scale_inv, out_dtype):
    """Reject a scale_inv that is not float32 on q's device."""
    if isinstance(scale_inv, torch.Tensor) and isinstance(q, torch.Tensor):
        if scale_inv.dtype != torch.float32 or scale_inv.device != q.device:
            return Reject(f"scale_inv must be float32 on {q.device}, got {scale_inv.dtype} on {scale_inv.device}")
    return True


def _on_history_device(amax_history, named_tensors):
    """Reject any (name, tensor) on another device than the history (the kernel reads them all)."""
    for name, t in named_tensors:
        if isinstance(t, torch.Tensor) and isinstance(amax_history, torch.Tensor) and t.device != amax_history.device:
            return Reject(f"{name} must be on the history's device {amax_history.device}, got {t.device}")
    return True


def _scale_with_history(amax_history, scale, fp8_max, margin, amax_compute_algo):
    """Reject a scale on another device than the history."""
    return _on_history_device(amax_history, (("scale", scale),))


def _scales_with_history(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo):
    """Reject a scale or scale_inv on another device than the history."""
    return _on_history_device(amax_history, (("scale", scale), ("scale_inv", scale_inv)))


def _supported_tiles(x, fp8_dtype, block_rows, block_cols, power_2_scale, amax_epsilon):
    """Decline tiles other than 1 x B and B x B, B a power of two in [16, 256] (the reference runs them)."""
    return _blockwise_tiles(block_rows, block_cols)


def _supported_block_len(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """Decline a block_len that is not a power of two in [16, 256] (the reference runs it)."""
    return _blockwise_tiles(1, block_len)


SUPPORTS = {
    "quantize": _scale_on_device,
    "cast_transpose": _scale_on_device,
    "quantize_transposed": _scale_on_device,
    "cast_transpose_dbias": _scale_on_device,
    "dequantize": _scale_inv_on_device,
    "delayed_scaling_update": _scale_with_history,
    "delayed_scaling_update_": _scales_with_history,
    "quantize_blockwise": _supported_tiles,
    "cast_transpose_blockwise": _supported_block_len,
    "cast_transpose_blockwise_dbias": _supported_block_len,
}
# under torch.compile the cast with its bias gradient stays this kernel, traced as it is (Inductor launches
# it): the reference's amax (a row reduction) and column sums of one tensor, fused by Inductor with the
# activation gradient before them, became one persistent kernel of 0.72 ms at [8192, 4096] on an H100
# (torch 2.11), ten times this kernel's time; as a custom op each call pays the dispatcher's host time
UNDER_COMPILE = {"cast_transpose_dbias": "trace"}
