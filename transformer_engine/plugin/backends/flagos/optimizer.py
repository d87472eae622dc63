"""Multi-tensor optimizer ops in Triton: Adam / AdamW, scale, L2 norm (TE's multi_tensor_* convention).

One launch covers every tensor of a dtype group: the host builds (and caches) a table of data
pointers [n, K] and a chunk table [C, 2] of (tensor index, first element); program c handles
``chunk_size`` elements of one tensor. Math in float32, results stored in each tensor's dtype.

    Adam       g = g + wd p (mode 0, L2)        p = p (1 - lr wd) (mode 1, AdamW)
               m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
               p = p - lr (m / bc1) / (sqrt(v / bc2) + eps),  bc_i = 1 - b_i^step (or 1)
    scale      out = in * scale
    l2norm     partial_c = sum over chunk c of x^2;  norm_t = sqrt(sum of t's partials);
               total = sqrt(sum of all partials)  (a second launch, no atomics, deterministic)

noop_flag (int32 [1]): Adam reads it in the kernel and changes nothing when it is non-zero (no host
synchronisation); scale and l2norm set it to 1 on a non-finite input / norm (scale still writes).
No VJP: these are optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import check_multi_tensor_adam, check_tensor_lists
from transformer_engine.plugin.core import Reject

from ._common import cdiv, device_guard
from ._launch import cached_launch
from ._tables import TableCache

__all__ = ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_adam"]

_BLOCK = 2048  # elements per loop step of a chunk
_DEFAULT_CHUNK = 65536  # elements per program when chunk_size is not positive
_TABLE_CACHE_SIZE = 32


@triton.jit
def _chunk_bounds(chunks_ptr, numels_ptr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """(tensor index, first element, end element) of this program's chunk."""
    c = tl.program_id(0)
    tensor = tl.load(chunks_ptr + 2 * c)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * c + 1), 16)  # chunks start at multiples of CHUNK
    end = tl.minimum(start + CHUNK, tl.load(numels_ptr + tensor))
    if ALIGNED:  # every numel is a multiple of 16: masks are constant over 16 lanes (vector loads)
        end = tl.multiple_of(end, 16)
    return tensor, start, end


