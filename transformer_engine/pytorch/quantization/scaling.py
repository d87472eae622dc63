"""Per-tensor FP8 scaling math as small pure functions (the bookkeeping around the catalog ops).

The pipeline of one cast, with its formulas:

    amax      = max |x| over the finite elements of x              (ops.compute_amax / ops.quantize)
    scale     = fp8_max / max(amax, eps)                            (ops.current_scale / scale_from_amax, current scaling)
              = (fp8_max / max(history)) / 2^margin                 (ops.delayed_scaling_update, delayed)
    q         = cast_fp8(clip(x * scale, -fp8_max, fp8_max))        (ops.quantize: saturating)
    x        ~= q * scale_inv,  scale_inv = 1 / scale               (ops.dequantize)

``fp8_max`` is 448 for E4M3 and 57344 for E5M2. The HYBRID format uses E4M3 for the forward tensors
(input, weight, output) and E5M2 for the gradients.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.common.recipe import Format

__all__ = ["FP32_MAX", "fp8_dtypes", "fp8_max"]

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
