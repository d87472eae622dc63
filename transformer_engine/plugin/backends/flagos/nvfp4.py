"""NVFP4 in Triton: quantize_nvfp4 (contract and math: plugin/catalog/nvfp4.py; oracle: the reference backend's
nvfp4.py, which these kernels match bit for bit). dequantize_nvfp4 and gemm_nvfp4: :mod:`.nvfp4_gemm`.
4over6 (``four_over_six``) and its E4M3 bound 256 are not implemented here: the ``SUPPORTS`` predicates decline
them, so the dispatcher runs the reference backend.

Per copy v [R, C] (x, or x^T / RHT(x^T) for the column-wise one), each step one float32 operation:

    amax    = max |v|, NaN ignored, +-inf counted;  S_enc = min(2688 / amax, fp32_max) (1 for 0 / inf);  S_dec = 1 / S_enc
    s       = cast_e4m3(min((b_amax / 6) * S_enc, 448));  enc = min(1 / (s * S_dec), fp32_max)
    q       = e2m1(clip(v * enc, -6, 6))                   (nearest-even, or stochastic: up iff bits >> 8 < frac * 2^24)
    x_hat   = q * ((s * amax) * fp32(1 / 2688))

Two passes over x. ``_nvfp4_amax_kernel`` reduces both copies' amaxes (one relaxed int32 atomic max per
program and amax on the bit patterns: for non-negative floats the int order is the float order).
``_nvfp4_cast_kernel`` takes a block of 16 rows x BC columns: the row-wise copy from it as Triton loads it
(vectorized, blocks along the rows), the column-wise copy from the same block re-read with one column per
lane (an L1 hit), so a lane holds whole column blocks: their amax, RHT, scale and 16 codes (packed into
one int64 store) are register arithmetic, with no transpose through shared memory.

How the kernels stay bit-identical to the reference:

- maxima run on int32 bit patterns (NaN mapped to 0), so no subnormal flushing can move them;
- divisions are correctly rounded with subnormals kept (PTX div.rn.f32, or float64 rounded once for the
  per-tensor S_enc / S_dec: Triton's float32 division is approximate and its libdevice one flushes
  subnormals, see _blockwise.py); products are plain float32 multiplications (no add follows them, so
  nothing fuses into an FMA);
- the E4M3 cast is ``_fp8_encode``; E2M1 rounding works on the bit pattern of |y| (nearest: ties to the
  even code, as the grid's midpoints; stochastic: the reference's fraction, exact); stochastic rounding
  hashes the element's row-major index in its copy exactly as the reference (lowbias32 in uint32
  arithmetic, key h(seed_lo ^ h(seed_hi ^ copy)));
- bfloat16 is widened and rounded on its bits (``_to_float32``, ``_bf16_bits``), identically on the GPU and
  in Triton's interpreter (whose bfloat16 casts truncate and mishandle subnormals);
- RHT: v @ (D H16) / 4 per 16 elements, as a radix-2 butterfly in float64, rounded to float32 then to x's
  dtype (the reference rounds its float64 product the same way: float64 -> float32 -> dtype). Each output
  is a signed sum of 16 terms x_k / 4, exact in float64 whenever the block's magnitudes span fewer than
  2^(53 - p - 4) (p: x's significand bits): always for float16, 2^41 for bfloat16, 2^25 for float32. Past
  that both sides round a float64 sum in their own order (the reference's BLAS order is unspecified) and
  may differ where that sum sits within a float64 ulp of a float32 rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._nvfp4_checks import check_quantize_nvfp4
from transformer_engine.plugin.core import Reject

from ._common import INTERPRET, _fp8_decode, _fp8_encode, cdiv, device_guard, hw_fp8_cast, rows_contiguous
from ._emulated import _bf16_bits, _magnitude_bits, _to_float32, on_device
from ._launch import cached_launch

__all__ = ["quantize_nvfp4"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_RHT_SIGN_MASK = tl.constexpr(0xD7E8)  # bit k set where TE's RHT sign k is -1
_INTERPRET = tl.constexpr(INTERPRET)
# warps of the quantize kernels; a program takes 16 rows and 32 columns per warp (one column per lane)
_AMAX_WARPS = 4
_AMAX_ROW_BLOCKS = 8  # 128 rows per amax program: few atomics on the two amax words
_CAST_WARPS = 4


# -- element helpers ---------------------------------------------------------------------------------
@triton.jit
def _round_to(y, DTYPE: tl.constexpr):
    """float32 y rounded to DTYPE (nearest even) and widened back."""
    if DTYPE == tl.bfloat16:
        y = _bf16_bits(y).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rht_rows(v, BC: tl.constexpr, DTYPE: tl.constexpr):
    """y[i, c] = sum_k v[k, c] (D H16)[k, i] / 4 for v [16, BC] (float32): the RHT of each column, in DTYPE's values.

    H16 = H2 (x) H2 (x) H2 (x) H2 (Sylvester), applied as four radix-2 stages in float64: each splits the
    pairs of rows differing in the lowest index bit, writes (u + z, u - z) and rotates the index bits right by
    one (join, then the pair axis moved first), so after four stages every bit is transformed and back in place.
    With the rows in one lane's registers (_load_columns) it is register arithmetic. A zero sum is +0, as the
    reference's float64 GEMM gives (a -0 term can leave -0 here).
    """
    k = tl.arange(0, 16)
    signs = (1 - 2 * ((tl.full([16], _RHT_SIGN_MASK, tl.int32) >> k) & 1)).to(tl.float64)
    w = v.to(tl.float64) * signs[:, None]
    for _ in tl.static_range(4):
        u, z = tl.split(tl.permute(tl.reshape(w, [8, 2, BC]), [0, 2, 1]))
        w = tl.reshape(tl.permute(tl.join(u + z, u - z), [2, 0, 1]), [16, BC])
    y = tl.where(w == 0.0, 0.0, w * 0.25).to(tl.float32)
    return _round_to(y, DTYPE)


@triton.jit
def _lowbias32(h):
    """lowbias32 on uint32: h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16 (mod 2^32)."""
    h = h ^ (h >> 16)
    h = h * tl.full([], 0x7FEB352D, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full([], 0x846CA68B, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _sr_key(seed_ptr, COPY: tl.constexpr):
    """h(seed_lo ^ h(seed_hi ^ copy)) of the int64 seed at seed_ptr."""
    seed = tl.load(seed_ptr)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _lowbias32(seed_lo ^ _lowbias32(seed_hi ^ COPY))


@triton.jit
def _e2m1_codes(y, index, key, SR: tl.constexpr):
    """E2M1 codes (int32, sign << 3 | k) of float32 y after saturation to +-6; NaN -> 7 (+6), -0 keeps its sign.

    On m = min(|y|, 6) = 2^e (1 + f): for m >= 1 the code is 2 + 2e + (f's first bit), so k comes from the
    bit pattern rounded to one mantissa bit (nearest, ties to even: the grid's midpoints tie to the even
    code); below 1 the grid is 0, 0.5, 1 (k = round_half_even(2 m)). Stochastic: k = lo + 1 iff
    (h(index ^ key) >> 8) < ((m - lo) / (hi - lo)) * 2^24 with lo = m cut to one mantissa bit (floor(2 m) / 2
    below 1) and hi - lo = 2^(e - 1) (0.5 below 1); m - lo and the scaling are exact (Sterbenz, powers of two).
    """
    m = tl.minimum(tl.abs(y), 6.0)
    bits = m.to(tl.int32, bitcast=True)
    normal = m >= 1.0
    if SR:
        half = (m >= 0.5).to(tl.int32)
        k = tl.where(normal, (bits >> 22) - 252, half)
        lo = tl.where(normal, (bits & -4194304).to(tl.float32, bitcast=True), half.to(tl.float32) * 0.5)
        inv_step = tl.where(normal, ((255 - (bits >> 23)) << 23).to(tl.float32, bitcast=True), 2.0)
        draw = _lowbias32(index ^ key) >> 8
        k += (draw.to(tl.float32) < ((m - lo) * inv_step) * 16777216.0).to(tl.int32)
    else:
        rounded = bits + 0x1FFFFF + ((bits >> 22) & 1)
        k = tl.where(normal, (rounded >> 22) - 252, (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32))
    code = k | ((y.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(y == y, code, 7)


# -- one copy --------------------------------------------------------------------------------------
@triton.jit
def _div_rn(a, b):
    """a / b in float32, correctly rounded with subnormals kept: PTX div.rn.f32 (Triton's own float32 division is
    approximate, its libdevice one flushes subnormals); numpy's division in the interpreter."""
    if _INTERPRET:
        return a / b
    return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _global_scales(amax_bits):
    """(S_enc, S_dec) of a copy from its amax bits: S_enc = min(2688 / amax, fp32_max), 1 for amax 0 or inf."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    s_enc = tl.minimum(2688.0 / amax.to(tl.float64), _FP32_MAX).to(tl.float32)
    s_enc = tl.where((amax_bits == 0) | (s_enc == 0.0), 1.0, s_enc)
    return s_enc, (1.0 / s_enc.to(tl.float64)).to(tl.float32)


@triton.jit
def _block_scales(b_amax, s_enc, s_dec, HW_CAST: tl.constexpr):
    """(E4M3 codes s, enc) of block amaxes: s = cast_e4m3(min(fp32(b_amax / 6) * S_enc, 448)), enc = min(1 / (s * S_dec), fp32_max)."""
    s_dec_b = _div_rn(b_amax, tl.full(b_amax.shape, 6.0, tl.float32)) * s_enc
    code = _fp8_encode(tl.minimum(s_dec_b, 448.0), 448.0, 3, 7, HW_CAST)
    denominator = _fp8_decode(code, 3, 7, HW_CAST) * s_dec
    enc = tl.minimum(_div_rn(tl.full(denominator.shape, 1.0, tl.float32), denominator), _FP32_MAX)  # 1 / 0 = inf -> fp32_max
    return code, enc


@triton.jit
def _encode_copy(v, amax_bits, index, key, R: tl.constexpr, C: tl.constexpr, BLOCK_2D: tl.constexpr, SR: tl.constexpr,
                 HW_CAST: tl.constexpr):
    """(packed codes uint8 [R, C / 2], scale codes uint8 [R, C / 16]) of a tile v [R, C] of a copy (blocks along C).

    index: the row-major element index in the copy mod 2^32 (uint32 [R, C], for stochastic rounding); key: _sr_key.
    """
    blocks = tl.reshape(v, [R, C // 16, 16])
    b_bits = tl.max(_magnitude_bits(blocks), axis=2)
    if BLOCK_2D:  # the 16 rows of a tile share its amax
        tiles = tl.max(tl.reshape(b_bits, [R // 16, 16, C // 16]), axis=1)
        b_bits = tl.reshape(tl.broadcast_to(tiles[:, None, :], [R // 16, 16, C // 16]), [R, C // 16])
    s_enc, s_dec = _global_scales(amax_bits)
    scale, enc = _block_scales(b_bits.to(tl.float32, bitcast=True), s_enc, s_dec, HW_CAST)
    y = tl.reshape(blocks * enc[:, :, None], [R, C])
    even, odd = tl.split(tl.reshape(_e2m1_codes(y, index, key, SR), [R, C // 2, 2]))
    return (even | (odd << 4)).to(tl.uint8), scale


@triton.jit
def _quantize_copy(v, rows, col0, n_rows, row_len, amax_ptr, data_ptr, scale_ptr, key, R: tl.constexpr, C: tl.constexpr,
                   BLOCK_2D: tl.constexpr, SR: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize the tile v [R, C] at rows ``rows``, columns col0 .. col0 + C of a copy [n_rows, row_len] and store it.

    data [n_rows, row_len / 2] and scale [n_rows, row_len / 16] are contiguous; amax_ptr holds the copy's amax bits.
    """
    cols = col0 + tl.arange(0, C)
    index = rows.to(tl.uint32)[:, None] * row_len + cols.to(tl.uint32)[None, :]  # mod 2^32, as the hash takes it
    packed, scale = _encode_copy(v, tl.load(amax_ptr), index, key, R, C, BLOCK_2D, SR, HW_CAST)
    row_ok = (rows < n_rows)[:, None]
    half = col0 // 2 + tl.arange(0, C // 2)
    tl.store(data_ptr + rows[:, None] * (row_len // 2) + half[None, :], packed, mask=row_ok & (half < row_len // 2)[None, :])
    block = col0 // 16 + tl.arange(0, C // 16)
    tl.store(scale_ptr + rows[:, None] * (row_len // 16) + block[None, :], scale, mask=row_ok & (block < row_len // 16)[None, :])


@triton.jit
def _load_columns(x_ptr, r0, c0, M, N, stride_xm, BC: tl.constexpr):
    """(x[r0 .. r0 + 16, cols] float32 [16, BC], cols int64 [BC]): one column of a 16-row block per lane.

    The columns are c0 .. c0 + BC with each group of 16 reversed: a warp still reads whole 32-byte sectors, but
    the pointers are not contiguous, so Triton gives each lane one column (no vector load) and keeps its 16
    rows in its registers: the column block's reductions, RHT and packing need no data exchange.
    """
    j = tl.arange(0, BC)
    cols = (c0 + (j // 16) * 16 + 15 - (j % 16)).to(tl.int64)
    rows = (r0 + tl.arange(0, 16)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return _to_float32(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)), cols


@triton.jit
def _quantize_columns(v, cols, r0, M, N, amax_bits, words_ptr, scale_t_ptr, key, BC: tl.constexpr, BLOCK_2D: tl.constexpr,
                      SR: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize v [16, BC] = rows r0 .. r0 + 16 of columns ``cols``: the blocks of the column-wise copy [N, M].

    Column c's 16 codes go out as one int64 (code k in bits 4k .. 4k + 3: byte j holds rows 2j, 2j + 1, low
    nibble first) at words[c, r0 / 16] (the copy's data viewed as int64 [N, M / 16]), its scale at scale_t[c, r0 / 16].
    """
    b_bits = tl.max(_magnitude_bits(v), axis=0)
    if BLOCK_2D:  # 16 columns (one group of _load_columns) share a tile's amax
        tiles = tl.max(tl.reshape(b_bits, [BC // 16, 16]), axis=1)
        b_bits = tl.reshape(tl.broadcast_to(tiles[:, None], [BC // 16, 16]), [BC])
    s_enc, s_dec = _global_scales(amax_bits)
    scale, enc = _block_scales(b_bits.to(tl.float32, bitcast=True), s_enc, s_dec, HW_CAST)
    k = tl.arange(0, 16)
    index = cols.to(tl.uint32)[None, :] * M + (r0 + k).to(tl.uint32)[:, None]  # row-major in x^T, mod 2^32
    codes = _e2m1_codes(v * enc[None, :], index, key, SR)
    word = tl.sum(codes.to(tl.int64) << (4 * k).to(tl.int64)[:, None], axis=0)  # disjoint nibbles: the sum is their OR
    offsets = cols * (M // 16) + r0 // 16
    tl.store(words_ptr + offsets, word, mask=cols < N)
    tl.store(scale_t_ptr + offsets, scale, mask=cols < N)


# -- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _load_tile(x_ptr, rows, cols, M, N, stride_xm):
    """The float32 tile x[rows, cols], 0 outside [M, N] (x: row stride stride_xm, unit column stride)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return _to_float32(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0))


@cached_launch
@triton.jit
def _nvfp4_amax_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    amax_ptr,  # *int32 [2], zeroed: receives the bits of amax (row-wise copy) and amax_t (column-wise)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    BC: tl.constexpr,  # columns per program
    ROW_BLOCKS: tl.constexpr,  # blocks of 16 rows per program (one atomic per program and amax)
    ROWWISE: tl.constexpr,  # write amax = max |x|
    COLUMNWISE: tl.constexpr,  # write amax_t = max |x|, or max |RHT(x^T)| with RHT
    RHT: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BC)
    c0 = (pid % tiles_n) * BC
    amax = tl.full([], 0, tl.int32)
    amax_t = tl.full([], 0, tl.int32)
    for i in range(ROW_BLOCKS):
        r0 = ((pid // tiles_n) * ROW_BLOCKS + i) * 16
        if ROWWISE or not RHT:
            rows = (r0 + tl.arange(0, 16)).to(tl.int64)
            x = _load_tile(x_ptr, rows, (c0 + tl.arange(0, BC)).to(tl.int64), M, N, stride_xm)  # masked lanes hold 0
            amax = tl.maximum(amax, tl.max(tl.max(_magnitude_bits(x), axis=1), axis=0))
        if COLUMNWISE and RHT:
            v, _ = _load_columns(x_ptr, r0, c0, M, N, stride_xm, BC)
            y = _rht_rows(v, BC, x_ptr.dtype.element_ty)
            amax_t = tl.maximum(amax_t, tl.max(tl.max(_magnitude_bits(y), axis=1), axis=0))
    if ROWWISE:
        tl.atomic_max(amax_ptr, amax, sem="relaxed")
    if COLUMNWISE:
        tl.atomic_max(amax_ptr + 1, amax_t if RHT else amax, sem="relaxed")


@cached_launch
@triton.jit
def _nvfp4_cast_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    data_ptr,  # *uint8 [M, N / 2]: the row-wise copy (unused without ROWWISE)
    scale_ptr,  # *uint8 [M, N / 16]: its E4M3 scales
    words_t_ptr,  # *int64 [N, M / 16]: the column-wise copy's data [N, M / 2] viewed as int64 (unused without COLUMNWISE)
    scale_t_ptr,  # *uint8 [N, M / 16]: its E4M3 scales
    amax_ptr,  # *int32 [2]: the bits of amax and amax_t (from _nvfp4_amax_kernel)
    seed_ptr,  # *int64, one element: the stochastic-rounding seed (unused without SR)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    BC: tl.constexpr,  # columns per program (16 rows); 32 x num_warps: one column per lane in the column-wise copy
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_2D: tl.constexpr,  # 16 x 16 tiles share a scale
    RHT: tl.constexpr,  # the column-wise copy quantizes RHT(x^T)
    SR: tl.constexpr,  # stochastic rounding
    HW_CAST: tl.constexpr,  # hardware float32 -> E4M3 conversion (see _common._fp8_encode)
):
    """The row-wise copy from a [16, BC] tile in Triton's vectorized layout; the column-wise one from the same
    block re-read one column per lane (an L1 hit), each lane quantizing whole column blocks in its registers."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BC)
    r0 = (pid // tiles_n) * 16
    c0 = (pid % tiles_n) * BC
    if ROWWISE:
        rows = (r0 + tl.arange(0, 16)).to(tl.int64)
        x = _load_tile(x_ptr, rows, (c0 + tl.arange(0, BC)).to(tl.int64), M, N, stride_xm)
        key = _sr_key(seed_ptr, 0) if SR else 0
        _quantize_copy(x, rows, c0, M, N, amax_ptr, data_ptr, scale_ptr, key, 16, BC, BLOCK_2D, SR, HW_CAST)
    if COLUMNWISE:
        v, cols = _load_columns(x_ptr, r0, c0, M, N, stride_xm, BC)
        if RHT:
            v = _rht_rows(v, BC, x_ptr.dtype.element_ty)
        key_t = _sr_key(seed_ptr, 1) if SR else 0
        _quantize_columns(v, cols, r0, M, N, tl.load(amax_ptr + 1), words_t_ptr, scale_t_ptr, key_t, BC, BLOCK_2D, SR,
                          HW_CAST)


# -- quantize --------------------------------------------------------------------------------------
def _nvfp4_copies(m: int, n: int, rowwise: bool, columnwise: bool, device):
    """Empty (data, scale, data_t, scale_t) for x [m, n] (None for a copy not asked for), amax bits int32 [2] zeroed."""
    row = (torch.empty((m, n // 2), dtype=torch.uint8, device=device), torch.empty((m, n // 16), dtype=torch.uint8, device=device))
    col = (torch.empty((n, m // 2), dtype=torch.uint8, device=device), torch.empty((n, m // 16), dtype=torch.uint8, device=device))
    return (row if rowwise else (None, None)), (col if columnwise else (None, None)), torch.zeros(2, dtype=torch.int32, device=device)


def quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed=None, four_over_six=None, e4m3_max=448):
    """NVFP4 cast of x [M, N] into its row-wise copy (blocks along N) and/or column-wise copy (x^T or RHT(x^T)).

    Bit-identical to the reference backend (RHT: see the module docstring). Two launches: the amaxes, then
    the cast of every block of 16 rows x 32 * _CAST_WARPS columns into both copies (x read twice from memory).

    Args:
        x: [M, N] float32/bfloat16/float16 (any strides; a non-unit column stride is copied first).
        rowwise, columnwise, block_2d, rht, stochastic_rounding: as the catalog's ``quantize_nvfp4``.
        seed: one-element int64 tensor on x's device with stochastic rounding, else None.
        four_over_six, e4m3_max: None and 448 only (4over6 runs on the reference backend).

    Returns:
        (data uint8 [M, N / 2], scale uint8 [M, N / 16], amax float32 [1], data_t uint8 [N, M / 2],
        scale_t uint8 [N, M / 16], amax_t float32 [1]); three Nones for a copy not asked for.

    Raises:
        TypeError / ValueError: as the reference (x's dtype, rank, alignment; flags; the seed; the 4over6 options).
        NotImplementedError: 4over6 or e4m3_max 256 (declined by ``SUPPORTS``; the reference runs them).

    Example (through the dispatcher: CUDA tensors run these kernels, CPU ones the reference, with the same bits):

    >>> from transformer_engine.plugin import ops
    >>> x = torch.tensor([[6.0, -3.0, 0.75, 0.0] + [0.0] * 12], device="cuda" if torch.cuda.is_available() else "cpu")
    >>> data, scale, amax, _, _, _ = ops.quantize_nvfp4(x, True, False, False, False, False, None)
    >>> [hex(b) for b in data[0, :2].tolist()], hex(scale.item()), amax.tolist()
    (['0xd7', '0x2'], '0x7e', [6.0])
    """
    check_quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed, four_over_six, e4m3_max)
    reason = _unimplemented_option(four_over_six, e4m3_max=e4m3_max)
    if reason:
        raise NotImplementedError(reason)
    x = rows_contiguous(x)
    (m, n), device = x.shape, x.device
    (data, scale), (data_t, scale_t), amax_bits = _nvfp4_copies(m, n, rowwise, columnwise, device)
    if x.numel():
        with device_guard(x):
            cols = 32 * _AMAX_WARPS
            _nvfp4_amax_kernel[(cdiv(m, 16 * _AMAX_ROW_BLOCKS) * cdiv(n, cols),)](
                x, amax_bits, m, n, x.stride(0), BC=cols, ROW_BLOCKS=_AMAX_ROW_BLOCKS, ROWWISE=rowwise, COLUMNWISE=columnwise,
                RHT=rht, num_warps=_AMAX_WARPS,
            )  # fmt: skip
            cols = 32 * _CAST_WARPS
            _nvfp4_cast_kernel[(cdiv(m, 16) * cdiv(n, cols),)](
                x, data, scale, None if data_t is None else data_t.view(torch.int64), scale_t, amax_bits, seed, m, n,
                x.stride(0), BC=cols, ROWWISE=rowwise, COLUMNWISE=columnwise, BLOCK_2D=block_2d, RHT=rht,
                SR=stochastic_rounding, HW_CAST=hw_fp8_cast(device), num_warps=_CAST_WARPS,
            )  # fmt: skip
    amax, amax_t = amax_bits.view(torch.float32).split(1)
    return data, scale, amax if rowwise else None, data_t, scale_t, amax_t if columnwise else None


# -- what the kernels decline ----------------------------------------------------------------------
def _unimplemented_option(four_over_six=None, **e4m3_bounds) -> str:
    """Why the flagos NVFP4 kernels cannot run these options ("" when they can): 4over6, or an E4M3 bound other
    than 448 (``e4m3_bounds``: the E4M3 bound arguments by name)."""
    if four_over_six is not None:
        return f"four_over_six={four_over_six!r}: NVFP4 4over6 is not implemented in the flagos kernels (the reference backend runs it)"
    for name, bound in e4m3_bounds.items():
        if bound != 448:
            return f"{name}={bound!r}: the flagos NVFP4 kernels use the E4M3 bound 448 only (the reference backend runs 256)"
    return ""


def _quantize_supported(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed=None, four_over_six=None, e4m3_max=448):
    """Decline 4over6 and the bound 256 (the reference runs them), a seed on another device than x (the reference moves it)."""
    reason = _unimplemented_option(four_over_six, e4m3_max=e4m3_max)
    if reason:
        return Reject(reason)
    return on_device(x.device, seed=seed) if isinstance(x, torch.Tensor) else True


SUPPORTS = {"quantize_nvfp4": _quantize_supported}
