"""NVFP4 in Triton: dequantize_nvfp4, and gemm_nvfp4 emulated on bfloat16 tensor cores (contract: plugin/catalog/nvfp4.py;
oracle: the reference backend's nvfp4.py). The casts: :mod:`.nvfp4`.

dequantize_nvfp4: x_hat = q * ((s * amax) * fp32(1 / 2688)), bit for bit as the reference.

gemm_nvfp4 on GPUs without FP4 tensor cores: v = e2m1 * e4m3 has at most 2 + 4 significant bits and lies in
[2^-10, 2688], so it is exact in bfloat16. Each operand is decoded to v (``_nvfp4_decode_kernel``), the
bfloat16 GEMM runs on the tensor cores with float32 output (exact products, float32 accumulation), and
the shared epilogue (``_emulated.finish_gemm``) applies D = fp32(acc * (a_amax / 2688) * (b_amax / 2688)) (the per-tensor factors
in float64, one rounding) + bias (+ out), then one cast. It equals the reference's float32 GEMM of the
dequantized operands up to float32 accumulation order and the rounding of each element's factor (the
reference rounds fp32(fp32(s * amax) * fp32(1 / 2688)) per block and e2m1 times it per element: a few float32
ulps per product). Where the reference's dequantized operands are subnormal it loses bits that this keeps;
with an infinite amax both give non-finite results, not always the same ones (the reference: e2m1 * inf per
element, so 0 * inf = NaN terms; here acc * inf).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._fp8 import check_out_dtype
from transformer_engine.plugin.backends._nvfp4_checks import check_gemm_nvfp4, check_nvfp4_operand
from transformer_engine.plugin.core import Reject

from ._common import _fp8_decode, cdiv, device_guard, hw_fp8_cast, rows_contiguous
from ._emulated import _store_rounded, finish_gemm, mm_f32, on_device
from ._launch import cached_launch
from .nvfp4 import _unimplemented_option

__all__ = ["dequantize_nvfp4", "gemm_nvfp4"]

_DECODE_FACTOR = tl.constexpr(struct.unpack("f", struct.pack("f", 1.0 / 2688.0))[0])  # fp32(1 / 2688), TE's factor_inv
_DECODE_TILE = (32, 128)  # rows, K per program of the decode kernels


@triton.jit
def _e2m1_value(code):
    """float32 value of E2M1 codes (int32): +-(0, 0.5, 1, 1.5, 2, 3, 4, 6)[code & 7], sign bit 8."""
    k = code & 7
    normal = (((k >> 1) + 126) << 23) | ((k & 1) << 22)  # k >= 2: 2^((k >> 1) - 1) * (1 + (k & 1) / 2)
    bits = tl.where(k >= 2, normal, tl.where(k == 1, 0x3F000000, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@cached_launch
@triton.jit
def _nvfp4_decode_kernel(
    q_ptr,  # *uint8 [M, K / 2], row stride stride_qm, unit column stride: two E2M1 codes a byte, low nibble first
    scale_ptr,  # *uint8 [M, K / 16], row stride stride_sm, unit column stride: E4M3 bits
    amax_ptr,  # *float32, one element: the copy's amax (unused without TENSOR_SCALE)
    out_ptr,  # *out [M, K], contiguous
    M,  # rows
    K,  # elements per row
    stride_qm,  # bytes between rows of q
    stride_sm,  # bytes between rows of scale
    BM: tl.constexpr,
    BK: tl.constexpr,
    TENSOR_SCALE: tl.constexpr,  # x = e2m1 * ((s * amax) * fp32(1 / 2688)); False: v = e2m1 * s
    HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BK)
    rows = ((pid // tiles_k) * BM + tl.arange(0, BM)).to(tl.int64)
    k0 = (pid % tiles_k) * BK
    row_ok = (rows < M)[:, None]
    half = k0 // 2 + tl.arange(0, BK // 2)
    codes = tl.load(q_ptr + rows[:, None] * stride_qm + half[None, :], mask=row_ok & (half < K // 2)[None, :], other=0).to(tl.int32)
    v = tl.reshape(tl.join(_e2m1_value(codes & 0xF), _e2m1_value(codes >> 4)), [BM, BK])
    block = k0 // 16 + tl.arange(0, BK // 16)
    s_code = tl.load(scale_ptr + rows[:, None] * stride_sm + block[None, :], mask=row_ok & (block < K // 16)[None, :], other=0)
    s = _fp8_decode(s_code, 3, 7, HW_CAST)
    if TENSOR_SCALE:
        s = (s * tl.load(amax_ptr)) * _DECODE_FACTOR
    x = tl.reshape(tl.reshape(v, [BM, BK // 16, 16]) * s[:, :, None], [BM, BK])
    cols = k0 + tl.arange(0, BK)
    _store_rounded(out_ptr + rows[:, None] * K + cols[None, :], x, row_ok & (cols < K)[None, :])


# -- dequantize and GEMM ---------------------------------------------------------------------------
def _decode(q: torch.Tensor, scale: torch.Tensor, amax, out_dtype: torch.dtype) -> torch.Tensor:
    """[M, K] values of an NVFP4 operand: e2m1 * ((s * amax) * fp32(1 / 2688)) in out_dtype, or with amax None the
    exact e2m1 * s (bfloat16 holds it: at most 6 significant bits, magnitudes in [2^-10, 2688])."""
    q, scale = rows_contiguous(q), rows_contiguous(scale)
    m, k = q.shape[0], 2 * q.shape[1]
    out = torch.empty((m, k), dtype=out_dtype, device=q.device)
    if out.numel():
        tile_m, tile_k = _DECODE_TILE
        with device_guard(q):
            _nvfp4_decode_kernel[(cdiv(m, tile_m) * cdiv(k, tile_k),)](
                q, scale, scale if amax is None else amax, out, m, k, q.stride(0), scale.stride(0), BM=tile_m, BK=tile_k,
                TENSOR_SCALE=amax is not None, HW_CAST=hw_fp8_cast(q.device), num_warps=4,
            )  # fmt: skip
    return out


def dequantize_nvfp4(q, scale, amax, out_dtype, e4m3_max=448):
    """x[i, j] = e2m1(q)[i, j] * ((e4m3(scale[i, j // 16]) * amax) * fp32(1 / 2688)), float32, cast to ``out_dtype``.

    Bit-identical to the reference backend (one kernel); the E4M3 bound 448 only.

    Raises:
        TypeError: q or scale not uint8, amax not float32. ValueError: shapes that do not fit, a bad out_dtype or
        e4m3_max. NotImplementedError: e4m3_max 256 (declined by ``SUPPORTS``; the reference runs it).
    """
    check_nvfp4_operand(q, scale, amax, "q", e4m3_max)
    check_out_dtype(out_dtype)
    _refuse_bounds(e4m3_max=e4m3_max)
    return _decode(q, scale, amax, out_dtype)


def gemm_nvfp4(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias=None, out=None, accumulate=False, a_e4m3_max=448,
               b_e4m3_max=448):
    """D = A @ B^T + bias (+ out when ``accumulate``) on NVFP4 operands, emulated on bfloat16 tensor cores.

    A @ B^T = (a_amax / 2688) (b_amax / 2688) V_a @ V_b^T with V = e2m1 * e4m3 exact in bfloat16 (see the
    module docstring): two decode launches, one bfloat16 GEMM with float32 output, one epilogue launch.

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        TypeError / ValueError: as the reference (either operand, K that differ, a bad bias / out,
        accumulate without out, a bad E4M3 bound). NotImplementedError: a bound 256 (declined by ``SUPPORTS``).
    """
    dtype = check_gemm_nvfp4(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias, out, accumulate, a_e4m3_max, b_e4m3_max)
    _refuse_bounds(a_e4m3_max=a_e4m3_max, b_e4m3_max=b_e4m3_max)
    result = out if out is not None else torch.empty((a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
    if result.numel():
        acc = mm_f32(_decode(a, a_scale, None, torch.bfloat16), _decode(b, b_scale, None, torch.bfloat16))
        finish_gemm(acc, result, bias=bias, accumulate=accumulate, amaxes=(a_amax, b_amax), amax_factor=_DECODE_FACTOR.value)
    return result


# -- what the kernels decline ----------------------------------------------------------------------
def _refuse_bounds(**e4m3_bounds) -> None:
    """NotImplementedError for an E4M3 bound the kernels do not implement (256: 4over6's)."""
    reason = _unimplemented_option(**e4m3_bounds)
    if reason:
        raise NotImplementedError(reason)


def _dequantize_supported(q, scale, amax, out_dtype, e4m3_max=448):
    """Decline the bound 256 and a scale or an amax on another device than q (the reference runs the one, moves the amax)."""
    reason = _unimplemented_option(e4m3_max=e4m3_max)
    if reason:
        return Reject(reason)
    return on_device(q.device, scale=scale, amax=amax) if isinstance(q, torch.Tensor) else True


def _gemm_supported(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias=None, out=None, accumulate=False, a_e4m3_max=448,
                    b_e4m3_max=448):
    """Decline a bound 256 and any tensor on another device than a (the reference runs the one, moves the amaxes)."""
    reason = _unimplemented_option(a_e4m3_max=a_e4m3_max, b_e4m3_max=b_e4m3_max)
    if reason:
        return Reject(reason)
    if not isinstance(a, torch.Tensor):
        return True
    return on_device(a.device, b=b, a_scale=a_scale, b_scale=b_scale, a_amax=a_amax, b_amax=b_amax, bias=bias, out=out)


SUPPORTS = {"dequantize_nvfp4": _dequantize_supported, "gemm_nvfp4": _gemm_supported}
