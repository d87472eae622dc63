"""Dropout on the catalog's ``dropout_fwd`` / ``dropout_bwd`` ops, and TE's bias-dropout-add.

    dropout(x)               y = x * m / (1 - p),  m ~ Bernoulli(1 - p)     (dx = dy * m / (1 - p))
    bias_dropout_add(x, b, r) = r + drop_path(dropout(x + b))

The keep mask m is drawn from the default generator of x's device, so ``torch.manual_seed`` and the
RNG replay of ``te.checkpoint`` reproduce it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from transformer_engine.plugin import ops

__all__ = ["dropout", "bias_dropout_add"]


class _DropoutFunction(torch.autograd.Function):
    """y, m = dropout_fwd(x, p); dx = dropout_bwd(dy, m, p)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        y, keep = ops.dropout_fwd(x, p)
        ctx.mark_non_differentiable(keep)
        ctx.save_for_backward(keep)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        return ops.dropout_bwd(dy.contiguous(), keep, ctx.p), None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout with probability ``p`` when ``training`` (identity otherwise or for p = 0).

    Raises:
        ValueError: p outside [0, 1].
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1]")
    if not training or p == 0.0:
        return x
    return _DropoutFunction.apply(x, p)


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool, drop_path: Optional[Callable] = None) -> torch.Tensor:
    """residual + drop_path(dropout(x + bias)); a None or empty bias is skipped."""
    if bias is not None and bias.numel() != 0:
        x = x + bias
    out = dropout(x, p, training)
    if drop_path is not None:
        out = drop_path(out)
    return residual + out
