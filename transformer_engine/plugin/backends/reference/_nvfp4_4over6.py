"""4over6's choice between two NVFP4 candidates of a block (contract and math: plugin/catalog/nvfp4.py).

NVIDIA TE (``cast/nvfp4/quantize_4over6_nvfp4.cuh``, ``custom_recipes/reference_nvfp4.py``) quantizes every
block of 16 (or 16 x 16 tile) with its map-to-6 scale s_6 and its map-to-4 scale s_4 (the block scale times
1.5), measures each candidate's error in the input's domain and keeps map-to-4 only where it is strictly
smaller. Per element and candidate c, each step one float32 operation:

    d = (((e2m1(q_c) * s_c) * amax) / (6 * e4m3_max)) - x,   e = |d| (MAE) or d * d (MSE)

summed along the block in element order from 0 (TE's per-thread loop); a 16 x 16 tile sums its 16 row errors
in the order of TE's warp shuffle (offsets 8, 4, 2, 1). These functions take the float32 values only: the
candidates themselves are the plain NVFP4 cast's (``nvfp4.py``).
"""

from __future__ import annotations

import torch

from .._nvfp4_checks import NVFP4_BLOCK as BLOCK

__all__ = ["block_errors", "keep_map_to_4", "tile_errors"]


def block_errors(blocks: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int,
                 mode: str) -> torch.Tensor:
    """err [R, C / 16]: each block's summed error of one candidate.

    Args:
        blocks: x as float32 [R, C / 16, 16]. values: the candidate's E2M1 values, float32 [R, C / 16, 16].
        scale: its E4M3 block scales as float32 [R, C / 16]. amax: the copy's amax (0-d float32).
        e4m3_max: the global scale's bound (448 or 256). mode: "MAE" or "MSE".
    """
    denominator = torch.full_like(amax, 6.0 * e4m3_max)  # a tensor divisor: a true division on every device
    diff = ((values * scale.unsqueeze(-1)) * amax) / denominator - blocks
    error = diff.abs() if mode == "MAE" else diff * diff
    total = torch.zeros_like(error[..., 0])
    for i in range(BLOCK):  # TE's order, not torch.sum's
        total = total + error[..., i]
    return total


def tile_errors(row_errors: torch.Tensor) -> torch.Tensor:
    """err [R / 16, C / 16] of each 16 x 16 tile from its rows' errors [R, C / 16]: a_i = r_i + r_(i+8),
    b_i = a_i + a_(i+4), c_i = b_i + b_(i+2), c_0 + c_1 (TE's ``reduce_group_sum_16``)."""
    rows, cols = row_errors.shape
    r = row_errors.reshape(rows // BLOCK, BLOCK, cols)
    a = r[:, :8] + r[:, 8:]
    b = a[:, :4] + a[:, 4:]
    c = b[:, :2] + b[:, 2:]
    return c[:, 0] + c[:, 1]


def keep_map_to_4(error_4: torch.Tensor, error_6: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """bool [R, C / 16]: where a block keeps map-to-4, err_4 < err_6 (a tie or a NaN keeps map-to-6); with
    ``block_2d`` the comparison is per tile, of the tile sums, repeated on the tile's rows."""
    if not block_2d:
        return error_4 < error_6
    return (tile_errors(error_4) < tile_errors(error_6)).repeat_interleave(BLOCK, dim=0)
