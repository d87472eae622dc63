"""Argument checks of op contracts that every backend enforces the same way (before any work).

The checks belong to the op, not to one implementation, so the reference and the flagos backend
call these instead of each carrying a copy; the elementary ones live in ``reference/_fp8.py``.
"""

from __future__ import annotations

import torch

from transformer_engine.plugin.backends.reference._fp8 import (
    check_fp8_output,
    check_high_precision,
    check_last_dim,
    check_out_dtype,
    check_tensor,
)

__all__ = ["check_norm_fwd", "check_norm_bwd", "check_softmax_mask"]


def check_norm_fwd(x, weight, bias, eps, fp8_scale, fp8_dtype, out_dtype) -> None:
    """layernorm_fwd / rmsnorm_fwd: float x with a non-empty last dim H, weight (and bias) [H], eps >= 0."""
    check_high_precision(x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dim to normalize over, got shape {tuple(x.shape)}")
    check_tensor(weight, "weight")
    check_last_dim(x, weight, "weight")
    if bias is not None:
        check_tensor(bias, "bias")
        check_last_dim(x, bias, "bias")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps!r} must be a float >= 0 (e.g. 1e-5)")
    check_fp8_output(fp8_scale, fp8_dtype)
    if out_dtype is not None:
        check_out_dtype(out_dtype)


def check_norm_bwd(dy, x, stats, weight) -> None:
    """layernorm_bwd / rmsnorm_bwd: dy like x, weight [H], each (name, tensor) statistic with one value per row."""
    check_high_precision(x)
    check_high_precision(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}; they must match")
    check_tensor(weight, "weight")
    check_last_dim(x, weight, "weight")
    rows = x.numel() // max(x.shape[-1], 1)
    for name, t in stats:
        check_tensor(t, name)
        if t.numel() != rows:
            raise ValueError(f"{name} has {t.numel()} elements but x {tuple(x.shape)} has {rows} rows; pass the forward's {name}")


def check_softmax_mask(x: torch.Tensor, mask) -> None:
    """scaled_masked_softmax_forward: a torch.bool mask [b or 1, 1, sq, sk] for scores x [b, h, sq, sk]."""
    check_tensor(mask, "mask")
    b, _, sq, sk = x.shape
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (sq, sk):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; for x {tuple(x.shape)} it must be [{b} or 1, 1, {sq}, {sk}]")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask has dtype {mask.dtype}; pass a torch.bool tensor (True = masked out)")
