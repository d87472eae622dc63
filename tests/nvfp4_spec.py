"""An independent model of NVFP4 written from the specification, for the tests (not library code).

NVIDIA TE's NVFP4 (``custom_recipes/quantization_nvfp4.py``, ``cast/nvfp4/core_nvfp4.cuh``,
``dequantize_nvfp4.cuh``): per copy x [R, C] with amax = max |x| (NaN ignored),

    S_enc = fp32(2688 / amax) capped at fp32_max (1 for amax = 0 or inf),  S_dec = fp32(1 / S_enc)
    s     = e4m3(min(fp32(fp32(b_amax / 6) * S_enc), 448)),  enc = min(fp32(1 / fp32(s * S_dec)), fp32_max)
    q     = e2m1(clip(fp32(x * enc), -6, 6)),  x_hat = fp32(q * fp32(fp32(s * amax) * fp32(1 / 2688)))

Here every float32 operation is done in float64 and rounded to float32 (exact for one +, *, / of
float32 operands), E4M3 and E2M1 are explicit grids built from their bit fields, rounding is a search in
the grid with ties to the even code, and the stochastic-rounding hash runs on Python integers: no code
is shared with the library's float32 tensor implementation.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

BLOCK = 16
FP32_MAX = float(torch.finfo(torch.float32).max)
RHT_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE's get_wgrad_sign_vector

__all__ = ["BLOCK", "E2M1_GRID", "E4M3_GRID", "f32", "spec_amax", "spec_copy", "spec_decode", "spec_rht", "spec_bits",
           "round_to_grid", "unpack"]


def _grid(exponent_bits: int, mantissa_bits: int, bias: int, drop_top: int) -> torch.Tensor:
    """Non-negative values of a float format, by code (subnormals at exponent field 0), float64."""
    values = []
    for e in range(2**exponent_bits):
        for m in range(2**mantissa_bits):
            fraction = m / 2**mantissa_bits
            values.append(fraction * 2.0 ** (1 - bias) if e == 0 else (1 + fraction) * 2.0 ** (e - bias))
    return torch.tensor(values[: len(values) - drop_top], dtype=torch.float64)


E2M1_GRID = _grid(2, 1, 1, 0)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
E4M3_GRID = _grid(4, 3, 7, 1)  # codes 0..126 (0x7F is NaN), max 448


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to float32 (nearest even) and back."""
    return t.float().double()


def round_to_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Code (int64) of the grid value nearest to v >= 0 (v <= grid max), ties to the even code."""
    hi = torch.searchsorted(grid, v.contiguous()).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = v - grid[lo], grid[hi] - v
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo)


def spec_amax(x: torch.Tensor) -> float:
    """max |x|, NaN ignored."""
    magnitude = x.double().abs()
    magnitude = magnitude[~torch.isnan(magnitude)]
    return magnitude.max().item() if magnitude.numel() else 0.0


def _global_scales(amax: float) -> Tuple[float, float]:
    s_enc = FP32_MAX if amax == 0 else min(f32(torch.tensor(2688.0 / amax)).item(), FP32_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = 1.0
    return s_enc, f32(torch.tensor(1.0 / s_enc)).item()


def _block_amax(x: torch.Tensor, block_2d: bool) -> torch.Tensor:
    rows, cols = x.shape
    magnitude = x.double().abs().nan_to_num(nan=0.0, posinf=float("inf"))
    if not block_2d:
        return magnitude.reshape(rows, cols // BLOCK, BLOCK).amax(dim=-1)
    tiles = magnitude.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).amax(dim=(1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)


def spec_copy(x: torch.Tensor, amax: float, block_2d: bool = False, bits: Optional[List[int]] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes int64 [R, C] (sign << 3 | k), E4M3 scale codes int64 [R, C / 16]) of the NVFP4 copy of x."""
    rows, cols = x.shape
    s_enc, s_dec = _global_scales(amax)
    s_dec_b = f32(f32(_block_amax(x, block_2d) / 6.0) * s_enc).clamp(max=448.0)
    scale = round_to_grid(s_dec_b, E4M3_GRID)
    denominator = f32(E4M3_GRID[scale] * s_dec)
    enc = torch.where(denominator == 0, FP32_MAX, f32(1.0 / denominator)).clamp(max=FP32_MAX)
    y = f32(x.double().reshape(rows, cols // BLOCK, BLOCK) * enc.unsqueeze(-1)).reshape(rows, cols)
    magnitude = y.abs().clamp(max=6.0).nan_to_num(nan=0.0)
    if bits is None:
        code = round_to_grid(magnitude, E2M1_GRID)
    else:
        code = _round_stochastic(magnitude, torch.tensor(bits, dtype=torch.int64).reshape(rows, cols))
    code = code + 8 * torch.signbit(y).long()
    return torch.where(torch.isnan(y), 7, code), scale


def _round_stochastic(magnitude: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round down to lo or up to hi: up iff (bits >> 8) / 2^24 < (|y| - lo) / (hi - lo)."""
    lo = torch.searchsorted(E2M1_GRID, magnitude.contiguous(), right=True) - 1
    hi = (lo + 1).clamp(max=len(E2M1_GRID) - 1)
    gap = E2M1_GRID[hi] - E2M1_GRID[lo]
    fraction = torch.where(gap > 0, (magnitude - E2M1_GRID[lo]) / gap.clamp(min=1e-300), 0.0)
    return lo + ((bits >> 8).double() / 2**24 < fraction).long()


def spec_decode(codes: torch.Tensor, scale: torch.Tensor, amax: float) -> torch.Tensor:
    """x_hat (float64 holding float32 values) of codes [R, C] and scale codes [R, C / 16]."""
    rows, cols = codes.shape
    value = E2M1_GRID[codes % 8] * (1 - 2 * (codes // 8)).double()
    factor = f32(torch.tensor(1.0 / 2688.0))
    block = f32(f32(E4M3_GRID[scale] * amax) * factor)
    return f32(value.reshape(rows, cols // BLOCK, BLOCK) * block.unsqueeze(-1)).reshape(rows, cols)


def spec_rht(x: torch.Tensor) -> torch.Tensor:
    """Each 16 elements v of a row of x mapped to v @ diag(signs) H16 / 4 (H16 = H2 kron ... kron H2), in x's dtype."""
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        hadamard = torch.kron(hadamard, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    matrix = torch.diag(torch.tensor(RHT_SIGNS, dtype=torch.float64)) @ hadamard / 4.0
    rows, cols = x.shape
    out = x.double().reshape(rows, cols // BLOCK, BLOCK) @ matrix
    return out.reshape(rows, cols).to(x.dtype)


def _lowbias32(v: int) -> int:
    v ^= v >> 16
    v = (v * 0x7FEB352D) % 2**32
    v ^= v >> 15
    v = (v * 0x846CA68B) % 2**32
    return v ^ (v >> 16)


def spec_bits(seed: int, copy: int, count: int) -> List[int]:
    """The 32 random bits of elements 0 .. count - 1 of a copy (row-major): h(i ^ h(seed_lo ^ h(seed_hi ^ copy)))."""
    seed %= 2**64
    key = _lowbias32((seed % 2**32) ^ _lowbias32((seed >> 32) ^ copy))
    return [_lowbias32((i % 2**32) ^ key) for i in range(count)]


def unpack(data: torch.Tensor) -> torch.Tensor:
    """E2M1 codes int64 [R, 2 C] of packed bytes [R, C], the low nibble holding the first element."""
    low, high = data.long() % 16, data.long() // 16
    return torch.stack((low, high), dim=-1).reshape(data.shape[0], -1)
