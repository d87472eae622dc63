"""Private helpers shared by the backends: input checks and the reference FP8 cast pipeline.

The per-tensor FP8 pipeline (catalog conventions, reference/te_pytorch_api.md sections 2-3):

    amax = max |x| over the finite elements of x            (NaN and +-inf never poison it)
    q = cast_fp8(clip(x * scale, -fp8_max, fp8_max))        (saturating: +-inf -> +-fp8_max, NaN stays NaN)
    scale_inv = 1 / scale

``fp8_max`` is ``torch.finfo(fp8_dtype).max``: 448 for E4M3, 57344 for E5M2.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

__all__ = [
    "FP8_DTYPES",
    "amax_finite",
    "check_2d",
    "check_amax_out",
    "check_bool",
    "check_dequantize_args",
    "check_fp8_dtype",
    "check_fp8_output",
    "check_fp8_tensor",
    "check_high_precision",
    "check_last_dim",
    "check_out_dtype",
    "check_quantize_args",
    "check_scalar",
    "check_tensor",
    "fp8_max_of",
    "is_fp8",
    "quantize_fp32",
    "saturating_cast",
    "scalar_f32",
]


def is_fp8(t: torch.Tensor) -> bool:
    """True when ``t`` holds an FP8 dtype."""
    return t.dtype in FP8_DTYPES


def check_fp8_dtype(fp8_dtype, name: str = "fp8_dtype") -> None:
    """Raise ValueError unless ``fp8_dtype`` is torch.float8_e4m3fn or torch.float8_e5m2."""
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{name}={fp8_dtype!r} is not an FP8 dtype; pass torch.float8_e4m3fn or torch.float8_e5m2")


def check_tensor(t, name: str) -> None:
    """Raise TypeError unless ``t`` is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_high_precision(x, name: str = "x") -> None:
    """Raise TypeError unless ``x`` is a floating-point tensor that is not FP8."""
    check_tensor(x, name)
    if not x.is_floating_point() or is_fp8(x):
        raise TypeError(f"{name} has dtype {x.dtype}; it must be float32, bfloat16 or float16 (dequantize FP8 first)")


def check_fp8_tensor(q, name: str = "q") -> None:
    """Raise TypeError unless ``q`` is a tensor of an FP8 dtype (torch.float8_e4m3fn or torch.float8_e5m2)."""
    check_tensor(q, name)
    if not is_fp8(q):
        raise TypeError(f"{name} has dtype {q.dtype}; it must be torch.float8_e4m3fn or torch.float8_e5m2")


def check_2d(t: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``t`` is 2-D [M, N]."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}; reshape it to 2-D first")


def check_out_dtype(out_dtype, name: str = "out_dtype") -> None:
    """Raise ValueError unless ``out_dtype`` is a high-precision floating-point torch dtype."""
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point or out_dtype in FP8_DTYPES:
        raise ValueError(f"{name}={out_dtype!r} must be a floating-point torch dtype such as torch.bfloat16 (not FP8)")


def check_last_dim(x: torch.Tensor, t: Optional[torch.Tensor], name: str) -> None:
    """Raise ValueError unless ``t`` (if given) has shape [H] with H = x's last dim."""
    if t is not None and tuple(t.shape) != (x.shape[-1],):
        raise ValueError(f"{name} has shape {tuple(t.shape)} but x has shape {tuple(x.shape)}; {name} must be [{x.shape[-1]}]")