@triton.jit
def _tensor_ptr(ptrs_ptr, tensor, K: tl.constexpr, LIST: tl.constexpr, proto_ptr, ALIGNED: tl.constexpr):
    """Typed pointer to tensor ``tensor`` of list ``LIST`` (its element type is proto_ptr's)."""
    ptr = tl.load(ptrs_ptr + tensor * K + LIST).to(proto_ptr.dtype)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _adam_kernel(
    ptrs_ptr,  # *int64 [n, 4]: addresses of grad, param, exp_avg, exp_avg_sq of each tensor
    chunks_ptr,  # *int64 [C, 2]: (tensor index, first element) of each program's chunk
    numels_ptr,  # *int64 [n]: elements of each tensor
    noop_ptr,  # *int32 [1]: non-zero = skip the step
    g_proto,  # *grad dtype (only its type is used)
    p_proto,  # *param dtype (only its type is used)
    m_proto,  # *exp_avg dtype (only its type is used)
    v_proto,  # *exp_avg_sq dtype (only its type is used)
    lr,  # learning rate
    beta1,  # b1
    one_minus_beta1,  # 1 - b1 (computed in float64 on the host, as the reference)
    beta2,  # b2
    one_minus_beta2,  # 1 - b2
    eps,  # added to sqrt(v_hat)
    bc1,  # 1 - b1^step, or 1
    bc2,  # 1 - b2^step, or 1
    weight_decay,  # wd (mode 0)
    decay,  # 1 - lr wd (mode 1)
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,  # 0: L2 (Adam), 1: decoupled (AdamW)
    ALIGNED: tl.constexpr,  # every address is 16-byte aligned and every numel a multiple of 16
):
    tensor, start, end = _chunk_bounds(chunks_ptr, numels_ptr, CHUNK, ALIGNED)
    end = tl.where(tl.load(noop_ptr) != 0, start, end)  # skipped step: empty range
    g_ptr = _tensor_ptr(ptrs_ptr, tensor, 4, 0, g_proto, ALIGNED)
    p_ptr = _tensor_ptr(ptrs_ptr, tensor, 4, 1, p_proto, ALIGNED)
    m_ptr = _tensor_ptr(ptrs_ptr, tensor, 4, 2, m_proto, ALIGNED)
    v_ptr = _tensor_ptr(ptrs_ptr, tensor, 4, 3, v_proto, ALIGNED)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            g = g + weight_decay * p
        else:
            p = p * decay
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        p = p - lr * (m / bc1) / (tl.sqrt(v / bc2) + eps)
        tl.store(m_ptr + offs, m.to(m_proto.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_proto.dtype.element_ty), mask=mask)
        tl.store(p_ptr + offs, p.to(p_proto.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(
    ptrs_ptr,  # *int64 [n, 2]: addresses of input, output of each tensor
    chunks_ptr,  # *int64 [C, 2]: (tensor index, first element) of each program's chunk
    numels_ptr,  # *int64 [n]: elements of each tensor
    noop_ptr,  # *int32 [1]: set to 1 when an input is not finite
    in_proto,  # *input dtype (only its type is used)
    out_proto,  # *output dtype (only its type is used)
    scale,  # multiplier
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    tensor, start, end = _chunk_bounds(chunks_ptr, numels_ptr, CHUNK, ALIGNED)
    in_ptr = _tensor_ptr(ptrs_ptr, tensor, 2, 0, in_proto, ALIGNED)
    out_ptr = _tensor_ptr(ptrs_ptr, tensor, 2, 1, out_proto, ALIGNED)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bad = bad | (tl.abs(x) == float("inf")).to(tl.int32) | (x != x).to(tl.int32)
        tl.store(out_ptr + offs, (x * scale).to(out_proto.dtype.element_ty), mask=mask)
    tl.atomic_max(noop_ptr, 1, mask=tl.max(bad, axis=0) > 0)


@cached_launch
@triton.jit
def _sumsq_kernel(
    ptrs_ptr,  # *int64 [n, 1]: address of each tensor
    chunks_ptr,  # *int64 [C, 2]: (tensor index, first element) of each program's chunk
    numels_ptr,  # *int64 [n]: elements of each tensor
    partial_ptr,  # *float32 [total chunks]: this launch writes slots slot_base + c
    x_proto,  # *tensor dtype (only its type is used)
    slot_base,  # first partial slot of this launch
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    tensor, start, end = _chunk_bounds(chunks_ptr, numels_ptr, CHUNK, ALIGNED)
    x_ptr = _tensor_ptr(ptrs_ptr, tensor, 1, 0, x_proto, ALIGNED)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + slot_base + tl.program_id(0), tl.sum(acc, axis=0))


@cached_launch
@triton.jit
def _norm_finalize_kernel(
    partial_ptr,  # *float32 [total chunks] sums of squares
    bounds_ptr,  # *int64 [n + 1, 2]: partial slots [lo, hi) of tensor t; row n spans all slots
    per_ptr,  # *float32 [n]: per-tensor norms (program t < n)
    total_ptr,  # *float32 [1]: total norm (program n)
    noop_ptr,  # *int32 [1]: set to 1 when the total is not finite
    n,  # tensors
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    lo = tl.load(bounds_ptr + 2 * t)
    hi = tl.load(bounds_ptr + 2 * t + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK):
        slots = s0 + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + slots, mask=slots < hi, other=0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    if t < n:
        tl.store(per_ptr + t, norm)
    else:
        tl.store(total_ptr, norm)
        tl.atomic_max(noop_ptr, 1, mask=(tl.abs(norm) == float("inf")) | (norm != norm))


@dataclass(frozen=True)
class _Table:
    """Device tables of one group: pointers [n, K], chunks [C, 2], numels [n]."""

    ptrs: torch.Tensor
    chunks: torch.Tensor
    numels: torch.Tensor
    num_chunks: int


_tables = TableCache(_TABLE_CACHE_SIZE)


def _build_table(columns: Sequence[Sequence[torch.Tensor]], chunk: int, device: torch.device) -> _Table:
    """Tables for tensors given as columns (one sequence per list) of equal-size tensors."""
    rows = list(zip(*columns))
    numels = [t[0].numel() for t in rows]
    addresses = [[x.data_ptr() for x in row] for row in rows]
    chunks = [(i, start) for i, n in enumerate(numels) for start in range(0, n, chunk)]
    as_int64 = dict(dtype=torch.int64, device=device)
    return _Table(
        ptrs=torch.tensor(addresses, **as_int64).reshape(len(rows), len(columns)),
        chunks=torch.tensor(chunks, **as_int64).reshape(-1, 2),
        numels=torch.tensor(numels, **as_int64),
        num_chunks=len(chunks),
    )


def _table(columns: Sequence[Sequence[torch.Tensor]], chunk: int, device: torch.device) -> _Table:
    """The cached table of these tensors (same addresses and sizes give the same table)."""
    key = (chunk, str(device), tuple((x.data_ptr(), x.numel()) for col in columns for x in col))
    table = _tables.get(key, lambda: _build_table(columns, chunk, device), device)
    if table is None:
        raise RuntimeError("a flagos multi-tensor op met new tensors inside a CUDA-graph capture, where it cannot copy "
                           "their address table to the device; run one step on these tensors before capturing")
    return table


def _groups(tensor_lists) -> Dict[Tuple[Tuple[torch.dtype, ...], bool], List[int]]:
    """Indices of the non-empty parameters grouped by (dtypes across the lists, aligned).

    aligned: every address of the parameter is 16-byte aligned and its size a multiple of 16, so
    the kernel may assume vector-friendly offsets (the ALIGNED constexpr).
    """
    groups: Dict[Tuple[Tuple[torch.dtype, ...], bool], List[int]] = {}
    for i, row in enumerate(zip(*tensor_lists)):
        if row[0].numel():
            aligned = row[0].numel() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in row)
            groups.setdefault((tuple(t.dtype for t in row), aligned), []).append(i)
    return groups


def _chunk(chunk_size) -> int:
    """Elements per program: chunk_size rounded up to a multiple of the loop block."""
    size = int(chunk_size) if chunk_size and chunk_size > 0 else _DEFAULT_CHUNK
    return cdiv(size, _BLOCK) * _BLOCK


def _launch_groups(kernel, tensor_lists, chunk_size, noop_flag, *scalars, **constexprs) -> None:
    """One launch of ``kernel`` per dtype group (pointer table, chunk table, numels, noop, protos, scalars)."""
    chunk = _chunk(chunk_size)
    for (_, aligned), indices in _groups(tensor_lists).items():
        columns = [[lst[i] for i in indices] for lst in tensor_lists]
        table = _table(columns, chunk, noop_flag.device)
        with device_guard(noop_flag):
            kernel[(table.num_chunks,)](
                table.ptrs, table.chunks, table.numels, noop_flag, *(col[0] for col in columns), *scalars,
                CHUNK=chunk, BLOCK=_BLOCK, ALIGNED=aligned, **constexprs,
            )  # fmt: skip


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """out = in * scale for each pair; noop_flag = 1 if any input is not finite (outputs written anyway).

    Args:
        chunk_size: elements per program (<= 0: 65536).
        noop_flag: int32 [1] on the tensors' device.
        tensor_lists: [inputs, outputs], contiguous.
        scale: float multiplier.

    Raises:
        ValueError: wrong list structure or non-contiguous tensors.
    """
    check_tensor_lists("multi_tensor_scale", tensor_lists, ("inputs", "outputs"))
    _launch_groups(_scale_kernel, tensor_lists, chunk_size, noop_flag, float(scale))


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay):
    """One Adam (mode 0, L2) or AdamW (mode 1) step in place; nothing changes when noop_flag != 0.

    Args:
        chunk_size: elements per program (<= 0: 65536).
        noop_flag: int32 [1], read in the kernel.
        tensor_lists: [grads, params, exp_avgs, exp_avg_sqs], contiguous.
        lr, beta1, beta2, epsilon, weight_decay: the usual hyper-parameters.
        step: 1-based step used by the bias correction.
        mode: 0 adds wd p to the gradient, 1 decays the parameter (decoupled).
        bias_correction: divide m and v by (1 - beta^step).

    Raises:
        ValueError: wrong list structure, mode not 0/1, step < 1 with bias correction, non-contiguous tensors.
    """
    check_multi_tensor_adam(tensor_lists, step, mode, bias_correction)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    scalars = (lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, epsilon, bc1, bc2, weight_decay, 1.0 - lr * weight_decay)
    _launch_groups(_adam_kernel, tensor_lists, chunk_size, noop_flag, *map(float, scalars), MODE=int(mode))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """total = sqrt(sum_t ||t||^2) in float32, deterministic (no atomics on the sums).

    Args:
        chunk_size: elements per program (<= 0: 65536).
        noop_flag: int32 [1], set to 1 when the norm is not finite.
        tensor_lists: [tensors], contiguous.
        per_tensor: also return each tensor's norm.

    Returns:
        (total float32 [1], per-tensor norms float32 [n] if per_tensor else an empty float32 tensor).

    Raises:
        ValueError: wrong list structure or non-contiguous tensors.
    """
    check_tensor_lists("multi_tensor_l2norm", tensor_lists, ("tensors",))
    tensors, device, chunk = tensor_lists[0], noop_flag.device, _chunk(chunk_size)
    groups = _groups(tensor_lists)
    partial = torch.empty(max(1, sum(cdiv(t.numel(), chunk) for t in tensors)), dtype=torch.float32, device=device)
    bounds = [(0, 0)] * len(tensors)  # partial slots [lo, hi) of each tensor; empty tensors own none
    base = 0
    for (_, aligned), indices in groups.items():
        table = _table([[tensors[i] for i in indices]], chunk, device)
        with device_guard(noop_flag):
            _sumsq_kernel[(table.num_chunks,)](
                table.ptrs, table.chunks, table.numels, partial, tensors[indices[0]], base,
                CHUNK=chunk, BLOCK=_BLOCK, ALIGNED=aligned,
            )  # fmt: skip
        for i in indices:  # the table lists a group's chunks tensor by tensor
            bounds[i] = (base, base + cdiv(tensors[i].numel(), chunk))
            base = bounds[i][1]
    bounds.append((0, base))  # the total sums every slot
    total, per = _finalize_norms(partial, bounds, noop_flag)
    return total, per if per_tensor else torch.empty(0, dtype=torch.float32, device=device)


def _finalize_norms(partial, bounds, noop_flag):
    """(total [1], per-tensor [n]) norms from the partial sums of squares; bounds has n + 1 rows."""
    n, device = len(bounds) - 1, noop_flag.device
    per = torch.empty(n, dtype=torch.float32, device=device)
    total = torch.empty(1, dtype=torch.float32, device=device)
    bounds_t = torch.tensor(bounds, dtype=torch.int64, device=device)
    with device_guard(noop_flag):
        _norm_finalize_kernel[(n + 1,)](partial, bounds_t, per, total, noop_flag, n, BLOCK=1024)
    return total, per


def _same_device(noop_flag, tensor_lists) -> object:
    """Reject what raw-address kernels cannot take: tensors off noop_flag's device, or strided ones."""
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.dtype != torch.int32:
        return Reject("noop_flag must be an int32 tensor on the tensors' device")
    for lst in tensor_lists:
        for t in lst:
            if isinstance(t, torch.Tensor) and t.device != noop_flag.device:
                return Reject(f"a tensor is on {t.device} but noop_flag on {noop_flag.device}")
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                return Reject(f"a tensor of shape {tuple(t.shape)} is not contiguous")
    return True


def _scale_fits(chunk_size, noop_flag, tensor_lists, scale):
    return _same_device(noop_flag, tensor_lists)


def _l2norm_fits(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    return _same_device(noop_flag, tensor_lists)


def _adam_fits(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay):
    return _same_device(noop_flag, tensor_lists)


SUPPORTS = {"multi_tensor_scale": _scale_fits, "multi_tensor_l2norm": _l2norm_fits, "multi_tensor_adam": _adam_fits}
