"""The fused softmax family in Triton (Megatron-style attention scores), forward and backward.

Scores are viewed as R rows of sk; row r is query i = r mod sq of batch r // (h sq). In float32:

    forward   z = scale * x, then z_ij = -10000 where mask_ij (masked variant), or -inf where
              j > i + offset (offset 0: upper-triangular, sk - sq: aligned-causal);
              y = exp(z - max_j z) / sum_j exp(z - max_j z);  a row with every position masked gives 0
    backward  dx = scale * y * (dy - sum_j dy_j y_j)          (the same for every variant)

One program holds ROWS whole rows (sk padded to a power of two), so sk is limited to
``MAX_FUSED_SIZE``; longer rows are declined (``SUPPORTS``) and run on the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import check_softmax_bwd, check_softmax_input, check_softmax_mask
from transformer_engine.plugin.core import Reject

from ._common import MAX_FUSED_SIZE, cdiv, device_guard, row_block, rows_view, warps_for
from ._launch import cached_launch

__all__ = [
    "scaled_softmax_forward",
    "scaled_softmax_backward",
    "scaled_masked_softmax_forward",
    "scaled_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax_forward",
    "scaled_upper_triang_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax_forward",
    "scaled_aligned_causal_masked_softmax_backward",
]


@cached_launch
@triton.jit
def _softmax_fwd_kernel(
    x_ptr,  # *x [R, SK], row stride stride_x
    y_ptr,  # *y [R, SK] contiguous, x's dtype
    mask_ptr,  # *uint8 [B_mask, SQ, SK] contiguous, 1 = masked (MASK == "tensor" only)
    R,  # rows
    SK,  # row length (keys)
    SQ,  # queries per (batch, head)
    stride_x,  # elements between rows of x
    rows_per_batch,  # h * sq: rows sharing one mask batch
    mask_batch_stride,  # elements between mask batches (0 when the mask broadcasts over b)
    causal_offset,  # j > i + causal_offset is masked (MASK == "causal" only)
    scale,  # multiplier of x
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    MASK: tl.constexpr,  # "none", "tensor" or "causal"
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    valid = (rows < R)[:, None] & (cols < SK)[None, :]
    rows64 = rows.to(tl.int64)
    z = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=valid, other=0.0).to(tl.float32) * scale
    query = rows % SQ
    kept = valid
    if MASK == "tensor":
        batch = (rows // rows_per_batch).to(tl.int64)
        m_offs = batch[:, None] * mask_batch_stride + query[:, None] * SK + cols[None, :]
        masked = tl.load(mask_ptr + m_offs, mask=valid, other=0) != 0
        z = tl.where(masked, -10000.0, z)
        kept = valid & (masked == 0)
    elif MASK == "causal":
        kept = valid & (cols[None, :] <= query[:, None] + causal_offset)
        z = tl.where(kept, z, float("-inf"))
    z = tl.where(valid, z, float("-inf"))
    z_max = tl.max(z, axis=1)
    z_max = tl.where(z_max == float("-inf"), 0.0, z_max)  # fully masked row: no inf - inf
    e = tl.where(valid, tl.exp(z - z_max[:, None]), 0.0)
    y = e / tl.sum(e, axis=1)[:, None]
    if MASK != "none":
        y = tl.where(tl.sum(kept.to(tl.int32), axis=1)[:, None] > 0, y, 0.0)
    tl.store(y_ptr + rows64[:, None] * SK + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=valid)


@cached_launch
@triton.jit
def _softmax_bwd_kernel(
    dy_ptr,  # *dy [R, SK], row stride stride_dy
    y_ptr,  # *y [R, SK], row stride stride_y
    dx_ptr,  # *dx [R, SK] contiguous, dy's dtype
    R,  # rows
    SK,  # row length
    stride_dy,  # elements between rows of dy
    stride_y,  # elements between rows of y
    scale,  # the forward's multiplier of x
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    valid = (rows < R)[:, None] & (cols < SK)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + rows64[:, None] * SK + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=valid)


def _forward(x, scale, mask_kind: str, mask=None, causal_offset: int = 0):
    """Launch the forward kernel on x viewed as [R, sk]; sq = x.shape[-2] (1 for 1-D x)."""
    x_rows = rows_view(x)
    r, sk = x_rows.shape
    sq = x.shape[-2] if x.dim() >= 2 else 1
    heads = x.shape[1] if x.dim() == 4 else 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mask_arg, mask_batch_stride = y, 0
    if mask is not None:
        mask_arg = mask.contiguous().view(torch.uint8)
        mask_batch_stride = sq * sk if mask.shape[0] > 1 else 0
    block_n, rows = row_block(r, sk)
    if r and sk:
        with device_guard(x):
            _softmax_fwd_kernel[(cdiv(r, rows),)](
                x_rows, y, mask_arg, r, sk, sq, x_rows.stride(0), heads * sq, mask_batch_stride, causal_offset,
                float(scale), BLOCK_N=block_n, ROWS=rows, MASK=mask_kind, num_warps=warps_for(block_n * rows),
            )  # fmt: skip
    return y


def _backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y)) in float32, in dy's dtype."""
    check_softmax_bwd(dy, y)
    dy_rows, y_rows = rows_view(dy), rows_view(y)
    r, sk = dy_rows.shape
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    block_n, rows = row_block(r, sk)
    if r and sk:
        with device_guard(dy):
            _softmax_bwd_kernel[(cdiv(r, rows),)](
                dy_rows, y_rows, dx, r, sk, dy_rows.stride(0), y_rows.stride(0), float(scale),
                BLOCK_N=block_n, ROWS=rows, num_warps=warps_for(block_n * rows),
            )  # fmt: skip
    return dx


