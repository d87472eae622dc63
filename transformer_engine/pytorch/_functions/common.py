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

from ..quantization.float8_tensor import DeferredTranspose, Float8Tensor

__all__ = [
    "Operand", "backward_frees_graph", "bias_grad", "cast", "for_backward", "grad_output_operand", "no_torch_autocast", "quantize_operand",
    "release", "rows_of", "save", "saved", "unflatten", "without_operands",
]

Operand = Union[torch.Tensor, Float8Tensor]


_NOTHING_TO_DISABLE = contextlib.nullcontext()


def no_torch_autocast(device: torch.device) -> ContextManager[None]:
    """A context without torch.autocast on ``device``'s type: the catalog ops get the dtypes the module chose.

    ``torch.autocast(device.type, enabled=False)`` when autocast is on for that device type, else a
    shared no-op context (the common case, nearly free: it runs around every GEMM). Inside a module's
    autograd Function; traced by torch.compile it is a no-op there, :func:`apply_without_torch_autocast`
    having turned autocast off around the Function.
    """
    if torch.is_autocast_enabled(device.type) and not torch.compiler.is_compiling():
        return torch.autocast(device.type, enabled=False)
    return _NOTHING_TO_DISABLE


def apply_without_torch_autocast(function, device: torch.device, *args):
    """``function.apply(*args)`` with torch.autocast off on ``device``'s type around it.

    torch.compile traces a Function's forward in a sub-tracer that cannot restore an autocast state
    entered inside it ("Global autocast state changed while dynamo tracing", torch 2.11 - 2.13), so the
    state is set here, outside; the Function's own :func:`no_torch_autocast` still covers its backward
    when it runs eagerly under an autocast.
    """
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            return function.apply(*args)
    return function.apply(*args)


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
        return quantizer.quantize(gather(x), columnwise=columnwise)
    x_op = gather(quantizer.quantize(x, columnwise=columnwise and not gathered))
    return x_op.with_transpose() if columnwise and gathered and isinstance(x_op, Float8Tensor) else x_op


def bias_grad(rows: torch.Tensor, dtype: torch.dtype, keep_float32: bool = False) -> torch.Tensor:
    """db = sum over the rows of ``rows`` [M, N], accumulated in float32, returned in ``dtype`` (one kernel
    when that is the rows' dtype: torch sums a 16-bit tensor in float32 and rounds once), or in float32
    with ``keep_float32`` (an all-reduce over the ranks follows)."""
    if keep_float32:
        return rows.sum(dim=0, dtype=torch.float32)
    if dtype == rows.dtype:
        return rows.sum(dim=0)
    return rows.sum(dim=0, dtype=torch.float32).to(dtype)


def grad_output_operand(quantizer, dy: torch.Tensor, comm, need_dw: bool, db_dtype: Optional[torch.dtype], amaxes: list):
    """(dy as GEMM operand, db = column sums of this rank's dy or None, gather_dy), dy [M, N].

    ``amaxes``: the backward's list for the amaxes of traced delayed-scaling casts, handed to
    ``backward_update`` (``Quantizer.recording_into``; eager casts record in their own kernel).

    ``db_dtype``: the bias's dtype, None when no bias gradient is needed. db comes in float32 where ``comm``
    all-reduces it afterwards (``LinearComm.reduces_bias_grad``), else in ``db_dtype`` (rounded once from the
    float32 sum, in the cast's own launch where it fuses the sum); the caller casts it to ``db_dtype`` after the
    reduction.

    ``gather_dy``: ``comm`` all-gathers dy block by block inside the dgrad GEMM
    (``LinearComm.pipelines_grad_gather``), so the cast covers this rank's rows, without transpose (made
    after the gather); pass it on to ``linear_backward``. Otherwise dy^T comes along when wgrad needs it;
    a cast that fuses the bias gradient (``quantizer.fuses_dbias``) shares one read of dy with it
    (``quantize_with_dbias``) unless ``comm`` all-gathers dy first (row-parallel + SP), which leaves the
    sum to its own pass.
    """
    quantizer = quantizer.recording_into(amaxes)
    gather_dy = comm.pipelines_grad_gather(quantizer)
    reduces_db = comm.reduces_bias_grad
    comm, need_dw = comm.for_grad_cast(quantizer), need_dw and not gather_dy
    if need_dw and db_dtype is not None and quantizer.fuses_dbias and not comm.gathers_grad_output:
        return (*quantizer.quantize_with_dbias(dy, torch.float32 if reduces_db else db_dtype), gather_dy)
    dy_op = quantize_operand(quantizer, dy, comm.gather_grad_output, gathered=comm.gathers_grad_output, columnwise=need_dw)
    return dy_op, None if db_dtype is None else bias_grad(dy, db_dtype, keep_float32=reduces_db), gather_dy


