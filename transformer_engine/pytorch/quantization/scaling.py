"""Per-tensor FP8 scaling math as small pure functions (the bookkeeping around the catalog ops).

The pipeline of one cast, with its formulas:

    amax      = max |x| over the finite elements of x              (ops.compute_amax / ops.quantize)
    scale     = fp8_max / max(amax, eps)                            (:func:`amax_to_scale`, current scaling)
              = (fp8_max / max(history)) / 2^margin                 (ops.delayed_scaling_update, delayed)
    q         = cast_fp8(clip(x * scale, -fp8_max, fp8_max))        (ops.quantize: saturating)
    x        ~= q * scale_inv,  scale_inv = 1 / scale               (ops.dequantize)

``fp8_max`` is 448 for E4M3 and 57344 for E5M2. The HYBRID format uses E4M3 for the forward tensors
(input, weight, output) and E5M2 for the gradients.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.common.recipe import Format, QParams

__all__ = ["FP32_MAX", "amax_to_scale", "fp8_dtypes", "fp8_max"]

FP32_MAX = torch.finfo(torch.float32).max

_FORMAT_DTYPES = {
    Format.E4M3: (torch.float8_e4m3fn, torch.float8_e4m3fn),
    Format.HYBRID: (torch.float8_e4m3fn, torch.float8_e5m2),
}


def fp8_dtypes(fp8_format: Format) -> Tuple[torch.dtype, torch.dtype]:
    """(forward dtype, backward dtype) of a recipe's ``fp8_format``: E4M3 -> (e4m3, e4m3), HYBRID -> (e4m3, e5m2).

    Raises:
        ValueError: for E5M2 or E2M1, which are not per-tensor FP8 training formats.
    """
    try:
        return _FORMAT_DTYPES[fp8_format]
    except KeyError:
        raise ValueError(f"fp8_format={fp8_format!r} is not a per-tensor FP8 training format; use Format.HYBRID or Format.E4M3") from None


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 (E4M3) or 57344 (E5M2)."""
    return float(torch.finfo(fp8_dtype).max)


def amax_to_scale(amax: torch.Tensor, fp8_max_value: float, qparams: QParams) -> torch.Tensor:
    """Current-scaling scale of one tensor: scale = fp8_max / max(amax, eps).

    An amax that is 0, inf or NaN gives scale = 1; a scale that overflows to inf becomes float32 max;
    with ``qparams.power_2_scale`` the scale is rounded down to a power of two, 2^floor(log2(scale)).

    Args:
        amax: 0-d float32 tensor, max |x| over the finite elements.
        fp8_max_value: 448 or 57344.
        qparams: the role's :class:`~transformer_engine.common.recipe.QParams`.

    Returns:
        A 0-d float32 tensor on amax's device.
    """
    amax = amax.float()
    usable = (amax > 0) & (amax < float("inf"))  # NaN compares False
    safe = torch.clamp(amax, min=qparams.amax_epsilon) if qparams.amax_epsilon > 0 else amax
    # a small-tensor path: every op here is a kernel launch, paid once per cast
    scale = torch.where(usable, fp8_max_value / safe, 1.0).clamp_(max=FP32_MAX)
    if qparams.power_2_scale:  # scale = m 2^e with m in [0.5, 1), so 2^floor(log2(scale)) = 2^(e - 1), exactly
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale
