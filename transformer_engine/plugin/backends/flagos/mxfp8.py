"""MXFP8 in Triton: quantize_mxfp8, dequantize_mxfp8 and gemm_mxfp8 (contract and math: plugin/catalog/mxfp8.py;
oracle: the reference backend's mxfp8.py, which the casts match bit for bit).

Per block B of 32 elements (along a row of x for the row-wise copy, along a column for the column-wise one),
each step one float32 operation or integer arithmetic on bit patterns:

    amax  = max |x| over B, NaN ignored, +-inf counted     (int32 max of the bit patterns, NaN -> 0)
    v     = fp32(amax * fp32(1 / fp8_max))                  (one rounded product)
    s     = e8m0_round_up(v): exponent(v) + (mantissa(v) != 0), 0 for v <= 2^-127, 254 for v >= 2^127 (inf included)
    q     = cast_fp8(clip(x * 2^(127 - s)))                 (2^(127 - s) built from its bits: 2^-127 for s = 254)
    x_hat = q * 2^(s - 127)                                   (dequantize: 2^-127 for s = 0, NaN for s = 255)

``_mxfp8_quantize_kernel`` reads x once: each program loads a [BM, BN] tile (BM, BN multiples of 32) and
quantizes it twice, as [BM, BN / 32, 32] (row blocks, stored as they are) and as [BM / 32, 32, BN] (column
blocks, stored transposed into data_t [N, M]). amax never reaches s = 255 (NaN is ignored), so the
multiplier's NaN case of the reference is not needed here.

Why the bits match the reference: the maxima and the E8M0 rounding are integer arithmetic; the products are
single float32 multiplications with subnormals kept (Triton's float32 multiply does not flush them, and no
add follows, so nothing fuses into an FMA); the FP8 cast is ``_fp8_encode`` (torch's saturating RNE cast; the sign of a NaN is kept as torch
keeps it);
bfloat16 inputs are widened on their bits (``_to_float32``) and a bfloat16 ``dequantize_mxfp8`` output is
rounded on its bits (``_store_rounded``), alike on the GPU and in the interpreter.

gemm_mxfp8 on GPUs without MX tensor cores: V = fp8 * 2^(s - 127) has at most 4 significant bits (E4M3:
1 + 3, E5M2: 1 + 2), so bfloat16 (8 bits, float32's exponent range, subnormals down to 2^-133) holds it exactly
whenever V is a multiple of 2^-133: in every block with s >= 3 (E4M3, whose smallest step is 2^-9) or s >= 10
(E5M2, 2^-16), i.e. every block whose amax exceeds 448 * 2^-125 ~ 1.1e-35 (E4M3) or 57344 * 2^-118 ~ 1.7e-31
(E5M2). V that overflows float32 (s near 254) is inf here as in the reference's float32 dequantize. Below
that range bfloat16 rounds V to a multiple of 2^-133 (nearest even; the reference keeps float32's 2^-149):
an absolute error under 2^-134 per element, documented rather than handled (it would need a float32 GEMM).
Each operand is decoded to V in bfloat16 (``_decode_mxfp8``, one launch), the GEMM runs on the tensor cores
(exact products, float32 accumulation), and bias (and out) are added in float32 before the one rounding, by cuBLAS's
epilogue or the shared one (``_emulated.unscaled_gemm``): the reference's float32 GEMM of the dequantized operands
up to the order of the float32 accumulation.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._fp8 import check_out_dtype
from transformer_engine.plugin.backends._mxfp8_checks import check_gemm_mxfp8, check_mxfp8_operand, check_quantize_mxfp8

from ._common import INTERPRET, _fp8_decode, _fp8_encode, cdiv, device_guard, fp8_format, hw_fp8_cast, rows_contiguous
from ._emulated import _magnitude_bits, _store_rounded, _to_float32, on_device, unscaled_gemm
from ._launch import cached_launch

__all__ = ["quantize_mxfp8", "dequantize_mxfp8", "gemm_mxfp8"]

_TWO_POW_MINUS_127_BITS = tl.constexpr(0x00400000)  # 2^-127: a float32 subnormal, no exponent shift reaches it
_NAN_BITS = tl.constexpr(0x7FC00000)
# tile (rows, columns) and warps of the cast: the fastest measured (a column per lane, NVFP4's layout, was slower)
_QUANTIZE_TILE = (32, 128)
_QUANTIZE_WARPS = 4
_DEQUANTIZE_TILE = (32, 256)  # rows, K per program of the decode


def _rcp_fp8_max(fp8_dtype: torch.dtype) -> float:
    """fp32(1 / fp8_max) as a Python float (exact in float32: a constexpr the kernels multiply by)."""
    return struct.unpack("f", struct.pack("f", 1.0 / fp8_format(fp8_dtype).fp8_max))[0]


# -- element helpers ---------------------------------------------------------------------------------
@triton.jit
def _e8m0_round_up(v):
    """int32 s = e8m0_round_up(v) of float32 v >= 0, never NaN: exponent + 1 unless v is a power of two, 0 for
    v <= 2^-127 (zero and the subnormals up to 2^-127), saturating at 254 (inf -> 254)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    round_up = ((bits & 0x7FFFFF) != 0) & (exponent < 254) & (bits > _TWO_POW_MINUS_127_BITS)
    return tl.minimum(exponent + round_up.to(tl.int32), 254)


