"""``Identity`` (y = x) and ``Reshape`` (y = x.reshape(shape); dx = dy.reshape(x.shape))."""

from __future__ import annotations

from typing import Iterable

import torch

from .op import BasicOperation

__all__ = ["Identity", "Reshape"]


class Identity(BasicOperation):
    """y = x."""

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Reshape(BasicOperation):
    """y = x.reshape(shape) (one entry may be -1, as in ``torch.reshape``).

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.Reshape((2, -1))(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 12])
    """

    def __init__(self, shape: Iterable[int]) -> None:
        super().__init__()
        self._shape = tuple(shape)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self._shape)
