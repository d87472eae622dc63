"""The autograd Function of one activation in high precision, y = act(x), dx = dy * act'(x), by the catalog's ops.

Shared by the fusible ops' activations (``ops.GELU`` ... ``ops.ClampedSwiGLU``) and ``LayerNormMLP``'s high-precision
path. Gated activations (GLU variants) take x = [a, b] (see :mod:`.activation`); with an interleave size s, x holds
alternating blocks of s gate and s linear features, gathered into [a, b] first (and dx scattered back). A
``cache_quantizer`` keeps x in FP8 for backward (less memory, an FP8 rounding of x in act'(x)).

:func:`apply_activation` is how callers run one: where the policy's first choices for the activation and its
derivative are PyTorch's own operator (``gelu``, ``silu`` on CUDA, see plugin/backends/vendor/cuda/activation.py), that
operator with PyTorch's C++ autograd node, no Python node; else this Function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from transformer_engine.plugin import runs_as_aten

from ..quantization.float8_tensor import Float8Tensor
from ..quantization.quantizer import Quantizer
from .activation import ActivationConfig
from .common import apply_without_torch_autocast, cast, no_torch_autocast, save, saved

__all__ = ["ActivationArgs", "ActivationFunction", "apply_activation"]


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


def apply_activation(x: torch.Tensor, args: ActivationArgs) -> torch.Tensor:
    """act(x) as an autograd node: ``args.act.torch_operator`` with PyTorch's autograd where the policy's first choices
    for the activation and for its derivative both declare themselves that operator for ``args.dtype``
    (``plugin.runs_as_aten``) and nothing else is asked of the node (no FP8 cache of x, no interleaved halves); else
    :class:`ActivationFunction`. Either way x is cast to ``args.dtype`` first and dx comes back in x's dtype."""
    operator = args.act.torch_operator
    if (operator is not None and args.cache_quantizer is None and args.interleave is None
            and runs_as_aten(args.act.name, x.device, args.dtype) and runs_as_aten(f"d{args.act.name}", x.device, args.dtype)):
        return operator(cast(x, args.dtype))
    return apply_without_torch_autocast(ActivationFunction, x.device, x, args)
