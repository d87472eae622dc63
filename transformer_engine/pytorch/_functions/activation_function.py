"""The autograd Function of one activation in high precision, y = act(x), dx = dy * act'(x), by the catalog's ops.

Shared by the fusible ops' activations (``ops.GELU`` ... ``ops.ClampedSwiGLU``) and ``LayerNormMLP``'s high-precision
path. Gated activations (GLU variants) take x = [a, b] (see :mod:`.activation`); with an interleave size s, x holds
alternating blocks of s gate and s linear features, gathered into [a, b] first (and dx scattered back). A
``cache_quantizer`` keeps x in FP8 for backward (less memory, an FP8 rounding of x in act'(x)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quantization.float8_tensor import Float8Tensor
from ..quantization.quantizer import Quantizer
from .activation import ActivationConfig
from .common import cast, no_torch_autocast, save, saved

__all__ = ["ActivationArgs", "ActivationFunction"]


@dataclass(frozen=True)
class ActivationArgs:
    """Non-tensor arguments of :class:`ActivationFunction`.

    Attributes:
        act: the activation.
        dtype: compute dtype.
        interleave: ``glu_interleave_size`` or None.
        cache_quantizer: the FP8 quantizer of the saved input, or None (saved as is).
    """

    act: ActivationConfig
    dtype: torch.dtype
    interleave: Optional[int]
    cache_quantizer: Optional[Quantizer]


def gather_halves(x: torch.Tensor, s: Optional[int]) -> torch.Tensor:
    """Blocks [a_1 (s), b_1 (s), a_2, b_2, ...] along the last dim -> [a_1, a_2, ..., b_1, b_2, ...]."""
    if s is None:
        return x
    n = x.shape[-1]
    return x.reshape(-1, n // (2 * s), 2, s).transpose(1, 2).reshape(x.shape)


def scatter_halves(x: torch.Tensor, s: Optional[int]) -> torch.Tensor:
    """The inverse of :func:`gather_halves`."""
    if s is None:
        return x
    n = x.shape[-1]
    return x.reshape(-1, 2, n // (2 * s), s).transpose(1, 2).reshape(x.shape)


class ActivationFunction(torch.autograd.Function):
    """y = act(x), dx = dy * act'(x) (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, args: ActivationArgs):
        h = gather_halves(cast(x, args.dtype).contiguous(), args.interleave)
        with no_torch_autocast(x.device):
            y, *_ = args.act.producer(h)(None, None, None)  # no FP8 scale: the high-precision result
            save(ctx, h if args.cache_quantizer is None else args.cache_quantizer.quantize(h))
        ctx.args, ctx.inp_dtype = args, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        args = ctx.args
        (h,) = saved(ctx)
        with no_torch_autocast(dy.device):
            h = h.dequantize(args.dtype) if isinstance(h, Float8Tensor) else h
            dh = args.act.backward(cast(dy, args.dtype).contiguous(), h)
        return cast(scatter_halves(dh, args.interleave), ctx.inp_dtype), None
