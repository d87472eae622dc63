"""Helpers shared by the autograd Functions of the modules: autocast-free regions, saving FP8 operands.

``save_for_backward`` takes tensors only; :func:`save` flattens :class:`Float8Tensor` operands into
their (data, scale_inv) tensors so that FP8 activations are saved the ordinary way (version checks,
no reference cycles) and :func:`saved` rebuilds them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Union

import torch

from ..quantization.float8_tensor import Float8Tensor

__all__ = ["Operand", "cast", "no_torch_autocast", "save", "saved"]

Operand = Union[torch.Tensor, Float8Tensor]


@contextmanager
def no_torch_autocast(device: torch.device) -> Iterator[None]:
    """Disable torch.autocast: the catalog ops get exactly the dtypes the module chose."""
    with torch.autocast(device.type, enabled=False):
        yield


def cast(x: Optional[Operand], dtype: torch.dtype) -> Optional[Operand]:
    """x in ``dtype`` when it is a high-precision tensor; FP8 operands and None pass through."""
    if isinstance(x, torch.Tensor) and x.dtype != dtype:
        return x.to(dtype)
    return x


def save(ctx, *items: Optional[Operand]) -> None:
    """ctx.save_for_backward(items), with each Float8Tensor stored as its two tensors."""
    flat: List[Optional[torch.Tensor]] = []
    layout: List[bool] = []
    for item in items:
        is_fp8 = isinstance(item, Float8Tensor)
        flat.extend((item.data, item.scale_inv) if is_fp8 else (item,))
        layout.append(is_fp8)
    ctx.save_for_backward(*flat)
    ctx.saved_layout = layout


def saved(ctx) -> List[Optional[Operand]]:
    """The items given to :func:`save`, in order."""
    flat = iter(ctx.saved_tensors)
    return [Float8Tensor(next(flat), next(flat)) if is_fp8 else next(flat) for is_fp8 in ctx.saved_layout]
