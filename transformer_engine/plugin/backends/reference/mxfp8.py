"""Reference (pure PyTorch) MXFP8 ops. See plugin/catalog/mxfp8.py for the contract.

Per block B of 32 elements, with rcp = fp32(1 / fp8_max) (448 for E4M3, 57344 for E5M2):

    amax = max |x| over B (NaN ignored),  v = fp32(amax * rcp)
    s    = e8m0_round_up(v): the biased exponent of v, plus one when v is not a power of two,
           saturating at 254 (inf -> 254), 0 for v <= 2^-127, NaN -> 255 (TE's ``ptx::float_to_e8m0``)
    q    = cast_fp8(clip(x * 2^(127 - s)))      (``ptx::exp2f_rcp``: 2^-127 for s = 254, NaN for s = 255)
    x_hat = q * 2^(s - 127)                     (2^-127 for s = 0, NaN for s = 255)

The powers of two are built from their float32 bit patterns (exact, whatever the device's exp2).
``gemm_mxfp8`` dequantizes both operands to float32 and runs the reference float32 GEMM.
"""

from __future__ import annotations

import functools
import struct
from typing import Tuple

import torch

from .._fp8 import check_out_dtype, fp8_max_of, saturating_cast
from .._mxfp8_checks import MXFP8_BLOCK as BLOCK
from .._mxfp8_checks import check_gemm_mxfp8, check_mxfp8_operand, check_quantize_mxfp8
from .gemm import gemm

__all__ = ["quantize_mxfp8", "dequantize_mxfp8", "gemm_mxfp8"]

_MANTISSA_BITS = 23
_TWO_POW_MINUS_127_BITS = 0x00400000  # 2^-127, a float32 subnormal: not reachable by shifting an exponent
_NAN_BITS = 0x7FC00000


@functools.lru_cache(maxsize=None)
def _rcp_fp8_max(fp8_dtype: torch.dtype) -> float:
    """fp32(1 / fp8_max) as a Python float: TE's ``Quantized_Limits<T>::max_norm_rcp`` (1.0 / max_norm, to float)."""
    return struct.unpack("f", struct.pack("f", 1.0 / fp8_max_of(fp8_dtype)))[0]  # no tensor: safe under fake tensors


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """s = e8m0_round_up(fp32(amax * fp32(1 / fp8_max))) as uint8 (see the module docstring); amax float32 >= 0 or NaN."""
    return e8m0_round_up(amax * torch.full_like(amax, _rcp_fp8_max(fp8_dtype)))  # float32 product, one rounding


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponent of float32 v >= 0 rounded up to a power of two, saturating (TE's ``float_to_e8m0``).

    s = exponent(v) + 1 when v's mantissa is not zero (not a power of two), except at 254 (saturation)
    and for v <= 2^-127 (a subnormal whose mantissa is at most 2^22: code 0, i.e. 2^-127); inf -> 254; NaN -> 255.
    """
    bits = v.view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) & 0xFF
    mantissa = bits & 0x7FFFFF
    at_most_min = (exponent == 0) & (mantissa <= 0x400000)  # v <= 2^-127 (zero included): the smallest scale
    s = exponent + ((mantissa > 0) & (exponent != 0xFE) & ~at_most_min).to(torch.int32)
    s = torch.where(torch.isinf(v), 254, s)
    s = torch.where(torch.isnan(v), 255, s)
    return s.to(torch.uint8)


def _pow2_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def decode_scale(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) as float32 (NaN for s = 255), exactly."""
    s = scale_e8m0.to(torch.int32)
    bits = torch.where(s == 0, _TWO_POW_MINUS_127_BITS, s << _MANTISSA_BITS)
    return _pow2_from_bits(torch.where(s == 255, _NAN_BITS, bits))


def _encode_multiplier(s: torch.Tensor) -> torch.Tensor:
    """2^(127 - s) as float32, what the cast multiplies x by (2^-127 for s = 254, NaN for s = 255)."""
    s = s.to(torch.int32)
    bits = torch.where(s == 254, _TWO_POW_MINUS_127_BITS, (254 - s) << _MANTISSA_BITS)
    return _pow2_from_bits(torch.where(s == 255, _NAN_BITS, bits))


def _quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q [R, C], s uint8 [R, C / 32]) of a 2-D x with C % 32 == 0: blocks of 32 along each row."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    magnitude = blocks.abs()
    amax = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(dim=-1)  # TE's fmaxf: NaN ignored, inf kept
    s = e8m0_from_amax(amax, fp8_dtype)
    q = saturating_cast(blocks * _encode_multiplier(s).unsqueeze(-1), fp8_dtype)
    return q.reshape(rows, cols), s


def quantize_mxfp8(x, fp8_dtype, rowwise, columnwise):
    """MXFP8 cast of x [M, N] into its row-wise (blocks along N) and/or column-wise (x^T, blocks along M) copies.

    Returns:
        (data [M, N], scale uint8 [M, N / 32], data_t [N, M], scale_t uint8 [N, M / 32]), None where not asked.

    Raises:
        TypeError: x is not a high-precision float tensor, or a flag is not a bool.
        ValueError: x not 2-D, neither copy asked for, a bad fp8_dtype, or a dim not divisible by 32.
    """
    check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    data, scale = _quantize_rows(x, fp8_dtype) if rowwise else (None, None)
    data_t, scale_t = _quantize_rows(x.t(), fp8_dtype) if columnwise else (None, None)
    return data, scale, data_t, scale_t


def _dequantize_f32(q: torch.Tensor, scale_e8m0: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    blocks = q.float().reshape(m, k // BLOCK, BLOCK) * decode_scale(scale_e8m0).unsqueeze(-1)
    return blocks.reshape(m, k)


def dequantize_mxfp8(q, scale_e8m0, out_dtype):
    """x[i, j] = q[i, j] * 2^(scale_e8m0[i, j // 32] - 127), in float32, cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8 or the scale not uint8. ValueError: shapes that do not fit, a bad out_dtype.
    """
    check_mxfp8_operand(q, scale_e8m0, "q")
    check_out_dtype(out_dtype)
    return _dequantize_f32(q, scale_e8m0).to(out_dtype)


def gemm_mxfp8(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias=None, out=None, accumulate=False):
    """D = A @ B^T + bias (+ out when ``accumulate``) on the dequantized MXFP8 operands, in float32.

    Raises:
        TypeError / ValueError: as :func:`dequantize_mxfp8` for either operand; K that differ, a bad
        bias / out, accumulate without out (see the reference ``gemm``).
    """
    check_gemm_mxfp8(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias, out, accumulate)
    return gemm(_dequantize_f32(a, a_scale_e8m0), _dequantize_f32(b, b_scale_e8m0), bias=bias, trans_b=True,
                out_dtype=out_dtype, out=out, accumulate=accumulate)
