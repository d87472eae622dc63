"""The autograd Function of ``LayerNorm`` / ``RMSNorm`` (high precision: norms are not quantized)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quantization.quantizer import IDENTITY
from .common import cast, no_torch_autocast, save, saved
from .norm import NormConfig, norm_backward, norm_forward

__all__ = ["NormArgs", "NormFunction"]


@dataclass(frozen=True)
class NormArgs:
    """Non-tensor arguments: the norm, the compute dtype and the normalized size H (product of normalized_shape)."""

    norm: NormConfig
    dtype: torch.dtype
    hidden: int


class NormFunction(torch.autograd.Function):
    """y = norm(x) over the last dims (see :mod:`.norm`); gamma and beta are cast to the compute dtype.

    Each reshape and cast is skipped where the tensor already has that shape or dtype (the usual
    [tokens, hidden] input and 1-D parameters): even a no-op call costs microseconds of host time.
    """

    @staticmethod
    def forward(ctx, inp: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], args: NormArgs):
        rows = inp if inp.dim() == 2 and inp.shape[1] == args.hidden else inp.reshape(-1, args.hidden)
        x = cast(rows.contiguous(), args.dtype)
        g, b = cast(_flat(gamma), args.dtype), cast(None if beta is None else _flat(beta), args.dtype)
        with no_torch_autocast(inp.device):
            y, stats = norm_forward(x, g, b, args.norm, IDENTITY, args.dtype)
        save(ctx, x, g, *stats)
        ctx.args, ctx.meta = args, (inp.shape, inp.dtype, gamma.shape, gamma.dtype, None if beta is None else beta.dtype)
        return _shaped(y, inp.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        inp_shape, inp_dtype, gamma_shape, gamma_dtype, beta_dtype = ctx.meta
        x, g, *stats = saved(ctx)
        with no_torch_autocast(dy.device):
            dy2 = cast(_shaped(dy, x.shape).contiguous(), ctx.args.dtype)
            dx, dgamma, dbeta = norm_backward(dy2, x, tuple(stats), g, ctx.args.norm)
        dbeta = None if beta_dtype is None else cast(_shaped(dbeta, gamma_shape), beta_dtype)
        return cast(_shaped(dx, inp_shape), inp_dtype), cast(_shaped(dgamma, gamma_shape), gamma_dtype), dbeta, None


def _shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """t reshaped to ``shape`` (t itself when it has that shape)."""
    return t if t.shape == shape else t.reshape(shape)


def _flat(param: torch.Tensor) -> torch.Tensor:
    """A norm parameter as the 1-D tensor the ops take."""
    return param if param.dim() == 1 else param.reshape(-1)
