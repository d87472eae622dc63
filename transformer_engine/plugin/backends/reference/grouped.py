"""Reference (pure PyTorch) grouped ops: one call over the G row splits of a mixture-of-experts layer's tokens.
See plugin/catalog/quantization.py (``cast_transpose_grouped``, ``current_scale_grouped``, ``column_sums_grouped``) and gemm.py
(``gemm_grouped*``) for the contract.

Each is the per-split op run G times, so it is the oracle of the single-launch kernels and equals, bit for bit,
a layer that calls the per-split ops itself:

    cast_transpose_grouped   q[rows of g] = quantize(x_g, scale[g]), q_t = q^T, amax[g] = max|x_g|
    current_scale_grouped    (scale[g], amax[g]) = current_scale(x_g)
    column_sums_grouped      out[g] = sum_rows(x_g) in float32, then one rounding
    gemm_grouped             D[rows of g] = gemm(a_g, b[g], trans_b=True) (+ bias[g])
    gemm_grouped_wgrad       D[g] = gemm(a_t[:, cols of g], b_t[:, cols of g], trans_b=True), 0 for an empty split
"""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import (
    check_cast_transpose_grouped, check_dbias_dtype, check_gemm_grouped, check_gemm_grouped_wgrad, check_grouped_rows, gemm_result_dtype,
)
from .._splits import split_bounds
from .gemm import gemm
from .quantization import _column_sums, current_scale, quantize

__all__ = ["cast_transpose_grouped", "column_sums_grouped", "current_scale_grouped", "gemm_grouped", "gemm_grouped_wgrad"]


def cast_transpose_grouped(x, m_splits, scale, fp8_dtype, amax_out=None):
    """``quantize`` of each row split x_g with scale[g] (its amax into amax_out[g]), then q_t = q^T.

    Returns:
        (q [M, K], q_t [K, M], scale_inv [G], amax [G]) as in the catalog.

    Raises:
        TypeError / ValueError: as ``quantize``, x not 2-D, splits that do not sum to M, a scale or amax_out
        that is not float32 [G] on x's device.
    """
    check_cast_transpose_grouped(x, m_splits, scale, fp8_dtype, amax_out)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale_invs, amaxes = [], []
    for g, (start, stop) in enumerate(split_bounds(m_splits)):
        q[start:stop], scale_inv, amax = quantize(x[start:stop], scale[g], fp8_dtype, None if amax_out is None else amax_out[g])
        scale_invs.append(scale_inv)
        amaxes.append(amax)
    return q, q.t().contiguous(), torch.stack(scale_invs), amax_out if amax_out is not None else torch.stack(amaxes)


def current_scale_grouped(x, m_splits, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """``current_scale`` of each row split x_g, stacked: (scale [G], amax [G]) as in the catalog.

    Raises:
        TypeError / ValueError: as ``current_scale``, x not 2-D, splits that do not sum to M.
    """
    check_grouped_rows(x, m_splits)
    results = [current_scale(x[start:stop], fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
               for start, stop in split_bounds(m_splits)]
    scales, amaxes = zip(*results)
    return torch.stack(scales), torch.stack(amaxes)


def column_sums_grouped(x, m_splits, out_dtype=None):
    """out[g, j] = sum of x_g[:, j], accumulated in float32 (torch's sum), rounded once to ``out_dtype``.

    Raises:
        TypeError / ValueError: x not a high-precision [M, N] tensor, bad splits, a bad out_dtype.
    """
    check_grouped_rows(x, m_splits)
    check_dbias_dtype(out_dtype)
    return torch.stack([_column_sums(x[start:stop], out_dtype) for start, stop in split_bounds(m_splits)])


def _scale_of(scale_inv: Optional[torch.Tensor], g: int) -> Optional[torch.Tensor]:
    return None if scale_inv is None else scale_inv[g]


def gemm_grouped(a, b, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, bias=None, use_split_accumulator=True):
    """D[rows of g] = a_g @ b[g]^T (+ bias[g]) by ``gemm`` per split, in float32 from the dequantized operands.

    Raises:
        TypeError / ValueError: as ``check_gemm_grouped`` (a not [M, K] or b not [G, N, K], splits that do not sum
        to M, bias not [G, N], a missing or extra scale_inv, FP8 a without out_dtype).
    """
    check_gemm_grouped(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias)
    d = torch.empty((a.shape[0], b.shape[1]), dtype=gemm_result_dtype(out_dtype, None, accumulate=False, default=a.dtype), device=a.device)
    for g, (start, stop) in enumerate(split_bounds(m_splits)):
        if stop > start:
            d[start:stop] = gemm(a[start:stop], b[g], bias=None if bias is None else bias[g], a_scale_inv=_scale_of(a_scale_inv, g),
                                 b_scale_inv=_scale_of(b_scale_inv, g), trans_b=True, out_dtype=d.dtype)
    return d


def gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, use_split_accumulator=True):
    """D[g] = a_t[:, cols of g] @ b_t[:, cols of g]^T by ``gemm`` per split; D[g] = 0 for an empty split.

    Raises:
        ValueError: a_t not [N, M] or b_t not [K, M], splits that do not sum to M, scales as in ``gemm_grouped``.
    """
    check_gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv, b_scale_inv, out_dtype)
    dtype = gemm_result_dtype(out_dtype, None, accumulate=False, default=a_t.dtype)
    d = torch.zeros((len(m_splits), a_t.shape[0], b_t.shape[0]), dtype=dtype, device=a_t.device)
    for g, (start, stop) in enumerate(split_bounds(m_splits)):
        if stop > start:
            d[g] = gemm(a_t[:, start:stop], b_t[:, start:stop], a_scale_inv=_scale_of(a_scale_inv, g),
                        b_scale_inv=_scale_of(b_scale_inv, g), trans_b=True, out_dtype=dtype)
    return d
