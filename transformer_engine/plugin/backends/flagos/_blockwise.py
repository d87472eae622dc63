"""Triton kernels of the block-scaled FP8 casts (Float8BlockScaling: DeepSeek-style 1 x B and B x B tiles).

Math per tile T (plugin/catalog/quantization.py, ``quantize_blockwise``), float32:

    a = max(max |T|, eps);  scale = fp8_max / a   (1 when a is 0 or not finite, float32 max when it overflows)
    power_2_scale:  scale = 2^floor(log2(scale))  (the exponent kept, the mantissa bits cleared)
    q = cast_fp8(clip(T * scale, -fp8_max, fp8_max));  scale_inv = 1 / scale

How the kernels stay bit-identical to the reference backend:

- max |T| is reduced on the int32 bit patterns of |x|: for non-negative floats the int order is the
  float order, and every NaN pattern sits above +inf, so a NaN anywhere in T makes ``a`` non-finite
  (scale 1) as torch's NaN-propagating amax does. The exact integer max needs no NaN bookkeeping, and
  tests ``0 < a < inf`` on the bits, which no subnormal flushing can move.
- both divisions are taken in float64 and rounded once to float32: the correctly rounded float32
  quotient (53 >= 2 * 24 + 2 bits make the double rounding innocuous), as torch divides. Triton's
  float32 division was seen one ulp off on the H200, and its libdevice division flushes subnormals
  (1 / float32 max is one).
- the cast is ``_fp8_encode`` (see _common.py).

Layouts: a program loads an [R, W] tile of x (W = G * B), views it as [R, G, B] and reduces the last
axis: one scale per row of each 1 x B block, or, for B x B tiles (R = B), also over the rows. The
scales of 1 x B blocks are stored column-major (storage [cdiv(N, B), M], a row of programs writes
contiguous runs), those of B x B tiles row-major: the layouts cuBLASLt's block-scaled GEMM reads.
``cast_transpose_blockwise`` loads a [T, T] tile once and quantizes it and its transpose with the same
1 x B code; transposing x (not the 8-bit codes) keeps each copy a plain row quantization.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import _fp8_encode

@triton.jit
def _abs_bits(x):
    """int32 bit pattern of |x| (x float32): ordered as |x| is, with every NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tile_scales(amax_bits, eps_bits, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(scale, scale_inv) in float32 from the bit patterns of tile amaxes (any shape).

    scale = fp8_max / max(amax, eps), 1 unless 0 < max(amax, eps) < inf, float32 max on overflow,
    optionally 2^floor(log2(scale)); scale_inv = 1 / scale. Both divisions correctly rounded.
    """
    a_bits = tl.maximum(amax_bits, eps_bits)  # a = max(amax, eps)
    valid = (a_bits > 0) & (a_bits < 0x7F800000)  # 0 < a < inf and not NaN
    a = tl.where(valid, a_bits, 0x3F800000).to(tl.float32, bitcast=True)  # 1.0 where invalid: no 0 / NaN division
    # clamping the float64 quotient is the reference's "inf -> float32 max" (any quotient above float32
    # max rounds to it or to inf in float32)
    quotient = tl.minimum(FP8_MAX / a.to(tl.float64), 3.4028234663852886e38)
    scale = tl.where(valid, quotient.to(tl.float32), 1.0)
    if POW2:  # scale is a positive normal float32 (>= 448 / float32 max): clearing the mantissa is frexp/ldexp
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale_inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    return scale, scale_inv


@triton.jit
def _quantize_tile_store(
    x,  # [R, G * B] tile of a matrix [M, N] (loaded with 0 in its masked lanes), any float dtype
    row0,  # row of the matrix where the tile starts
    col0,  # column where the tile starts (a multiple of B)
    M,  # rows of the matrix
    N,  # columns of the matrix
    q_ptr,  # *uint8 view of q [M, N], contiguous
    s_ptr,  # *float32 scale_inv storage: [cdiv(N, B), M] (1 x B), [cdiv(M, B), cdiv(N, B)] (SQUARE)
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    B: tl.constexpr,  # block length
    SQUARE: tl.constexpr,  # True: B x B tiles (R == B), one scale per tile; False: 1 x B blocks
    POW2: tl.constexpr,  # round scales down to powers of two
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """Quantize one tile with its block scales and store its codes and scale_inv entries."""
    R: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1] // B
    x3 = tl.reshape(x.to(tl.float32), [R, G, B])
    amax_bits = tl.max(_abs_bits(x3), axis=2)  # [R, G]: one per row of each block
    rows = (row0 + tl.arange(0, R)).to(tl.int64)
    blocks = (col0 // B + tl.arange(0, G)).to(tl.int64)  # block column j of each group
    if SQUARE:
        amax_bits = tl.max(amax_bits, axis=0, keep_dims=True)  # [1, G]: one per tile
        s_offs = (row0 // B) * tl.cdiv(N, B) + blocks[None, :]
        s_mask = blocks[None, :] < tl.cdiv(N, B)
    else:
        s_offs = blocks[None, :] * M + rows[:, None]  # column-major: runs of R contiguous scales
        s_mask = (rows < M)[:, None] & (blocks < tl.cdiv(N, B))[None, :]
    scale, scale_inv = _tile_scales(amax_bits, eps_bits, FP8_MAX, POW2)
    code = _fp8_encode(x3 * scale[:, :, None], FP8_MAX, MBITS, EBIAS, HW_CAST)
    cols = blocks[:, None] * B + tl.arange(0, B)[None, :]  # [G, B]
    mask = (rows < M)[:, None, None] & (cols < N)[None, :, :]
    tl.store(q_ptr + rows[:, None, None] * N + cols[None, :, :], code, mask=mask)
    tl.store(s_ptr + s_offs, scale_inv, mask=s_mask)


@triton.jit
def _quantize_blockwise_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous
    s_ptr,  # *float32 scale_inv storage: [cdiv(N, B), M] (1 x B), [cdiv(M, B), cdiv(N, B)] (SQUARE)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    BLOCK_M: tl.constexpr,  # rows per program (B when SQUARE)
    GROUPS: tl.constexpr,  # blocks side by side per program
    B: tl.constexpr,  # block length
    SQUARE: tl.constexpr,  # True: B x B tiles; False: 1 x B blocks
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """quantize_blockwise: one program per [BLOCK_M, GROUPS * B] tile of x."""
    pid = tl.program_id(0)
    programs_n = tl.cdiv(N, GROUPS * B)
    row0 = (pid // programs_n) * BLOCK_M
    col0 = (pid % programs_n) * (GROUPS * B)
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = col0 + tl.arange(0, GROUPS * B)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    _quantize_tile_store(x, row0, col0, M, N, q_ptr, s_ptr, eps_bits, B, SQUARE, POW2, FP8_MAX, MBITS, EBIAS, HW_CAST)


@triton.jit
def _cast_transpose_blockwise_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous
    s_ptr,  # *float32 scale_inv storage [cdiv(N, B), M], contiguous
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous
    st_ptr,  # *float32 scale_inv_t storage [cdiv(M, B), N], contiguous
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    TILE: tl.constexpr,  # square tile side, a multiple of B
    B: tl.constexpr,  # block length
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """cast_transpose_blockwise: one program per [TILE, TILE] tile, read once, quantized as x and as x^T."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, TILE)
    row0 = (pid // tiles_n) * TILE
    col0 = (pid % tiles_n) * TILE
    rows = (row0 + tl.arange(0, TILE)).to(tl.int64)
    cols = col0 + tl.arange(0, TILE)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    _quantize_tile_store(x, row0, col0, M, N, q_ptr, s_ptr, eps_bits, B, False, POW2, FP8_MAX, MBITS, EBIAS, HW_CAST)
    _quantize_tile_store(
        tl.trans(x), col0, row0, N, M, qt_ptr, st_ptr, eps_bits, B, False, POW2, FP8_MAX, MBITS, EBIAS, HW_CAST
    )
