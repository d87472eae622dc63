"""Optimizer states stored in fp16 or FP8 with a per-tensor scale (NVIDIA TE's FusedAdam ``*_dtype`` options).

A float32 state x is kept as (stored, scale) with scale = max|x| / range, range = fp16_max / 2 (fp16) or
448 (FP8 E4M3, ``torch.uint8`` in TE's option):

    fp16:  stored = fp16(x / scale),            x ~= float(stored) * scale
    FP8:   stored = Float8Tensor of x cast with scale' = 1 / scale (its scale_inv is ``scale``)

A state that is all zeros keeps scale 1 (nothing to divide by). The step runs on the float32 values and stores
them back (:func:`store`), as NVIDIA TE's FusedAdam does.
"""

from __future__ import annotations

import torch

from ..tensor.dtype import DType
from ..tensor.float8_tensor import Float8Quantizer, Float8Tensor

__all__ = ["SCALED_DTYPES", "new_scaled", "store", "unscaled"]

#: the state dtypes stored with a scale, and the largest |x / scale| each holds
SCALED_DTYPES = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}


def new_scaled(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``like``'s shape stored as ``dtype`` (fp16, or uint8: an E4M3 Float8Tensor with unit scale)."""
    if dtype == torch.float16:
        return torch.zeros_like(like, dtype=torch.float16)
    ones = torch.ones(1, dtype=torch.float32, device=like.device)
    return Float8Quantizer(ones, torch.zeros_like(ones), DType.kFloat8E4M3).quantize_impl(torch.zeros_like(like, dtype=torch.float32))


def unscaled(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of a scaled state."""
    if isinstance(stored, Float8Tensor):
        return stored.dequantize(dtype=torch.float32)
    return stored.float() * scale


def store(stored: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> None:
    """Write float32 ``values`` into the scaled state in place: scale = max|values| / range (1 when that is 0)."""
    dtype = torch.uint8 if isinstance(stored, Float8Tensor) else stored.dtype
    absmax = values.abs().amax().float().reshape(1)
    scale.copy_(torch.where(absmax > 0, absmax / SCALED_DTYPES[dtype], torch.ones_like(absmax)))
    if isinstance(stored, Float8Tensor):
        stored._get_quantizer().scale.copy_(scale.reciprocal())
        stored.quantize_(values)
    else:
        stored.copy_(values / scale)
