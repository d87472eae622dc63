"""Per-tensor FP8 casts of the row splits x = [x_0; ...; x_{G-1}] of one tensor in Triton, one launch for all splits
(a mixture-of-experts layer's tokens): cast_transpose_grouped and current_scale_grouped.

Math (plugin/catalog/quantization.py), float32 throughout:

    cast_transpose_grouped
                    cast_transpose of each x_g in one launch: rows of split g cast with scale[g],
                    amax[g] = max |x_g|, q_t the transpose of the whole q
    column_sums_grouped
                    out[g, j] = sum of x_g[:, j] in float32 (the bias gradients), one launch of
                    ``segment_column_sums`` (_column_sums.py)
    current_scale_grouped
                    amax[g] = max |x_g| (finite, 0 for an empty split) in one launch of the same kernel
                    with the casts left out; the last program to finish writes every
                    scale[g] = fp8_max / max(amax[g], eps) (``_current_scale_of``, as ``current_scale``)

The casts and scales are bit-identical to the per-split ops of ``quantization.py`` on each split; the column sums
add in their own fixed order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import (
    check_amax_epsilon, check_cast_transpose_grouped, check_dbias_dtype, check_grouped_rows,
)
from transformer_engine.plugin.backends._fp8 import check_fp8_dtype
from transformer_engine.plugin.backends._splits import split_ends
from transformer_engine.plugin.core import Reject

from ._common import (
    _amax_commit,
    _finite_abs,
    _fp8_encode,
    cdiv,
    device_guard,
    fp8_format,
    hw_fp8_cast,
    next_power_of_2,
    rows_contiguous,
    stream_counters,
)
from ._column_sums import segment_column_sums
from ._launch import cached_launch
from .quantization import _CT_TILE_M, _CT_TILE_N, _current_scale_of

__all__ = ["cast_transpose_grouped", "column_sums_grouped", "current_scale_grouped"]


@cached_launch
@triton.jit
def _cast_transpose_grouped_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous (None with CURRENT_SCALE)
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous (None with CURRENT_SCALE)
    ends_ptr,  # *int32 [G]: ends[g] = m_0 + ... + m_g (split g holds rows ends[g] - m_g .. ends[g] - 1)
    scale_ptr,  # *float32 [G], stride stride_scale (receives the scales with CURRENT_SCALE)
    scale_inv_ptr,  # *float32 [G], stride stride_scale_inv: receives 1 / scale (None with CURRENT_SCALE)
    amax_ptr,  # *int32 view of amax [G], stride stride_amax, values >= 0: receives the bits of max |x_g| (finite)
    counters_ptr,  # *int32 [2], zero, with CURRENT_SCALE: [1] counts the programs finished (left zero again)
    M,  # rows of x
    N,  # columns of x
    G,  # splits
    stride_xm,  # elements between rows of x
    stride_scale,  # elements between the scales
    stride_scale_inv,  # elements between the scale_inv entries
    stride_amax,  # elements between the amax entries
    amax_epsilon,  # with CURRENT_SCALE: lower bound of the amax a scale divides by
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GP: tl.constexpr,  # next power of two >= G
    CURRENT_SCALE: tl.constexpr,  # amaxes only (no q, q_t, scale_inv), the last program writes the scales
    POWER_2: tl.constexpr,  # with CURRENT_SCALE: scales rounded down to powers of two
    LOAD_TRANSPOSED: tl.constexpr,  # q_t encoded from a second load of the tile in transposed order (float32 x)
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """``_cast_transpose_kernel`` with a scale per row: row r is in split g(r) = #{g : ends[g] <= r}.

    A tile may straddle splits (empty ones included): its rows gather scale[g(r)], and each split g(first
    row) .. g(last row) gets one atomic of the max over its rows. Program 0 writes every scale_inv.
    With CURRENT_SCALE the program that counts itself done last (as in ``_current_scale_kernel``) reads
    every amax[g] and writes scale[g] = ``_current_scale_of``(amax[g]).
    """
    pid = tl.program_id(0)
    tiles_n = tl.maximum(tl.cdiv(N, BLOCK_N), 1)  # N = 0: one program still runs
    first_row = (pid // tiles_n) * BLOCK_M
    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    in_rows = rows < M
    mask = in_rows[:, None] & (cols < N)[None, :]
    groups = tl.arange(0, GP)
    ends = tl.load(ends_ptr + groups, mask=groups < G, other=M)  # padding ends at M: no row r < M passes them
    row_group = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if not CURRENT_SCALE:
        scale = tl.load(scale_ptr + row_group * stride_scale, mask=in_rows, other=1.0)
        code = _fp8_encode(x * scale[:, None], FP8_MAX, MBITS, EBIAS, HW_CAST)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], code, mask=mask)
        if LOAD_TRANSPOSED:
            x_t = tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None], mask=tl.trans(mask), other=0.0).to(tl.float32)
            code_t = _fp8_encode(x_t * scale[None, :], FP8_MAX, MBITS, EBIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], code_t, mask=tl.trans(mask))
        else:
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
        if pid == 0:
            group_scale = tl.load(scale_ptr + groups * stride_scale, mask=groups < G, other=1.0)
            tl.store(scale_inv_ptr + groups * stride_scale_inv, tl.math.div_rn(1.0, group_scale), mask=groups < G)
    row_amax = tl.max(_finite_abs(x), axis=1)  # masked lanes hold 0
    last_row = tl.minimum(first_row + BLOCK_M, M) - 1  # -1 for M = 0: no split below
    first_group = tl.sum((ends <= first_row).to(tl.int32), axis=0)
    last_group = tl.sum((ends <= last_row).to(tl.int32), axis=0)
    for g in range(first_group, last_group + 1):
        _amax_commit(amax_ptr + g * stride_amax, tl.where(row_group == g, row_amax, 0.0))
    if CURRENT_SCALE:
        tl.debug_barrier()  # every thread's commits come before the count (see _current_scale_kernel)
        if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(counters_ptr + 1, 0)
            amax_bits = tl.atomic_add(amax_ptr + groups * stride_amax, 0, mask=groups < G, sem="acquire")  # the final values
            scale = _current_scale_of(amax_bits, amax_epsilon, FP8_MAX, POWER_2)
            tl.store(scale_ptr + groups * stride_scale, scale, mask=groups < G)


def _launch_grouped(x, m_splits, fp8_dtype, *, scale, amax, q=None, q_t=None, scale_inv=None, amax_epsilon=0.0, power_2_scale=False):
    """Run ``_cast_transpose_grouped_kernel`` on x [M, N] (rows contiguous, amax zeroed or a history row): the casts into
    the uint8 views q, q_t and scale_inv when given, else (CURRENT_SCALE) the amaxes and the scales written into ``scale``."""
    m, n = x.shape
    current = q is None
    with device_guard(x):  # one program even for an empty x: it writes scale_inv (or the scales)
        _cast_transpose_grouped_kernel[(max(1, cdiv(m, _CT_TILE_M) * cdiv(n, _CT_TILE_N)),)](
            x, q, q_t, split_ends(m_splits, x.device), scale, scale_inv, amax.view(torch.int32),
            stream_counters(x.device) if current else None, m, n, len(m_splits), x.stride(0), scale.stride(0),
            0 if current else scale_inv.stride(0), amax.stride(0), float(amax_epsilon),
            BLOCK_M=_CT_TILE_M, BLOCK_N=_CT_TILE_N, GP=next_power_of_2(len(m_splits)), num_warps=4,
            CURRENT_SCALE=current, POWER_2=bool(power_2_scale),
            LOAD_TRANSPOSED=not current and x.dtype == torch.float32,  # see quantization._launch_cast_transpose
            **fp8_format(fp8_dtype).constexprs(hw_fp8_cast(x.device)),
        )  # fmt: skip


def cast_transpose_grouped(x, m_splits, scale, fp8_dtype, amax_out=None):
    """:func:`cast_transpose` of the row splits x = [x_0; ...; x_{G-1}] in one launch, split g with scale[g].

    q[rows of g] = quantize(x_g, scale[g]), q_t = q^T, scale_inv[g] = 1 / scale[g], amax[g] = max |x_g| (finite, 0
    for an empty split); each split's codes are bit-identical to ``cast_transpose(x_g, scale[g])``'s.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride).
        m_splits: G >= 1 non-negative ints summing to M.
        scale: float32 [G] on x's device, any stride (e.g. a role's slots of a state's scales).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: None, or float32 [G] on x's device, any stride, values >= 0 (a role's slots of an amax
            history row): the kernel's atomic max lands there (amax_out[g] = max(amax_out[g], amax[g])).

    Returns:
        (q [M, N], q_t [N, M], scale_inv float32 [G] with every element 16-byte aligned (0-d views of it are
        cuBLASLt scale pointers), amax float32 [G]: amax_out itself when given).

    Raises:
        TypeError / ValueError: as :func:`cast_transpose`, bad splits, or scale / amax_out not float32 [G] on
            x's device.
    """
    check_cast_transpose_grouped(x, m_splits, scale, fp8_dtype, amax_out)
    groups = len(m_splits)
    x = rows_contiguous(x)
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    q_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((groups, 4), dtype=torch.float32, device=x.device)[:, 0]  # 16 bytes apart
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device) if amax_out is None else amax_out
    _launch_grouped(x, m_splits, fp8_dtype, scale=scale, amax=amax, q=q.view(torch.uint8), q_t=q_t.view(torch.uint8), scale_inv=scale_inv)
    return q, q_t, scale_inv, amax


def current_scale_grouped(x, m_splits, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """:func:`current_scale` of each row split x_g in one launch: (scale [G], amax [G]), float32.

    amax[g] = max |x_g| (finite, 0 for an empty split), scale[g] = fp8_max / max(amax[g], eps) by ``scale_from_amax``'s
    rules; bit-identical to ``current_scale(x_g, ...)`` of each split.

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: x not 2-D, bad splits, fp8_dtype or amax_epsilon.
    """
    check_grouped_rows(x, m_splits)
    check_fp8_dtype(fp8_dtype)
    check_amax_epsilon(amax_epsilon)
    x = rows_contiguous(x)
    amax = torch.zeros(len(m_splits), dtype=torch.float32, device=x.device)
    scale = torch.empty(len(m_splits), dtype=torch.float32, device=x.device)  # written by the last program
    _launch_grouped(x, m_splits, fp8_dtype, scale=scale, amax=amax, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
    return scale, amax


def column_sums_grouped(x, m_splits, out_dtype=None):
    """out[g, j] = sum of x[r, j] over the rows of split g, in float32, rounded once to ``out_dtype`` (None: float32).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: x not 2-D, bad splits, a bad out_dtype.
    """
    check_grouped_rows(x, m_splits)
    check_dbias_dtype(out_dtype)
    return segment_column_sums(rows_contiguous(x), split_ends(m_splits, x.device), out_dtype or torch.float32)


def _group_vectors_on_device(x, m_splits, scale, fp8_dtype, amax_out=None):
    """Reject a scale or amax_out the grouped kernel would misread: not float32, or on another device than x."""
    if not isinstance(x, torch.Tensor):
        return True
    for name, t in (("scale", scale), ("amax_out", amax_out)):
        if isinstance(t, torch.Tensor) and (t.dtype != torch.float32 or t.device != x.device):
            return Reject(f"{name} must be float32 on {x.device}, got {t.dtype} on {t.device}")
    return True


SUPPORTS = {"cast_transpose_grouped": _group_vectors_on_device}
