"""Block-scaled FP8 casts in Triton (Float8BlockScaling: 1 x B and B x B tiles): quantize_blockwise,
cast_transpose_blockwise(_dbias); the kernels are in ``_blockwise.py``.

Math (plugin/catalog/quantization.py), float32 throughout:

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

The [B, C] tile kernel of the cast-transpose is persistent (see _blockwise.py); the others handle one
tile (or row of blocks) per program.
"""

from __future__ import annotations

import struct

import torch

from transformer_engine.plugin.backends._checks import check_amax_epsilon, check_dbias_dtype
from transformer_engine.plugin.backends._fp8 import check_2d, check_fp8_dtype, check_high_precision
from transformer_engine.plugin.core import Reject

from ._blockwise import _cast_transpose_blockwise_kernel, _quantize_blockwise_kernel
from ._column_sums import column_sums
from ._common import INTERPRET, cdiv, device_guard, fp8_format, hw_fp8_cast, next_power_of_2, num_programs_hint, rows_contiguous

__all__ = ["quantize_blockwise", "cast_transpose_blockwise", "cast_transpose_blockwise_dbias"]

_BLOCK_LENS = frozenset(16 << k for k in range(5))  # block lengths of the blockwise kernels: 16 ... 256
# Launch settings of the blockwise casts: the best of benchmarks/sweep_fp8_casts.py --kernels blockwise.
# num_warps = tile elements / (32 * PER_THREAD), a power of two clamped to [2, 16].
_BLOCKWISE_TILE = 16384  # elements per program of the B x B quantize (128 x 128 tiles: one tile)
_BLOCKWISE_PER_THREAD = 64  # values per thread of the B x B quantize (8 warps at 16K)
# 1 x B quantize: one block per row (2-D tile, no [R, G, B] view) beat wider rows
_BLOCKWISE_ROW = 128  # columns per program of the 1 x B quantize (one block: no 3-D row view)
_BLOCKWISE_ROW_TILE = 4096  # elements per program of the 1 x B quantize (rows = this / _BLOCKWISE_ROW)
_BLOCKWISE_ROW_PER_THREAD = 32  # values per thread of the 1 x B quantize (4 warps)
# cast_transpose_blockwise: split (a persistent column kernel next to the 1 x B quantize) beat the fused kernel
_CT_BLOCKWISE_SPLIT = True  # True: two launches, the 1 x B quantize (q) and a column kernel (q_t); False: one fused read
_CT_BLOCKWISE_COL_TILE = 64  # split: columns per program of the column kernel (B x this tile)
_CT_BLOCKWISE_TILE_N = 128  # fused (not split): columns per program (B x this tile, at least B; above B: 3-D row view)
_CT_BLOCKWISE_PER_THREAD = 128  # values per thread of the column / fused kernel (2 warps at 128 x 64, 4 at 128 x 128)
_CT_BLOCKWISE_CODES = True  # 16-bit x: transpose the 8-bit codes (False: transpose the values, as float32 x does)
_CT_BLOCKWISE_PROGRAMS_PER_SM = 4  # persistent programs per SM of the column / fused kernel


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
    check_2d(x, "x")
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
    """Block-scaled FP8 cast, one scale per ``block_rows x block_cols`` tile (the math: plugin/catalog/quantization.py),
    bit-identical to the reference backend; 1 x B and B x B tiles only (B a power of two in [16, 256]).

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
        _launch_quantize_blockwise(rows_contiguous(x), q, scale_inv, square, b, power_2_scale, eps_bits)
    return q, scale_inv


def _launch_quantize_blockwise(x, q, scale_inv, square: bool, block_len: int, power_2_scale, eps_bits: int,
                               transposed: bool = False) -> None:
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
    computed from 32-bit loads (see quantization._launch_cast_transpose), so it transposes the values.
    """
    return _CT_BLOCKWISE_CODES and not (x.dtype == torch.float32 and x.is_cuda and not INTERPRET)


def cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """1 x ``block_len`` block-scaled FP8 casts of x and of x^T.

    (q, scale_inv) = quantize_blockwise(x, 1 x B), (q_t, scale_inv_t) = quantize_blockwise(x^T, 1 x B).
    Split (the default, _CT_BLOCKWISE_SPLIT): quantize_blockwise gives (q, scale_inv), then a kernel
    quantizes the columns of [B, _CT_BLOCKWISE_COL_TILE] tiles of x (x read twice, both passes
    streaming). Fused: one kernel loads [B, _CT_BLOCKWISE_TILE_N] tiles once and quantizes their rows
    and their columns (slower where its registers spill; kept for other GPUs' sweeps).
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


def cast_transpose_blockwise_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias_dtype=None):
    """:func:`cast_transpose_blockwise` plus the bias gradient dbias[j] = sum_i x[i, j] in float32.

    The column kernel also writes each B-row tile's column sums; ``column_sums`` adds the cdiv(M, B)
    partial rows in a fixed order (deterministic, no atomics).

    Returns:
        (q, scale_inv, q_t, scale_inv_t, dbias [N] in ``dbias_dtype``, float32 if None); NaN / inf propagate into dbias.

    Raises:
        TypeError / ValueError: as :func:`quantize_blockwise`, or a dbias_dtype that is not a float dtype.
    """
    check_dbias_dtype(dbias_dtype)
    *casts, partials = _launch_cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias=True)
    return (*casts, column_sums(partials, dbias_dtype or torch.float32)[0])


def _launch_cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias: bool):
    """(q, scale_inv, q_t, scale_inv_t, float32 column sums of each B-row tile [cdiv(M, B), N] or None)."""
    eps_bits = _check_blockwise(x, fp8_dtype, 1, block_len, amax_epsilon)
    x = rows_contiguous(x)
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    scale_inv = _column_major_scales(cdiv(n, block_len), m, x.device)
    if _CT_BLOCKWISE_SPLIT:
        _launch_quantize_blockwise(x, q, scale_inv, square=False, block_len=block_len, power_2_scale=power_2_scale, eps_bits=eps_bits)
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


def _supported_tiles(x, fp8_dtype, block_rows, block_cols, power_2_scale, amax_epsilon):
    """Decline tiles other than 1 x B and B x B, B a power of two in [16, 256] (the reference runs them)."""
    return _blockwise_tiles(block_rows, block_cols)


def _supported_block_len(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """Decline a block_len that is not a power of two in [16, 256] (the reference runs it)."""
    return _blockwise_tiles(1, block_len)


def _supported_dbias_block_len(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias_dtype=None):
    """``_supported_block_len`` for the cast with the bias gradient (every dbias_dtype runs)."""
    return _blockwise_tiles(1, block_len)


SUPPORTS = {
    "quantize_blockwise": _supported_tiles,
    "cast_transpose_blockwise": _supported_block_len,
    "cast_transpose_blockwise_dbias": _supported_dbias_block_len,
}
