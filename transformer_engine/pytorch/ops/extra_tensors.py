"""Operations with extra tensors: ``AddExtraInput`` (y = x + e) and ``MakeExtraOutput`` (returns (x, x)).

    AddExtraInput:    y = x + e              dx = de = dy
    MakeExtraOutput:  (y, e) = (x, x)        dx = dy + de
"""

from __future__ import annotations

from typing import Tuple

import torch

from .op import BasicOperation

__all__ = ["AddExtraInput", "MakeExtraOutput"]


class AddExtraInput(BasicOperation):
    """y = x + e, e the next extra input of :class:`~.sequential.Sequential` (e.g. a residual).

    Args:
        in_place: must be False (adding into e in place is not implemented).
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        if in_place:
            raise NotImplementedError("AddExtraInput(in_place=True) is not implemented; use in_place=False")

    def _forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return x + extra


class MakeExtraOutput(BasicOperation):
    """(y, e) = (x, x): x goes on and is also returned as an extra output (e.g. a residual branch).

    Args:
        in_place: accepted; autograd sums the two gradients, which is what TE's in-place
            accumulation computes.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self._in_place = in_place

    def _forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x, x