def check_bool(value, name: str) -> None:
    """TypeError unless ``value`` is a bool (a flag of an op)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool")


def check_scalar(t, name: str) -> None:
    """Raise unless ``t`` is a one-element tensor (TypeError: not a tensor, ValueError: another count)."""
    check_tensor(t, name)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold exactly one element (per-tensor scaling), got shape {tuple(t.shape)}")


def scalar_f32(t, name: str) -> torch.Tensor:
    """A one-element tensor as a 0-d float32 tensor (after :func:`check_scalar`)."""
    check_scalar(t, name)
    return t.detach().reshape(()).to(torch.float32)


def check_quantize_args(x, scale, fp8_dtype, amax_out=None, scale_name: str = "scale") -> None:
    """A per-tensor FP8 cast of x (``quantize``, ``cast_transpose``, ``activation_quantize``, ...): a
    high-precision x, a one-element scale, an FP8 dtype and an optional ``amax_out`` slot (:func:`check_amax_out`).

    Raises:
        TypeError: x (or the scale) is not a tensor of the right kind. ValueError: bad scale, fp8_dtype or amax_out.
    """
    check_high_precision(x)
    check_scalar(scale, scale_name)
    check_fp8_dtype(fp8_dtype)
    check_amax_out(amax_out, x)


def check_dequantize_args(q, scale_inv, out_dtype) -> None:
    """``dequantize``: an FP8 q, a one-element scale_inv and a high-precision out_dtype.

    Raises:
        TypeError: q is not FP8. ValueError: scale_inv is not one element or out_dtype is not a float dtype.
    """
    check_fp8_tensor(q, "q")
    check_scalar(scale_inv, "scale_inv")
    check_out_dtype(out_dtype)


def fp8_max_of(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return torch.finfo(fp8_dtype).max


def amax_finite(x: torch.Tensor) -> torch.Tensor:
    """amax = max |x| over the finite elements of x, as a 0-d float32 tensor (0 for an empty x)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x_abs = x.detach().float().abs()
    finite = torch.where(torch.isfinite(x_abs), x_abs, torch.zeros_like(x_abs))
    # rows first, then their maxima (the same value): Inductor fuses a row reduction with a column sum of
    # the same x (a bias gradient) where a flat one, split in two stages, fails to compile (torch 2.11)
    return finite.amax(dim=-1).amax() if x.dim() >= 2 else finite.amax()


def saturating_cast(x_f32: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """q = cast_fp8(clip(x, -fp8_max, fp8_max)): +-inf saturates to +-fp8_max, NaN stays NaN."""
    bound = fp8_max_of(fp8_dtype)
    return x_f32.clamp(-bound, bound).to(fp8_dtype)


def quantize_fp32(x_f32: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                  amax_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 cast of an already-float32 tensor (callers validate the arguments).

    q = cast_fp8(clip(x * scale)), scale_inv = 1 / scale, amax = max |x| (finite x);
    with ``amax_out``: amax_out = max(amax_out, amax) in place, returned as amax.

    Returns:
        (q in ``fp8_dtype`` with x's shape, scale_inv 0-d float32, amax 0-d float32).
    """
    scale_f32 = scale.detach().reshape(()).to(torch.float32)
    q = saturating_cast(x_f32 * scale_f32, fp8_dtype)
    amax = amax_finite(x_f32)
    if amax_out is not None:
        torch.maximum(amax_out, amax.reshape(amax_out.shape), out=amax_out)
        amax = amax_out.view(())
    return q, torch.reciprocal(scale_f32), amax


def check_amax_out(amax_out, x: torch.Tensor) -> None:
    """Raise unless ``amax_out`` is None or a one-element float32 tensor on x's device (the catalog's contract)."""
    if amax_out is None:
        return
    check_scalar(amax_out, "amax_out")
    if amax_out.dtype != torch.float32 or amax_out.device != x.device:
        raise ValueError(
            f"amax_out must be a float32 tensor on {x.device} (an amax history slot), "
            f"got {amax_out.dtype} on {amax_out.device}"
        )


def check_fp8_output(fp8_scale, fp8_dtype, x: torch.Tensor, amax_out=None) -> None:
    """Validate the optional FP8 output of a fused op on x: both or neither of scale and dtype, and
    ``amax_out`` only with them (see :func:`check_amax_out`)."""
    if fp8_scale is None:
        if fp8_dtype is not None or amax_out is not None:
            given = "fp8_dtype" if fp8_dtype is not None else "amax_out"
            raise ValueError(f"{given} was given without fp8_scale; pass fp8_scale and fp8_dtype to get an FP8 output, or neither")
        return
    check_amax_out(amax_out, x)
    check_scalar(fp8_scale, "fp8_scale")
    check_fp8_dtype(fp8_dtype)
