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

Layouts: a program loads an [R, W] tile of x (W = G * B) and reduces each row of each block: with
G = 1 the tile stays 2-D (amax over axis 1, one scale per row), else it is viewed as [R, G, B] (amax
over the last axis; Triton converts layouts through shared memory for that view). For B x B tiles
(R = B) the row amaxes are also reduced over the rows. The scales of 1 x B blocks are stored
column-major (storage [cdiv(N, B), M], a row of programs writes contiguous runs), those of B x B
tiles row-major: the layouts cuBLASLt's block-scaled GEMM reads.

``cast_transpose_blockwise`` quantizes the columns of B-row tiles [B, C] of x (B x 1 blocks of x, i.e.
1 x B blocks of x^T), always 2-D: amax over axis 0, one scale per column. Its kernel runs in one of
two modes (``ROWS``): fused (C a multiple of B: the tile also gives q by rows, x read once) or
columns only, next to ``_quantize_blockwise_kernel`` for q (split: x read twice, each kernel a
plain streaming pass). Either way its programs are persistent and load their next tile before they
quantize the current one (one tile per program left the column kernel latency-bound at low
occupancy). Two ways to the transpose (``TRANSPOSE_CODES``):

- codes (16-bit x): the columns are quantized in place and the uint8 codes are stored transposed;
- values (float32 x on the GPU): the tile itself is transposed and quantized by rows. On sm_90
  Triton 3.6 wrote a wrong transposed tile when transposing 8-bit codes computed from 32-bit loads
  (see ``_launch_cast_transpose`` in quantization.py), so float32 keeps this path.

