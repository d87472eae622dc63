"""An independent model of MXFP8 written from the specification, for the tests (not library code).

OCP Microscaling v1.0 with NVIDIA TE's scale rule (``ptx::float_to_e8m0`` of ``amax * max_norm_rcp``,
transformer_engine/common/util/ptx.cuh and cast_kernels.cuh; HEAD's ``exp2f_rcp``): per block of 32

    amax = max |x| (NaN ignored: fmaxf), v = fp32(amax * fp32(1 / fp8_max)),
    s    = clamp(ceil(log2(v)) + 127, 0, 254)   (0 for v = 0; 254 for v = inf),
    q    = round_to_nearest_even_fp8(clip(x * 2^(127 - s), -fp8_max, fp8_max)),  x_hat = q * 2^(s - 127).

Computed here in float64 with ``frexp``, powers of two as float64 bit patterns and an explicit FP8 grid (exponent of each value,
quantum 2^(E - mantissa_bits), ``torch.round`` = half to even), so it shares no code with the
library's bit-twiddling float32 implementation.
"""

from __future__ import annotations

from typing import Tuple

import torch

BLOCK = 32
# (max finite, mantissa bits, smallest normal exponent) of each FP8 format, from the OCP FP8 spec
FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}

__all__ = ["BLOCK", "FORMATS", "pow2", "spec_scales", "spec_quantize", "spec_qdq", "spec_round_fp8"]


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer e in [-1022, 1023], exactly (the IEEE double with biased exponent e + 1023)."""
    return ((e.long() + 1023) << 52).view(torch.float64)


def spec_round_fp8(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """y (float64) saturated to +-fp8_max and rounded to the nearest FP8 value, ties to even; NaN stays NaN."""
    fp8_max, mantissa_bits, min_exp = FORMATS[fp8_dtype]
    y = y.clamp(-fp8_max, fp8_max)
    _, exponent = torch.frexp(y.abs())  # |y| = m 2^exponent, m in [0.5, 1): floor(log2|y|) = exponent - 1
    e = torch.clamp(exponent - 1, min=min_exp)  # subnormals share the smallest normal exponent's quantum
    quantum = pow2(e - mantissa_bits)
    return torch.where(y == 0, y, torch.round(y / quantum) * quantum)


def spec_scales(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """E8M0 codes s (int64) of the blocks of 32 along the last dim of x [M, N]."""
    fp8_max = FORMATS[fp8_dtype][0]
    blocks = x.double().reshape(x.shape[0], -1, BLOCK).abs()
    amax = torch.where(torch.isnan(blocks), 0.0, blocks).amax(dim=-1)
    rcp = torch.tensor(1.0 / fp8_max, dtype=torch.float32).double()
    v = (amax * rcp).float().double()  # the exact product of two float32 numbers, rounded once to float32
    mantissa, exponent = torch.frexp(v)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)  # v = 2^(exponent - 1) exactly when m = 0.5
    s = torch.clamp(ceil_log2 + 127, 0, 254)
    s = torch.where(v == 0, 0, s)
    return torch.where(torch.isinf(v), 254, s).long()


def spec_quantize(x: torch.Tensor, fp8_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q as float64 FP8 values [M, N], s [M, N / 32]): the row-wise MXFP8 copy of x."""
    s = spec_scales(x, fp8_dtype)
    blocks = x.double().reshape(x.shape[0], -1, BLOCK)
    scaled = blocks * pow2(127 - s).unsqueeze(-1)
    return spec_round_fp8(scaled, fp8_dtype).reshape(x.shape), s


def spec_qdq(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x quantized row-wise (blocks of 32 along the last dim) and decoded, float64: x_hat = q * 2^(s - 127)."""
    q, s = spec_quantize(x, fp8_dtype)
    blocks = q.reshape(x.shape[0], -1, BLOCK)
    return (blocks * pow2(s - 127).unsqueeze(-1)).reshape(x.shape)