def scaled_softmax_forward(x, scale):
    """y = softmax(scale * x, dim=-1), computed in float32, in x's dtype."""
    check_softmax_input(x, None, "any shape")
    return _forward(x, scale, "none")


def scaled_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _backward(dy, y, scale)


def scaled_masked_softmax_forward(x, mask, scale):
    """y = softmax(scale * x with -10000 where mask); x [b, h, sq, sk], mask [b or 1, 1, sq, sk] bool.

    Raises:
        ValueError: x not 4-D, or a mask that is not boolean [b or 1, 1, sq, sk].
    """
    check_softmax_input(x, 4, "[b, h, sq, sk]")
    check_softmax_mask(x, mask)
    return _forward(x, scale, "tensor", mask=mask)


def scaled_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _backward(dy, y, scale)


def scaled_upper_triang_masked_softmax_forward(x, scale):
    """y = softmax(scale * x with x[.., i, j > i] = -inf); x is [b*h, sq, sk]."""
    check_softmax_input(x, 3, "[b*h, sq, sk]")
    return _forward(x, scale, "causal", causal_offset=0)


def scaled_upper_triang_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _backward(dy, y, scale)


def scaled_aligned_causal_masked_softmax_forward(x, scale):
    """y = softmax(scale * x with x[.., i, j > i + sk - sq] = -inf); x is [b, h, sq, sk]."""
    check_softmax_input(x, 4, "[b, h, sq, sk]")
    return _forward(x, scale, "causal", causal_offset=x.shape[3] - x.shape[2])


def scaled_aligned_causal_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _backward(dy, y, scale)


def _row_fits(t) -> object:
    """Reject rows longer than one Triton block."""
    if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] > MAX_FUSED_SIZE:
        return Reject(f"softmax rows of {t.shape[-1]} > {MAX_FUSED_SIZE}: one row must fit one Triton block")
    return True


def _fwd_fits(x, scale):
    return _row_fits(x)


def _masked_fwd_fits(x, mask, scale):
    verdict = _row_fits(x)
    if verdict and isinstance(mask, torch.Tensor) and isinstance(x, torch.Tensor) and mask.device != x.device:
        return Reject(f"mask is on {mask.device} but x on {x.device}")
    return verdict


def _bwd_fits(dy, y, scale):
    return _row_fits(dy)


SUPPORTS = {
    "scaled_softmax_forward": _fwd_fits,
    "scaled_masked_softmax_forward": _masked_fwd_fits,
    "scaled_upper_triang_masked_softmax_forward": _fwd_fits,
    "scaled_aligned_causal_masked_softmax_forward": _fwd_fits,
    **{name: _bwd_fits for name in __all__ if name.endswith("_backward")},
}
