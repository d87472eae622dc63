"""Dropout on the catalog's ``dropout_fwd`` / ``dropout_bwd`` ops, and TE's bias-dropout-add.

    dropout(x)               y = x * m / (1 - p),  m ~ Bernoulli(1 - p)     (dx = dy * m / (1 - p))
    bias_dropout_add(x, b, r) = r + drop_path(dropout(x + b))

In training with p > 0 and no drop_path, bias-dropout-add is one op, ``bias_dropout_add_fwd``
(b [H] or None, r like x, one dtype), and its VJP is dx = dropout_bwd(dout, m, p), db = sum over
rows of dx, dr = dout; when b needs a gradient, ``dropout_bwd_dbias`` gives dx and db in one pass (db
summed in float32 from the unrounded products, rounded once to b's dtype). The keep mask m is drawn
from the default generator of x's device, so ``torch.manual_seed`` and the RNG replay of
``te.checkpoint`` reproduce it.
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
        ctx.save_for_backward(keep)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        return ops.dropout_bwd(dy.contiguous(), keep, ctx.p), None


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1]")


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout with probability ``p`` when ``training`` (identity otherwise or for p = 0).

    Raises:
        ValueError: p outside [0, 1].
    """
    _check_p(p)
    if not training or p == 0.0:
        return x
    return _DropoutFunction.apply(x, p)


class _BiasDropoutAddFunction(torch.autograd.Function):
    """out, m = bias_dropout_add_fwd(x, b, r, p); (dx, db) = dropout_bwd_dbias(dout, m, p) (db rounded to b's dtype), dr = dout."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float):
        out, keep = ops.bias_dropout_add_fwd(x, bias, residual, p=p)
        ctx.save_for_backward(keep)
        ctx.p = p
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        (keep,) = ctx.saved_tensors
        dout = dout.contiguous()
        need_dx, need_dbias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dbias = None
        if need_dbias:  # one pass: dx and its float32 column sums
            dx, dbias = ops.dropout_bwd_dbias(dout, keep, ctx.p)
            dbias = dbias.to(ctx.bias_dtype)
        elif need_dx:
            dx = ops.dropout_bwd(dout, keep, ctx.p)
        return dx if need_dx else None, dbias, dout, None


def _fusable(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> bool:
    """True when bias_dropout_add_fwd takes these operands: b [H] or None, r like x, one dtype."""
    same = residual.shape == x.shape and residual.dtype == x.dtype
    return same and (bias is None or (bias.dtype == x.dtype and x.dim() > 0 and tuple(bias.shape) == (x.shape[-1],)))


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool, drop_path: Optional[Callable] = None) -> torch.Tensor:
    """residual + drop_path(dropout(x + bias)); a None or empty bias is skipped.

    Training with p > 0 and no ``drop_path`` runs one fused op (see the module docstring); a bias
    that is not [H] of x's dtype is added to x first, operands of other shapes or dtypes take the
    unfused path.

    Raises:
        ValueError: p outside [0, 1].
    """
    _check_p(p)
    if bias is not None and bias.numel() == 0:
        bias = None
    if training and p > 0.0 and drop_path is None:
        fusable = _fusable(x, bias, residual)
        if not fusable and bias is not None:
            x, bias = x + bias, None
            fusable = _fusable(x, bias, residual)
        if fusable:
            return _BiasDropoutAddFunction.apply(x, bias, residual, p)
    if bias is not None:
        x = x + bias
    out = dropout(x, p, training)
    if drop_path is not None:
        out = drop_path(out)
    return residual + out