Both give the same bits: each column block sees the same values, amax and scale either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import _fp8_encode
from ._launch import cached_launch


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
    q_ptr,  # *uint8 view of q [M, N], contiguous ([N, M] with TRANSPOSED)
    s_ptr,  # *float32 scale_inv storage: [cdiv(N, B), M] (1 x B), [cdiv(M, B), cdiv(N, B)] (SQUARE; transposed with TRANSPOSED)
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    B: tl.constexpr,  # block length
    SQUARE: tl.constexpr,  # True: B x B tiles (R == B), one scale per tile; False: 1 x B blocks
    TRANSPOSED: tl.constexpr,  # SQUARE with G = 1 only: store the tile as the tile (col0, row0) of the transpose
    POW2: tl.constexpr,  # round scales down to powers of two
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """Quantize one tile with its block scales and store its codes and scale_inv entries.

    TRANSPOSED: a square tile of x^T holds the values of the tile of x it transposes (the same amax and
    scale, the codes transposed), so the quantization of x^T is read from x row by row (coalesced) and
    only the stores are transposed."""
    R: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1] // B
    rows = (row0 + tl.arange(0, R)).to(tl.int64)
    blocks = (col0 // B + tl.arange(0, G)).to(tl.int64)  # block column j of each group
    if G == 1:  # one block per row: 2-D, no reshape
        xs = x.to(tl.float32)
        amax_bits = tl.max(_abs_bits(xs), axis=1, keep_dims=True)  # [R, 1]
    else:
        xs = tl.reshape(x.to(tl.float32), [R, G, B])
        amax_bits = tl.max(_abs_bits(xs), axis=2)  # [R, G]: one per row of each block
    if SQUARE:
        amax_bits = tl.max(amax_bits, axis=0, keep_dims=True)  # [1, G]: one per tile
        if TRANSPOSED:
            s_offs = blocks[None, :] * tl.cdiv(M, B) + row0 // B
        else:
            s_offs = (row0 // B) * tl.cdiv(N, B) + blocks[None, :]
        s_mask = blocks[None, :] < tl.cdiv(N, B)
    else:
        s_offs = blocks[None, :] * M + rows[:, None]  # column-major: runs of R contiguous scales
        s_mask = (rows < M)[:, None] & (blocks < tl.cdiv(N, B))[None, :]
    scale, scale_inv = _tile_scales(amax_bits, eps_bits, FP8_MAX, POW2)
    # the store offsets are formed after the encode: 64-bit offsets held across the reductions cost registers
    if G == 1:
        code = _fp8_encode(xs * scale, FP8_MAX, MBITS, EBIAS, HW_CAST)  # [R, B] * [R or 1, 1]
        cols = col0 + tl.arange(0, B)
        offs = rows[:, None] * N + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    else:
        code = _fp8_encode(xs * scale[:, :, None], FP8_MAX, MBITS, EBIAS, HW_CAST)
        cols = blocks[:, None] * B + tl.arange(0, B)[None, :]  # [G, B]
        offs = rows[:, None, None] * N + cols[None, :, :]
        mask = (rows < M)[:, None, None] & (cols < N)[None, :, :]
    if TRANSPOSED:
        tl.store(q_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
    else:
        tl.store(q_ptr + offs, code, mask=mask)
    tl.store(s_ptr + s_offs, scale_inv, mask=s_mask)


@cached_launch
@triton.jit
def _quantize_blockwise_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous ([N, M] with TRANSPOSED)
    s_ptr,  # *float32 scale_inv storage: [cdiv(N, B), M] (1 x B), [cdiv(M, B), cdiv(N, B)] (SQUARE; transposed with TRANSPOSED)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    BLOCK_M: tl.constexpr,  # rows per program (B when SQUARE)
    GROUPS: tl.constexpr,  # blocks side by side per program (1 with TRANSPOSED)
    B: tl.constexpr,  # block length
    SQUARE: tl.constexpr,  # True: B x B tiles; False: 1 x B blocks
    TRANSPOSED: tl.constexpr,  # SQUARE only: write the quantization of x^T (see _quantize_tile_store)
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
    _quantize_tile_store(x, row0, col0, M, N, q_ptr, s_ptr, eps_bits, B, SQUARE, TRANSPOSED, POW2, FP8_MAX, MBITS, EBIAS, HW_CAST)


@triton.jit
def _quantize_columns(
    x,  # [B, C] tile of a matrix [M, N] (loaded with 0 in its masked lanes): one row block
    row0,  # row of the matrix where the tile starts (a multiple of B)
    col0,  # column where the tile starts
    N,  # columns of the matrix
    st_ptr,  # *float32 scale_inv_t storage [cdiv(M, B), N], contiguous (one scale per column of a B-row block)
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """uint8 codes [B, C] of the B x 1 blocks of a B-row tile, not transposed; stores their scale_inv entries.

    Per column j: a = max over the B rows of |x|, scale as _tile_scales, code = cast_fp8(x * scale):
    the 1 x B quantization of x^T, computed on x. 2-D throughout (no reshape).
    """
    B: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    xs = x.to(tl.float32)
    amax_bits = tl.max(_abs_bits(xs), axis=0)  # [C]: one per column
    scale, scale_inv = _tile_scales(amax_bits, eps_bits, FP8_MAX, POW2)
    cols = (col0 + tl.arange(0, C)).to(tl.int64)
    tl.store(st_ptr + (row0 // B) * N + cols, scale_inv, mask=cols < N)  # contiguous along columns
    return _fp8_encode(xs * scale[None, :], FP8_MAX, MBITS, EBIAS, HW_CAST)


@triton.jit
def _load_tile(x_ptr, tile, tiles, M, N, stride_xm, TILE_N: tl.constexpr, B: tl.constexpr):
    """(x, mask, row0, col0, rows, cols) of tile number ``tile`` of x, [B, TILE_N] tiles in row-major order:
    x is loaded with zeros past the matrix, and all zeros (nothing read) when tile >= tiles."""
    tiles_n = tl.cdiv(N, TILE_N)
    row0 = (tile // tiles_n) * B
    col0 = (tile % tiles_n) * TILE_N
    rows = (row0 + tl.arange(0, B)).to(tl.int64)
    cols = (col0 + tl.arange(0, TILE_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows_to_load = tl.where(tile < tiles, M, 0)  # none past the last tile
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask & (rows < rows_to_load)[:, None], other=0.0)
    return x, mask, row0, col0, rows, cols


@cached_launch
@triton.jit
def _cast_transpose_blockwise_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous (unused without ROWS)
    s_ptr,  # *float32 scale_inv storage [cdiv(N, B), M], contiguous (unused without ROWS)
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous
    st_ptr,  # *float32 scale_inv_t storage [cdiv(M, B), N], contiguous
    dbias_ptr,  # *float32 column sums of each tile row [cdiv(M, B), N], contiguous (written with DBIAS)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    eps_bits,  # int32 bit pattern of amax_epsilon as float32
    TILE_N: tl.constexpr,  # columns per tile (a multiple of B with ROWS)
    B: tl.constexpr,  # block length: rows per tile
    ROWS: tl.constexpr,  # also write (q, scale_inv) from the same tile (fused); False: only the columns (split)
    DBIAS: tl.constexpr,  # also write each tile's float32 column sums (the bias gradient's partial rows)
    TRANSPOSE_CODES: tl.constexpr,  # True: quantize the columns in place, transpose the codes; False: transpose x
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """cast_transpose_blockwise(_dbias): [B, TILE_N] tiles quantized as x^T (and as x with ROWS), persistent.

    Program p takes tiles p, p + P, p + 2P, ... and loads each next tile before it quantizes the
    current one, so a tile's loads are in flight while the previous one is reduced and stored.
    """
    tiles = tl.cdiv(M, B) * tl.cdiv(N, TILE_N)
    step = tl.num_programs(0)
    x, mask, row0, col0, rows, cols = _load_tile(x_ptr, tl.program_id(0), tiles, M, N, stride_xm, TILE_N, B)
    for tile in range(tl.program_id(0), tiles, step):
        x_next, mask_next, row0_next, col0_next, rows_next, cols_next = _load_tile(
            x_ptr, tile + step, tiles, M, N, stride_xm, TILE_N, B
        )
        if ROWS:
            _quantize_tile_store(x, row0, col0, M, N, q_ptr, s_ptr, eps_bits, B, SQUARE=False, TRANSPOSED=False, POW2=POW2,
                                 FP8_MAX=FP8_MAX, MBITS=MBITS, EBIAS=EBIAS, HW_CAST=HW_CAST)
        if DBIAS:  # masked lanes hold 0
            tl.store(dbias_ptr + (row0 // B) * N + cols, tl.sum(x.to(tl.float32), axis=0), mask=cols < N)
        if TRANSPOSE_CODES:
            code = _quantize_columns(x, row0, col0, N, st_ptr, eps_bits, POW2, FP8_MAX, MBITS, EBIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
        else:  # [TILE_N, B]: one block per row, the 2-D path
            _quantize_tile_store(
                tl.trans(x), col0, row0, N, M, qt_ptr, st_ptr, eps_bits, B, SQUARE=False, TRANSPOSED=False, POW2=POW2, FP8_MAX=FP8_MAX,
                MBITS=MBITS, EBIAS=EBIAS, HW_CAST=HW_CAST
            )
        x, mask, row0, col0, rows, cols = x_next, mask_next, row0_next, col0_next, rows_next, cols_next
