"""Column sums of partial rows: the second, deterministic pass of a reduction over rows.

A kernel that reduces over rows without atomics writes one float32 row of partial sums per program
(or per tile row); this pass sums those P rows per column:

    out[j] = sum_p parts[p, j]        parts float32 [P, H], out [H] in the caller's dtype

Each program owns BLOCK_H columns and walks the P rows in BLOCK_P steps, so the order of the
additions, and the result, never depends on scheduling. Two inputs of one shape (a norm's dgamma
and dbeta partials) share one launch. ``segment_column_sums`` sums each segment of rows on its own
(the row splits of a grouped layer's dy: its bias gradients), one program per segment and column block.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, device_guard
from ._launch import cached_launch

__all__ = ["column_sums", "segment_column_sums"]

_BLOCK_P, _BLOCK_H = 64, 32  # tile of one step: H / 32 programs, each reading 64 rows per step


@cached_launch
@triton.jit
def _column_sums_kernel(
    a_ptr,  # *[P, H] partial rows (float32; any float dtype with SEGMENTS), row stride stride_a
    b_ptr,  # *float32 [P, H] second partial rows (HAS_B only)
    out_a_ptr,  # *[H] column sums of a ([G, H] with SEGMENTS)
    out_b_ptr,  # *[H] column sums of b (HAS_B only)
    ends_ptr,  # *int32 [G] with SEGMENTS: segment g is rows ends[g - 1] .. ends[g] - 1 (ends[-1] = 0)
    P,  # partial rows
    H,  # columns
    stride_a,  # elements between rows of a
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_B: tl.constexpr,
    SEGMENTS: tl.constexpr,  # sum each segment of rows on its own (program axis 1: the segment)
):
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    start, stop = 0, P
    if SEGMENTS:
        segment = tl.program_id(1)
        stop = tl.load(ends_ptr + segment)
        start = tl.load(ends_ptr + segment - 1, mask=segment > 0, other=0)
        out_a_ptr += segment * H
    sum_a = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    sum_b = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for p0 in range(start, stop, BLOCK_P):
        rows = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (rows < stop)[:, None] & col_mask[None, :]
        sum_a += tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            sum_b += tl.load(b_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0)
    tl.store(out_a_ptr + cols, tl.sum(sum_a, axis=0).to(out_a_ptr.dtype.element_ty), mask=col_mask)
    if HAS_B:
        tl.store(out_b_ptr + cols, tl.sum(sum_b, axis=0).to(out_b_ptr.dtype.element_ty), mask=col_mask)


def column_sums(a: torch.Tensor, out_dtype: torch.dtype, b: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(column sums of a, of b or None) in ``out_dtype``, one launch; a and b contiguous float32 [P, H]
    (the launchers' own buffers: not validated here). One float32 row is its own sum: no launch (a small
    layer's dbias, whose cast had a single tile row)."""
    p, h = a.shape
    if p == 1 and out_dtype == torch.float32:
        return a[0], None if b is None else b[0]
    out_a = torch.empty(h, dtype=out_dtype, device=a.device)
    out_b = None if b is None else torch.empty(h, dtype=out_dtype, device=a.device)
    if h:
        with device_guard(a):
            _column_sums_kernel[(cdiv(h, _BLOCK_H),)](
                a, a if b is None else b, out_a, out_a if b is None else out_b, None, p, h, h,
                BLOCK_P=_BLOCK_P, BLOCK_H=_BLOCK_H, HAS_B=b is not None, SEGMENTS=False,
            )  # fmt: skip
    return out_a, out_b


def segment_column_sums(x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out[g, j] = sum of x[r, j] over the rows of segment g (``ends``: int32 [G] cumulative row counts on x's
    device), accumulated in float32, one launch; x [P, H] of any float dtype with unit column stride (not validated)."""
    p, h = x.shape
    out = torch.empty((ends.shape[0], h), dtype=out_dtype, device=x.device)
    if h:
        with device_guard(x):
            _column_sums_kernel[(cdiv(h, _BLOCK_H), ends.shape[0])](
                x, x, out, out, ends, p, h, x.stride(0), BLOCK_P=_BLOCK_P, BLOCK_H=_BLOCK_H, HAS_B=False, SEGMENTS=True,
            )  # fmt: skip
    return out
