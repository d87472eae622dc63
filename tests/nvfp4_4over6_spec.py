"""An independent model of NVFP4 4over6 written from NVIDIA TE's algorithm, for the tests (not library code).

TE 2.17 (``cast/nvfp4/quantize_4over6_nvfp4.cuh``): a copy x [R, C] with amax = max |x| (NaN ignored) and the
global scale's E4M3 bound B (448 or 256) gives every block of 16 (or 16 x 16 tile) two candidates,

    S_enc = fp32(6 B / amax) capped at fp32_max (1 for amax = 0 or S_enc = 0),  S_dec = fp32(1 / S_enc)
    base  = fp32(fp32(b_amax / 6) * S_enc);  s_6 = e4m3(min(base, 448)),  s_4 = e4m3(min(fp32(base * 1.5), 448))
    q_c   = e2m1(clip(fp32(x * enc_c), -6, 6)),  enc_c = min(fp32(1 / fp32(s_c * S_dec)), fp32_max)

and keeps map-to-4 iff its error is strictly smaller, the error of a block being the float32 sum, in element
order from 0, of |d| (MAE) or d * d (MSE) with d = fp32(fp32(fp32(fp32(v * s) * amax) / 6 B) - x) for each
element's value v = e2m1(q_c); a tile sums its 16 row errors as TE's warp shuffle does (a_i = r_i + r_(i+8),
then offsets 4, 2, 1). The decode is x_hat = fp32(v * fp32(fp32(s * amax) * fp32(1 / 6 B))).

Every float32 operation is done here in float64 and rounded to float32, one element at a time where TE loops,
E2M1 / E4M3 rounding is a search in their grids (``tests/nvfp4_spec.py``): no code is shared with the library.
"""

from __future__ import annotations

from typing import Tuple

import torch

from tests.nvfp4_spec import BLOCK, E2M1_GRID, E4M3_GRID, FP32_MAX, f32, round_to_grid

__all__ = ["spec_4over6_copy", "spec_4over6_decode", "spec_4over6_errors"]


def _scalar_f32(value: float) -> float:
    return f32(torch.tensor(value, dtype=torch.float64)).item()


def _global_scales(amax: float, bound: int) -> Tuple[float, float]:
    s_enc = FP32_MAX if amax == 0 else min(_scalar_f32(6.0 * bound / amax), FP32_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = 1.0
    return s_enc, _scalar_f32(1.0 / s_enc)


def _block_amax(x: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """[R, C / 16] float64: the amax of each block (NaN ignored), with ``block_2d`` its tile's on each of its rows."""
    rows, cols = x.shape
    magnitude = torch.where(torch.isnan(x), 0.0, x.abs())
    if not block_2d:
        return magnitude.reshape(rows, cols // BLOCK, BLOCK).amax(dim=-1)
    tiles = magnitude.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).amax(dim=(1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)


def _candidate(x: torch.Tensor, decode_scale: torch.Tensor, s_dec: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(signed E2M1 codes [R, C], E4M3 scale codes [R, C / 16]) of x under the block decode scales (before the E4M3 cast)."""
    rows, cols = x.shape
    scale = round_to_grid(decode_scale.clamp(max=448.0), E4M3_GRID)
    denominator = f32(E4M3_GRID[scale] * s_dec)
    enc = torch.where(denominator == 0, FP32_MAX, f32(1.0 / denominator)).clamp(max=FP32_MAX)
    y = f32(x.reshape(rows, cols // BLOCK, BLOCK) * enc.unsqueeze(-1)).reshape(rows, cols)
    code = round_to_grid(y.abs().clamp(max=6.0).nan_to_num(nan=0.0), E2M1_GRID) + 8 * torch.signbit(y).long()
    return torch.where(torch.isnan(y), 7, code), scale


def _values(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_GRID[codes % 8] * (1 - 2 * (codes // 8)).double()


def spec_4over6_errors(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, amax: float, bound: int, mode: str) -> torch.Tensor:
    """[R, C / 16]: each block's float32 error sum of one candidate (codes [R, C], scale codes [R, C / 16])."""
    rows, cols = x.shape
    s = E4M3_GRID[scale].repeat_interleave(BLOCK, dim=1)
    d = f32(f32(f32(f32(_values(codes) * s) * amax) / (6.0 * bound)) - x)
    e = d.abs() if mode == "MAE" else f32(d * d)
    e = e.reshape(rows, cols // BLOCK, BLOCK)
    total = torch.zeros(rows, cols // BLOCK, dtype=torch.float64)
    for i in range(BLOCK):
        total = f32(total + e[..., i])
    return total


def _tile_sums(err: torch.Tensor) -> torch.Tensor:
    """[R, C / 16] row errors -> the same shape holding each tile's sum in the warp-shuffle order on its 16 rows."""
    rows, n_blocks = err.shape
    r = [err.reshape(rows // BLOCK, BLOCK, n_blocks)[:, i] for i in range(BLOCK)]
    for half in (8, 4, 2, 1):
        r = [f32(r[i] + r[i + half]) for i in range(half)]
    return r[0].repeat_interleave(BLOCK, dim=0)


def spec_4over6_copy(x: torch.Tensor, amax: float, bound: int, mode: str, block_2d: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 codes int64 [R, C], E4M3 scale codes int64 [R, C / 16], map-to-4 bool [R, C / 16]) of the 4over6 copy of x."""
    x = x.double()
    s_enc, s_dec = _global_scales(amax, bound)
    base = f32(f32(_block_amax(x, block_2d) / 6.0) * s_enc)
    codes_4, scale_4 = _candidate(x, f32(base * 1.5), s_dec)
    codes_6, scale_6 = _candidate(x, base, s_dec)
    err_4 = spec_4over6_errors(x, codes_4, scale_4, amax, bound, mode)
    err_6 = spec_4over6_errors(x, codes_6, scale_6, amax, bound, mode)
    if block_2d:
        err_4, err_6 = _tile_sums(err_4), _tile_sums(err_6)
    map_to_4 = err_4 < err_6
    codes = torch.where(map_to_4.repeat_interleave(BLOCK, dim=1), codes_4, codes_6)
    return codes, torch.where(map_to_4, scale_4, scale_6), map_to_4


def spec_4over6_decode(codes: torch.Tensor, scale: torch.Tensor, amax: float, bound: int) -> torch.Tensor:
    """x_hat (float64 holding float32 values) of codes [R, C] and scale codes [R, C / 16] under the bound."""
    factor = _scalar_f32(1.0 / (6.0 * bound))
    block = f32(f32(E4M3_GRID[scale] * amax) * factor).repeat_interleave(BLOCK, dim=1)
    return f32(_values(codes) * block)
