"""Helpers shared by the autograd Functions of the modules: autocast-free regions, saving FP8 operands.

``save_for_backward`` takes tensors only; :func:`save` flattens :class:`Float8Tensor` operands into
their (data, scale_inv) tensors so that FP8 activations are saved the ordinary way (version checks,
no reference cycles) and :func:`saved` rebuilds them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Union

import torch

from ..quantization.float8_tensor import Float8Tensor

__all__ = ["Operand", "cast", "no_torch_autocast", "save", "saved", "unflatten"]

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


def unflatten(y: torch.Tensor, like_shape: Sequence[int]) -> torch.Tensor:
    """y [M, N] (rows of a flattened input of ``like_shape``) back to [d0, ..., N].

    The first dim is M / prod(like_shape[1:-1]): sequence parallelism gathers or scatters the rows,
    so it may differ from ``like_shape[0]``.
    """
    if len(like_shape) < 2:
        return y.reshape(*like_shape[:-1], y.shape[-1])
    rest = tuple(like_shape[1:-1])
    n = math.prod(rest)
    return y.reshape(y.shape[0] // n if n else like_shape[0], *rest, y.shape[-1])
