"""Element-wise operations without parameters: ``ConstantScale`` (y = c x) and ``Dropout`` (TE's ops).

    ConstantScale:  y = c x,                         dx = c dy
    Dropout:        y = x m / (1 - p) in training,   dx = dy m / (1 - p),   m ~ Bernoulli(1 - p)
                    y = x in evaluation (``.eval()``)

A quantized input (TE's ``QuantizedTensor``) is dequantized first, as TE's operations do.
"""

from __future__ import annotations

import torch

from .._dropout import dropout
from .op import BasicOperation, high_precision

__all__ = ["ConstantScale", "Dropout"]


class ConstantScale(BasicOperation):
    """y = scale * x.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.ConstantScale(0.5)(torch.tensor([2.0, -4.0])).tolist()
        [1.0, -2.0]
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return high_precision(x) * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class Dropout(BasicOperation):
    """Inverted dropout with probability ``p`` in training (the catalog's ``dropout_fwd`` / ``dropout_bwd``: the keep
    mask, packed to a bit per element, is drawn from the default generator of x's device); identity in evaluation.

    Raises:
        ValueError: ``p`` outside [0, 1].

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> op = te_ops.Dropout(0.5).eval()
        >>> op(torch.ones(3)).tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout probability p={p} must be in [0, 1]")
        self.dropout_probability = float(p)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(high_precision(x), self.dropout_probability, self.training)

    def extra_repr(self) -> str:
        return f"p={self.dropout_probability}"