@triton.jit
def _encode_multiplier(s):
    """float32 2^(127 - s) for s in [0, 254], from its bits (2^-127 for s = 254 is a subnormal)."""
    bits = tl.where(s == 254, _TWO_POW_MINUS_127_BITS, (254 - s) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_scale(s):
    """float32 2^(s - 127) of E8M0 codes s (int32 in [0, 255]): 2^-127 for 0, NaN for 255."""
    bits = tl.where(s == 0, _TWO_POW_MINUS_127_BITS, s << 23)
    return tl.where(s == 255, _NAN_BITS, bits).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_blocks(blocks, AXIS: tl.constexpr, RCP: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,
                     EBIAS: tl.constexpr, HW_CAST: tl.constexpr):
    """(FP8 codes uint8 shaped as blocks, E8M0 codes uint8 with AXIS reduced) of float32 blocks of 32 along AXIS.

    s = e8m0_round_up(fp32(amax * RCP)), q = cast_fp8(clip(x * 2^(127 - s))).
    """
    amax = tl.max(_magnitude_bits(blocks), axis=AXIS).to(tl.float32, bitcast=True)
    s = _e8m0_round_up(amax * RCP)
    y = blocks * tl.expand_dims(_encode_multiplier(s), AXIS)
    codes = _fp8_encode(y, FP8_MAX, MBITS, EBIAS, HW_CAST)
    if HW_CAST:  # cvt writes NaN as 0x7F whatever its sign; torch's cast keeps it (-NaN -> 0xFF): OR in y's sign bit
        codes = codes | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return codes, s.to(tl.uint8)


# -- kernels ---------------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    data_ptr,  # *uint8 view of data [M, N], contiguous (unused without ROWWISE)
    scale_ptr,  # *uint8 [M, N / 32], contiguous: E8M0 codes of the row blocks
    data_t_ptr,  # *uint8 view of data_t [N, M], contiguous (unused without COLUMNWISE)
    scale_t_ptr,  # *uint8 [N, M / 32], contiguous: E8M0 codes of the column blocks
    M,  # rows of x (a multiple of 32 with COLUMNWISE)
    N,  # columns of x (a multiple of 32 with ROWWISE)
    stride_xm,  # elements between rows of x
    BM: tl.constexpr,  # rows per program, a multiple of 32
    BN: tl.constexpr,  # columns per program, a multiple of 32
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RCP: tl.constexpr,  # fp32(1 / FP8_MAX)
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,  # hardware float32 -> FP8 conversion (see _common._fp8_encode)
):
    """Both copies of one [BM, BN] tile of x. Masked lanes hold 0 and fill whole blocks (the dims a copy
    blocks along are multiples of 32), whose codes are not stored."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    rows = ((pid // tiles_n) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = ((pid % tiles_n) * BN + tl.arange(0, BN)).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = _to_float32(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0))
    if ROWWISE:
        codes, s = _quantize_blocks(tl.reshape(x, [BM, BN // 32, 32]), 2, RCP, FP8_MAX, MBITS, EBIAS, HW_CAST)
        tl.store(data_ptr + rows[:, None] * N + cols[None, :], tl.reshape(codes, [BM, BN]), mask=mask)
        block = (pid % tiles_n) * (BN // 32) + tl.arange(0, BN // 32)
        tl.store(scale_ptr + rows[:, None] * (N // 32) + block[None, :], s, mask=row_ok[:, None] & (block < N // 32)[None, :])
    if COLUMNWISE:
        codes_t, s_t = _quantize_blocks(tl.reshape(x, [BM // 32, 32, BN]), 1, RCP, FP8_MAX, MBITS, EBIAS, HW_CAST)
        tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(tl.reshape(codes_t, [BM, BN])), mask=tl.trans(mask))
        block_t = (pid // tiles_n) * (BM // 32) + tl.arange(0, BM // 32)
        tl.store(scale_t_ptr + cols[None, :] * (M // 32) + block_t[:, None], s_t,
                 mask=(block_t < M // 32)[:, None] & col_ok[None, :])


@cached_launch
@triton.jit
def _mxfp8_dequantize_kernel(
    q_ptr,  # *uint8 view of q [M, K], row stride stride_qm, unit column stride
    scale_ptr,  # *uint8 [M, K / 32], row stride stride_sm, unit column stride: E8M0 codes
    out_ptr,  # *out [M, K], contiguous
    M,  # rows
    K,  # elements per row (a multiple of 32)
    stride_qm,  # bytes between rows of q
    stride_sm,  # bytes between rows of scale
    BM: tl.constexpr,
    BK: tl.constexpr,  # a multiple of 32
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,  # hardware FP8 -> float32 conversion
):
    """out = fp8(q) * 2^(s - 127) in float32 (exact unless it overflows), rounded once to out's dtype."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BK)
    rows = ((pid // tiles_k) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid % tiles_k) * BK + tl.arange(0, BK)
    row_ok = (rows < M)[:, None]
    mask = row_ok & (cols < K)[None, :]
    codes = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0)
    block = (pid % tiles_k) * (BK // 32) + tl.arange(0, BK // 32)
    s = tl.load(scale_ptr + rows[:, None] * stride_sm + block[None, :], mask=row_ok & (block < K // 32)[None, :], other=0)
    q = tl.reshape(_fp8_decode(codes, MBITS, EBIAS, HW_CAST), [BM, BK // 32, 32])
    x = tl.reshape(q * _decode_scale(s.to(tl.int32))[:, :, None], [BM, BK])
    _store_rounded(out_ptr + rows[:, None] * K + cols[None, :], x, mask)


# -- launchers -------------------------------------------------------------------------------------
def _empty_copies(m: int, n: int, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, device):
    """(data [m, n], scale uint8 [m, n / 32]) and (data_t [n, m], scale_t uint8 [n, m / 32]), (None, None) where not asked."""
    row = (torch.empty((m, n), dtype=fp8_dtype, device=device), torch.empty((m, n // 32), dtype=torch.uint8, device=device))
    col = (torch.empty((n, m), dtype=fp8_dtype, device=device), torch.empty((n, m // 32), dtype=torch.uint8, device=device))
    return (row if rowwise else (None, None)), (col if columnwise else (None, None))


def _bits(t):
    """The uint8 view of an FP8 tensor that the kernels store to (None stays None)."""
    return None if t is None else t.view(torch.uint8)


def quantize_mxfp8(x, fp8_dtype, rowwise, columnwise):
    """MXFP8 cast of x [M, N] into its row-wise copy (blocks of 32 along N) and/or column-wise copy (x^T, blocks along M).

    Bit-identical to the reference backend; one launch reads each tile of x once and writes both copies.

    Args:
        x: [M, N] float32/bfloat16/float16 (any row stride; a non-unit column stride is copied first).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        rowwise, columnwise: which copies to write (at least one).

    Returns:
        (data [M, N], scale uint8 [M, N / 32], data_t [N, M], scale_t uint8 [N, M / 32]); None for a copy not asked for.

    Raises:
        TypeError / ValueError: as the reference (x's dtype and rank, fp8_dtype, the flags, N % 32 / M % 32).

    Example (through the dispatcher: CUDA tensors run these kernels, CPU ones the reference, with the same bits):

    >>> from transformer_engine.plugin import ops
    >>> x = torch.tensor([[449.0 * 2**-10, -(2**-10)] + [0.0] * 30], device="cuda" if torch.cuda.is_available() else "cpu")
    >>> data, scale, _, _ = ops.quantize_mxfp8(x, torch.float8_e4m3fn, True, False)
    >>> scale.tolist(), data[0, :2].float().tolist()
    ([[118]], [224.0, -0.5])
    """
    check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    x = rows_contiguous(x)
    (m, n), device = x.shape, x.device
    # the column-only variant compiled by Triton 3.6 for sm_90 wrote a wrong data_t (an H100, 2026-11-26; the
    # interpreter and the both-copies variant agree with the reference): on the GPU the row-wise copy is written
    # too, into buffers dropped here
    write_rows = rowwise or not INTERPRET
    (data, scale), (data_t, scale_t) = _empty_copies(m, n, fp8_dtype, write_rows, columnwise, device)
    if x.numel():
        (tile_m, tile_n), fmt = _QUANTIZE_TILE, fp8_format(fp8_dtype)
        with device_guard(x):
            _mxfp8_quantize_kernel[(cdiv(m, tile_m) * cdiv(n, tile_n),)](
                x, _bits(data), scale, _bits(data_t), scale_t, m, n, x.stride(0), BM=tile_m, BN=tile_n, ROWWISE=write_rows,
                COLUMNWISE=columnwise, RCP=_rcp_fp8_max(fp8_dtype), **fmt.constexprs(hw_fp8_cast(device)),
                num_warps=_QUANTIZE_WARPS,
            )  # fmt: skip
    return (data, scale, data_t, scale_t) if rowwise else (None, None, data_t, scale_t)


def _decode_mxfp8(q: torch.Tensor, scale_e8m0: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[M, K] values q * 2^(s - 127) in out_dtype (one launch; the arguments already checked)."""
    q, scale_e8m0 = rows_contiguous(q), rows_contiguous(scale_e8m0)
    (m, k), fmt = q.shape, fp8_format(q.dtype)
    out = torch.empty((m, k), dtype=out_dtype, device=q.device)
    if out.numel():
        tile_m, tile_k = _DEQUANTIZE_TILE
        with device_guard(q):
            _mxfp8_dequantize_kernel[(cdiv(m, tile_m) * cdiv(k, tile_k),)](
                q.view(torch.uint8), scale_e8m0, out, m, k, q.stride(0), scale_e8m0.stride(0), BM=tile_m, BK=tile_k,
                MBITS=fmt.mbits, EBIAS=fmt.ebias, HW_CAST=hw_fp8_cast(q.device), num_warps=4,
            )  # fmt: skip
    return out


def dequantize_mxfp8(q, scale_e8m0, out_dtype):
    """x[i, j] = q[i, j] * 2^(scale_e8m0[i, j // 32] - 127), in float32, cast to ``out_dtype``.

    Bit-identical to the reference backend (one launch).

    Raises:
        TypeError: q is not FP8 or the scale not uint8. ValueError: shapes that do not fit, a bad out_dtype.

    Example:

    >>> from transformer_engine.plugin import ops
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> q = torch.full((1, 32), 1.5, device=device).to(torch.float8_e4m3fn)
    >>> ops.dequantize_mxfp8(q, torch.tensor([[130]], dtype=torch.uint8, device=device), torch.float32)[0, :2].tolist()
    [12.0, 12.0]
    """
    check_mxfp8_operand(q, scale_e8m0, "q")
    check_out_dtype(out_dtype)
    return _decode_mxfp8(q, scale_e8m0, out_dtype)


def gemm_mxfp8(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias=None, out=None, accumulate=False):
    """D = A @ B^T + bias (+ out when ``accumulate``) on MXFP8 operands, emulated on bfloat16 tensor cores.

    Each operand is decoded to V = q * 2^(s - 127) in bfloat16 (``_decode_mxfp8``: exact, see the module
    docstring for the range), then one bfloat16 GEMM with float32 accumulation (``unscaled_gemm``: the epilogue
    in cuBLAS where it can be, else a float32 product and the epilogue launch).

    Returns:
        D [M, N] in ``out_dtype`` (else out's dtype, else float32); ``out`` itself when given.

    Raises:
        TypeError / ValueError: as the reference (either operand, K that differ, a bad bias / out,
        accumulate without out).

    Example (A = B = 2 everywhere, K = 32: D = 32 * 2 * 2):

    >>> from transformer_engine.plugin import ops
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> q, s = torch.full((2, 32), 1.0, device=device).to(torch.float8_e4m3fn), torch.full((2, 1), 128, dtype=torch.uint8, device=device)
    >>> ops.gemm_mxfp8(q, q, s, s, torch.bfloat16).tolist()
    [[128.0, 128.0], [128.0, 128.0]]
    """
    dtype = check_gemm_mxfp8(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias, out, accumulate)
    result = out if out is not None else torch.empty((a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
    if result.numel():
        unscaled_gemm(_decode_mxfp8(a, a_scale_e8m0, torch.bfloat16), _decode_mxfp8(b, b_scale_e8m0, torch.bfloat16), result,
                      bias=bias, accumulate=accumulate)
    return result


# -- what the kernels decline ----------------------------------------------------------------------
def _dequantize_supported(q, scale_e8m0, out_dtype):
    """Decline a scale on another device than q."""
    return on_device(q.device, scale_e8m0=scale_e8m0) if isinstance(q, torch.Tensor) else True


def _gemm_supported(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias=None, out=None, accumulate=False):
    """Decline any tensor on another device than a."""
    if not isinstance(a, torch.Tensor):
        return True
    return on_device(a.device, b=b, a_scale_e8m0=a_scale_e8m0, b_scale_e8m0=b_scale_e8m0, bias=bias, out=out)


SUPPORTS = {"dequantize_mxfp8": _dequantize_supported, "gemm_mxfp8": _gemm_supported}
