"""Collectives over a process group, plain and autograd-aware, all through ``torch.distributed``.

Tensor and sequence parallelism split a layer's work over the ranks of a tensor-parallel group of
size P. Activations are either replicated (every rank holds x), sharded along the first dimension
(the sequence, for "sbhd" inputs: rank r holds rows [r n/P, (r+1) n/P)) or partial (every rank holds
a summand; x = sum_r x_r). The collectives move between these states:

    all_reduce       partial    -> replicated    x = sum_r x_r
    all_gather       sharded    -> replicated    x = concat_r x_r            (along dim 0)
    reduce_scatter   partial    -> sharded       x_r = (sum_q x_q)[rows of r]
    split            replicated -> sharded       x_r = x[rows of r]          (no communication)

Each has a transpose that its backward runs (all_reduce <-> identity, all_gather <-> reduce_scatter,
split <-> all_gather). The plain functions run inside the modules' autograd Functions; the
``*_region`` functions are the autograd-aware wrappers (Megatron's names) for code around them.

FP8 operands (:class:`Float8Tensor`) are gathered as their uint8 payload with one scale_inv, which
every rank must share (see :meth:`Quantizer.for_sharded_tensor`): the gather moves half the bytes of
a bf16 gather. With a group of one rank (or none) every function returns its input.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple, Union

import torch
import torch.distributed as dist

from ..quantization.float8_tensor import Float8Tensor

__all__ = [
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_reduce_max",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_saved_activation",
    "group_rank",
    "group_size",
    "payload",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "split",
    "split_saved_activation",
    "with_payload",
]

Operand = Union[torch.Tensor, Float8Tensor]

# torch 2.13 renamed the single-tensor collectives; older releases only have the first names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (None = the default group); 1 when torch.distributed is not initialized.

    Example (one process: every collective returns its input):
        >>> x = torch.ones(4, 2)
        >>> group_size(None), all_gather(x, None) is x, reduce_scatter(x, None) is x
        (1, True, True)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """sum_r x_r over the ranks of ``group`` (a new tensor; ``x`` is left alone)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_reduce_(x: torch.Tensor, group: Any) -> torch.Tensor:
    """sum_r x_r written into ``x`` itself (for a fresh, contiguous tensor such as a GEMM output); returns ``x``."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group: Any) -> torch.Tensor:
    """max_r x_r over the ranks of ``group`` (the amax of a tensor sharded over them)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def _gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    _ALL_GATHER(out, x, group=group)
    return out


def payload(x: Operand) -> torch.Tensor:
    """What travels of an operand: an FP8 operand's row-major values as uint8, else the tensor itself."""
    return x.data.view(torch.uint8) if isinstance(x, Float8Tensor) else x


def with_payload(x: Operand, moved: torch.Tensor) -> Operand:
    """The operand like ``x`` holding ``moved`` (a :func:`payload` after communication; FP8: ``x``'s scale_inv)."""
    return Float8Tensor(moved.view(x.data.dtype), x.scale_inv) if isinstance(x, Float8Tensor) else moved


def all_gather(x: Operand, group: Any) -> Operand:
    """concat_r x_r along dim 0; an FP8 operand travels as uint8 and keeps its (shared) scale_inv."""
    if group_size(group) == 1:
        return x
    return with_payload(x, _gather_rows(payload(x), group))


def reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Rank r's rows of sum_q x_q (dim 0 must divide by the group size)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by the group size {size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    _REDUCE_SCATTER(out, x, group=group)
    return out


def split(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Rank r's rows of a replicated ``x`` (dim 0 must divide by the group size)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(
            f"sequence parallelism splits dim 0 of the input ({x.shape[0]} rows) over {size} ranks; "
            f"make it a multiple of {size}"
        )
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


def _last_dim(fn: Callable) -> Callable:
    """``fn`` (a dim-0 collective) applied along the last dim instead."""

    @functools.wraps(fn)
    def along_last(x: torch.Tensor, group: Any) -> torch.Tensor:
        return fn(x.movedim(-1, 0), group).movedim(0, -1).contiguous()

    return along_last


def _identity(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x


class _Collective(torch.autograd.Function):
    """y = forward_op(x); dx = backward_op(dy): one collective and its transpose."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, forward_op: Callable, backward_op: Callable):
        ctx.group, ctx.backward_op = group, backward_op
        y = forward_op(x, group)
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return ctx.backward_op(dy.contiguous(), ctx.group), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (the input of a column-parallel layer)."""
    return _Collective.apply(x, group, _identity, all_reduce)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward (the partial output of a row-parallel layer); identity backward."""
    return _Collective.apply(x, group, all_reduce, _identity)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along dim 0 forward; reduce-scatter of the gradient."""
    return _Collective.apply(x, group, all_gather, reduce_scatter)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward; all-gather of the gradient."""
    return _Collective.apply(x, group, reduce_scatter, all_gather)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's rows (dim 0) of a replicated tensor; all-gather of the gradient."""
    return _Collective.apply(x, group, split, all_gather)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dim (e.g. a column-parallel output); the gradient is split back."""
    return _Collective.apply(x, group, _last_dim(all_gather), _last_dim(split))


def split_saved_activation(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's 1/P of ``x`` flattened (what a checkpointed region keeps for backward).

    Raises:
        ValueError: the element count does not divide by the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    if x.numel() % size:
        raise ValueError(
            f"distribute_saved_activations splits the saved input ({x.numel()} elements, shape {tuple(x.shape)}) "
            f"over tp_group's {size} ranks; make its element count a multiple of {size}"
        )
    return x.detach().reshape(-1).chunk(size)[group_rank(group)].clone()


def gather_saved_activation(chunk: torch.Tensor, shape: Tuple[int, ...], group: Any) -> torch.Tensor:
    """The tensor of ``shape`` that :func:`split_saved_activation` split."""
    if group_size(group) == 1:
        return chunk
    return _gather_rows(chunk, group).reshape(shape)

