"""The autograd Function of ``LayerNorm`` / ``RMSNorm`` (high precision: norms are not quantized)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quantization.quantizer import IDENTITY
from ._common import cast, no_torch_autocast, save, saved
from ._norm import NormConfig, norm_backward, norm_forward

__all__ = ["NormArgs", "NormFunction"]


@dataclass(frozen=True)
class NormArgs:
    """Non-tensor arguments: the norm, the compute dtype and the normalized size H (product of normalized_shape)."""

    norm: NormConfig
    dtype: torch.dtype
    hidden: int


class NormFunction(torch.autograd.Function):
    """y = norm(x) over the last dims (see ``_norm``); gamma and beta are cast to the compute dtype."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], args: NormArgs):
        x = cast(inp.reshape(-1, args.hidden).contiguous(), args.dtype)
        g, b = cast(gamma.reshape(-1), args.dtype), cast(None if beta is None else beta.reshape(-1), args.dtype)
        with no_torch_autocast(inp.device):
            y, stats = norm_forward(x, g, b, args.norm, IDENTITY, args.dtype)
        save(ctx, x, g, *stats)
        ctx.args, ctx.meta = args, (inp.shape, inp.dtype, gamma.shape, gamma.dtype, None if beta is None else beta.dtype)
        return y.reshape(inp.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        inp_shape, inp_dtype, gamma_shape, gamma_dtype, beta_dtype = ctx.meta
        x, g, *stats = saved(ctx)
        with no_torch_autocast(dy.device):
            dy2 = cast(dy.reshape(x.shape).contiguous(), ctx.args.dtype)
            dx, dgamma, dbeta = norm_backward(dy2, x, tuple(stats), g, ctx.args.norm)
        dbeta = None if beta_dtype is None else dbeta.reshape(gamma_shape).to(beta_dtype)
        return dx.reshape(inp_shape).to(inp_dtype), dgamma.reshape(gamma_shape).to(gamma_dtype), dbeta, None
