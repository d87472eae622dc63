"""``Sequential``: TE's container of operations, a drop-in for ``torch.nn.Sequential``.

    y = op_n(... op_2(op_1(x)))

Operations with extra inputs take them, in order, from ``forward``'s ``*extra_inputs``; extra outputs
are returned after y. This version runs each operation on its own (no fusion).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .op import Outputs, run_operations

__all__ = ["Sequential"]


class Sequential(torch.nn.Sequential):
    """A sequence of operations (or any modules): ``forward(input, *extra_inputs)``.

    Args:
        *args: the modules, or one dict of name -> module.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> mlp = te_ops.Sequential(te_ops.Linear(8, 16, device="cpu"), te_ops.GELU(), te_ops.Linear(16, 8, device="cpu"))
        >>> mlp(torch.randn(4, 8)).shape
        torch.Size([4, 8])
    """

    def __init__(self, *args: torch.nn.Module) -> None:
        if len(args) == 1 and isinstance(args[0], dict):
            args = (OrderedDict(args[0]),)
        super().__init__(*args)

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor) -> Outputs:  # noqa: A002 - TE's name
        """Apply the modules in order; returns y, or (y, *extra_outputs)."""
        return run_operations(self, input, extra_inputs)