def for_backward(op: Operand) -> Union[Operand, DeferredTranspose]:
    """A forward GEMM operand as the backward GEMMs read it: FP8 keeps only its transpose (wgrad reads x^T,
    dgrad W^T), or nothing but the weight when backward casts W^T again (``deferred_t``, its scale
    copied now: call this after the forward's GEMMs are queued and before the autocast's update)."""
    if not isinstance(op, Float8Tensor):
        return op
    return op.deferred_t.snapshot() if op.deferred_t is not None else op.transpose_only()


def without_operands(args, *fields: str):
    """``args`` (a frozen dataclass) with its GEMM-operand ``fields`` set to None, for ``ctx.args``.

    Backward reads the operands it needs from :func:`saved` (FP8 weights as W^T only); keeping the
    forward's operands on ctx would hold their row-major FP8 copies until backward ends.
    """
    if torch.compiler.is_compiling():  # traced: host time is not paid per call, and Dynamo 2.11 cannot trace the copy below
        return dataclasses.replace(args, **dict.fromkeys(fields))
    new = object.__new__(type(args))  # a shallow copy: dataclasses.replace (which re-runs __init__) costs 4x the host time
    new.__dict__.update(args.__dict__, **dict.fromkeys(fields))
    return new


def save(ctx, *items: Optional[Operand]) -> None:
    """ctx.save_for_backward(items), with each FP8 operand (or deferred transpose) stored as its tensors
    (``to_saved``; some may be None)."""
    flat: List[Optional[torch.Tensor]] = []
    layout: List[Optional[tuple]] = []
    for item in items:
        if isinstance(item, (Float8Tensor, DeferredTranspose)):
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


def backward_frees_graph() -> bool:
    """True inside a backward that frees the autograd graph as it goes (``retain_graph=False``, the usual
    case): the tensors a node saved are then used once, so its backward may overwrite or free them as
    soon as it is done with them, before the node ends (which would free them only then). False
    outside a backward, under ``retain_graph=True``, where torch cannot tell, and while a CUDA graph
    is being captured (its private pool keeps the memory anyway: freeing buys nothing there), and while
    ``torch.compile`` traces (the compiled graph plans its own buffers)."""
    if torch.compiler.is_compiling():
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep_graph is None or keep_graph():
        return False
    # no capture before CUDA is initialized; is_initialized() skips is_available()'s environment reads (~10 us)
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def release(op: Optional[Operand], owned: bool = False, transpose_only: bool = False) -> None:
    """Free the memory of an operand that this backward has used for the last time (the caller checks
    :func:`backward_frees_graph`): the values of an FP8 operand (a module casts those itself, so no one
    else holds them; its scale_inv stays, other operands may share it), only its transposed copy with
    ``transpose_only``, and a high-precision tensor only when ``owned`` (the node's own intermediate:
    it may otherwise be the caller's tensor)."""
    if isinstance(op, Float8Tensor):
        tensors = (op.data_t if op.data is not None else None,) if transpose_only else (op.data, op.data_t)
    else:
        tensors = (op,) if owned else ()
    for t in tensors:
        if t is not None:
            t.untyped_storage().resize_(0)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t [d0, ..., N] as the contiguous [M, N] rows the GEMMs and casts take (t itself when it already is)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def unflatten(y: torch.Tensor, like_shape: Sequence[int]) -> torch.Tensor:
    """y [M, N] (rows of a flattened input of ``like_shape``) back to [d0, ..., N].

    The first dim is M / prod(like_shape[1:-1]): sequence parallelism gathers or scatters the rows,
    so it may differ from ``like_shape[0]``.
    """
    if len(like_shape) == 2:
        return y  # already [M, N]
    if len(like_shape) < 2:
        return y.reshape(*like_shape[:-1], y.shape[-1])
    rest = tuple(like_shape[1:-1])
    n = math.prod(rest)
    return y.reshape(y.shape[0] // n if n else like_shape[0], *rest, y.shape[-1])
