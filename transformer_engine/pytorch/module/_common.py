"""Helpers shared by the autograd Functions of the modules: autocast-free regions, saving FP8 operands.

``save_for_backward`` takes tensors only; :func:`save` flattens FP8 operands (:class:`Float8Tensor` and
its block-scaled subclass) into their tensors so that FP8 activations are saved the ordinary way (version checks,
no reference cycles) and :func:`saved` rebuilds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager, List, Optional, Sequence, Union

import torch

from ..quantization.float8_tensor import Float8Tensor

__all__ = [
    "Operand", "cast", "for_backward", "grad_output_operand", "no_torch_autocast", "quantize_operand", "save", "saved",
    "unflatten", "without_operands",
]

Operand = Union[torch.Tensor, Float8Tensor]


_NOTHING_TO_DISABLE = contextlib.nullcontext()


def no_torch_autocast(device: torch.device) -> ContextManager[None]:
    """A context without torch.autocast on ``device``'s type: the catalog ops get the dtypes the module chose.

    ``torch.autocast(device.type, enabled=False)`` when autocast is on for that device type, else a
    shared no-op context (the common case, nearly free: it runs around every GEMM).
    """
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NOTHING_TO_DISABLE


def cast(x: Optional[Operand], dtype: torch.dtype) -> Optional[Operand]:
    """x in ``dtype`` when it is a high-precision tensor; FP8 operands and None pass through."""
    if isinstance(x, torch.Tensor) and x.dtype != dtype:
        return x.to(dtype)
    return x


def quantize_operand(quantizer, x: torch.Tensor, gather: Callable, gathered: bool, columnwise: bool) -> Operand:
    """The GEMM operand of x [M, K] (FP8 or high precision), all-gathered by ``gather`` (``gathered``: it does).

    With ``columnwise`` an FP8 operand also carries x^T: written by the cast itself, or made after the
    gather (the transpose of a gathered tensor is not the gather of the shards' transposes). A
    quantizer that cannot gather its casts (``gathers_quantized``) casts the gathered tensor.
    """
    if gathered and not quantizer.gathers_quantized:
        return quantizer.quantize(gather(x), columnwise)
    x_op = gather(quantizer.quantize(x, columnwise and not gathered))
    return x_op.with_transpose() if columnwise and gathered and isinstance(x_op, Float8Tensor) else x_op


def grad_output_operand(quantizer, dy: torch.Tensor, comm, need_dw: bool, need_db: bool):
    """(dy as GEMM operand, db = float32 column sums of this rank's dy or None), dy [M, N].

    dy^T comes along when wgrad needs it; cast, transpose and bias gradient share one read of dy
    (``quantize_with_dbias``) unless ``comm`` all-gathers dy first (row-parallel + SP), which leaves
    the sum to its own pass.
    """
    if need_dw and need_db and not comm.gathers_grad_output:
        return quantizer.quantize_with_dbias(dy)
    dy_op = quantize_operand(quantizer, dy, comm.gather_grad_output, comm.gathers_grad_output, need_dw)
    return dy_op, dy.sum(dim=0, dtype=torch.float32) if need_db else None


def for_backward(op: Operand) -> Operand:
    """A forward GEMM operand as the backward GEMMs read it: FP8 keeps only its transpose (wgrad reads x^T, dgrad W^T)."""
    return op.transpose_only() if isinstance(op, Float8Tensor) else op


def without_operands(args, *fields: str):
    """``args`` (a frozen dataclass) with its GEMM-operand ``fields`` set to None, for ``ctx.args``.

    Backward reads the operands it needs from :func:`saved` (FP8 weights as W^T only); keeping the
    forward's operands on ctx would hold their row-major FP8 copies until backward ends.
    """
    return dataclasses.replace(args, **dict.fromkeys(fields))


def save(ctx, *items: Optional[Operand]) -> None:
    """ctx.save_for_backward(items), with each FP8 operand stored as its tensors (``to_saved``; some may be None)."""
    flat: List[Optional[torch.Tensor]] = []
    layout: List[Optional[tuple]] = []
    for item in items:
        if isinstance(item, Float8Tensor):
            tensors, rebuild = item.to_saved()
            flat.extend(tensors)
            layout.append((len(tensors), rebuild))
        else:
            flat.append(item)
            layout.append(None)
    ctx.save_for_backward(*flat)
    ctx.saved_layout = layout


def saved(ctx) -> List[Optional[Operand]]:
    """The items given to :func:`save`, in order."""
    flat = iter(ctx.saved_tensors)
    return [next(flat) if entry is None else entry[1](*[next(flat) for _ in range(entry[0])]) for entry in ctx.saved_layout]


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
