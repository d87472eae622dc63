"""The delayed-scaling update in Triton: delayed_scaling_update, delayed_scaling_update_ (in place) and
delayed_scaling_update_many_ (several states, one launch).

Math (plugin/catalog/quantization.py), float32 throughout:

    delayed_scaling_update
                    amax = max_l H[l] ("max") or H[0] ("most_recent"), read before the roll;
                    s_new = (fp8_max / amax) / 2^margin where amax is finite and > 0, else the old s;
                    +-inf -> float32 max; H_new = roll(H, -1, dim 0) with row 0 zeroed. One launch:
                    a program owns a block of columns and walks down the L rows (IEEE divisions,
                    so s_new is bit-identical to the reference's)
    delayed_scaling_update_
                    the same step in place where H[0] != 0 (NaN included; idle columns keep H and s),
                    then scale_inv = 1 / s: the same kernel (IN_PLACE), one launch; each chunk of rows
                    is loaded, then a barrier, then stored one row up, so no row is written unread;
                    with ``amax`` [K] (this step's amaxes of the first K columns, not yet in H),
                    H[0, :K] = max(H[0, :K], amax) first, in registers (HAS_AMAX): a traced step hands its
                    casts' amaxes to the update this way
    delayed_scaling_update_many_
                    delayed_scaling_update_ of every state: one launch, program (block, state) reads the
                    state's addresses, sizes and strides from a device table built once per layout
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import (
    check_delayed_scaling_update,
    check_delayed_scaling_update_,
    check_delayed_scaling_update_many_,
    check_shared_update_args,
    check_update_lists,
)
from transformer_engine.plugin.core import Reject

from ._common import cdiv, device_guard, next_power_of_2
from ._launch import cached_launch
from ._tables import TableCache

__all__ = ["delayed_scaling_update", "delayed_scaling_update_", "delayed_scaling_update_many_"]

_UPDATE_COLS = 32  # columns per program of the delayed-scaling update (one 128-byte row segment)
_UPDATE_TILE = 4096  # history elements per loop step of that update (L = 1024 takes 8 steps)
_STATE_TABLES = TableCache(64)  # the state tables of delayed_scaling_update_many_ (one per set of modules updated together)


@triton.jit
def _update_columns(
    history_ptr, scale_ptr, fp8_max, history_new_ptr, scale_new_ptr, scale_inv_ptr, amax_ptr, margin_scale, L, N, amax_n,
    stride_hl, stride_hn, stride_s, stride_si, stride_a, fp8_max_stride, block,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX_IS_PTR: tl.constexpr,
    IN_PLACE: tl.constexpr, HAS_AMAX: tl.constexpr,
):
    """The update of columns [block * BLOCK_N, (block + 1) * BLOCK_N) of one state (arguments as
    ``_delayed_scaling_update_kernel``'s)."""
    # IN_PLACE is race-free: a program owns its columns, and every row is read before any thread
    # writes it. Chunk c (rows [a, b)) is loaded, then a barrier, then stored to rows [a - 1, b - 1),
    # rows read by chunks <= c, each before its barrier; later chunks read rows >= b only, so load
    # prefetching cannot see a new value either. Row 0's value goes to row L - 1 after the loop (after
    # the last chunk's barrier, and no chunk stores row L - 1); s is read before the first barrier.
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    h0 = tl.load(history_ptr + cols * stride_hn, mask=col_mask, other=0.0).to(tl.float32)  # H[0]
    if HAS_AMAX:  # H[0, :K] = max(H[0, :K], amax), NaN from either side kept (torch.maximum)
        a = tl.load(amax_ptr + cols * stride_a, mask=cols < amax_n, other=0.0).to(tl.float32)
        h0 = tl.where(h0 != h0, h0, tl.where(a != a, a, tl.maximum(h0, a)))
    if IN_PLACE:  # H and s themselves, in the active columns only: H[0] != 0 on the bit pattern (NaN is
        # active; a float compare may flush a subnormal to zero on the GPU)
        stride_nl, stride_nn, stride_ns = stride_hl, stride_hn, stride_s
        active = col_mask & ((h0.to(tl.int32, bitcast=True) & 0x7FFFFFFF) != 0)
    else:  # new contiguous tensors, every column
        stride_nl, stride_nn, stride_ns = N, 1, 1
        active = col_mask
    s_old = tl.load(scale_ptr + cols * stride_s, mask=col_mask, other=1.0).to(tl.float32)
    if FP8_MAX_IS_PTR:
        fp8_max_v = tl.load(fp8_max + cols * fp8_max_stride, mask=col_mask, other=1.0)
    else:
        fp8_max_v = tl.zeros_like(h0) + fp8_max
    amax = h0
    nan_seen = amax != amax  # torch's max propagates NaN; tl.max may drop it
    for start in range(0, L, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        mask = (rows < L)[:, None] & col_mask[None, :]
        h = tl.load(history_ptr + rows[:, None] * stride_hl + cols[None, :] * stride_hn, mask=mask, other=0.0)
        h = h.to(tl.float32)
        if HAS_AMAX:  # row 0 as folded above
            h = tl.where((rows == 0)[:, None], h0[None, :], h)
        if AMAX_MAX:
            amax = tl.maximum(amax, tl.max(tl.where(mask, h, float("-inf")), axis=0))
            nan_seen = nan_seen | (tl.max((h != h).to(tl.int32), axis=0) > 0)
        if IN_PLACE:
            tl.debug_barrier()  # every thread has read this chunk before any thread overwrites a row of it
        # roll by -1: H_new[l - 1] = H[l] for l >= 1 (H_new[0] = 0); H[0] goes to row L - 1 below
        dest = rows - 1
        store = (rows > 0)[:, None] & mask & active[None, :]
        tl.store(history_new_ptr + dest[:, None] * stride_nl + cols[None, :] * stride_nn,
                 tl.where(dest[:, None] == 0, 0.0, h), mask=store)  # fmt: skip
    tl.store(history_new_ptr + (L - 1) * stride_nl + cols * stride_nn, tl.where(L == 1, 0.0, h0), mask=active)
    # each float32 quotient is taken in float64 and rounded once: the correctly rounded float32 division
    # (53 >= 2 * 24 + 2 bits makes the double rounding innocuous), bit-identical to torch's on every
    # device, where Triton's float32 division was seen to differ by one ulp on the H200
    s_new = (fp8_max_v.to(tl.float64) / amax.to(tl.float64)).to(tl.float32)
    s_new = (s_new.to(tl.float64) / (tl.zeros_like(amax) + margin_scale).to(tl.float64)).to(tl.float32)
    # 0 < amax < inf on the bit pattern: a float compare may flush a subnormal amax to zero on the GPU
    amax_bits = amax.to(tl.int32, bitcast=True)
    valid = (amax_bits > 0) & (amax_bits < 0x7F800000) & ~nan_seen
    s_new = tl.where(valid, s_new, s_old)
    s_new = tl.where(tl.abs(s_new) == float("inf"), 3.4028234663852886e38, s_new)  # float32 max
    tl.store(scale_new_ptr + cols * stride_ns, s_new, mask=active)
    if IN_PLACE:  # scale_inv = 1 / s of every column (torch.reciprocal's correctly rounded float32)
        s_now = tl.where(active, s_new, s_old)
        tl.store(scale_inv_ptr + cols * stride_si, (1.0 / s_now.to(tl.float64)).to(tl.float32), mask=col_mask)


@cached_launch
@triton.jit
def _delayed_scaling_update_kernel(
    history_ptr,  # *H [L, N], strides (stride_hl, stride_hn), any float dtype (float32 when IN_PLACE)
    scale_ptr,  # *s [N], stride stride_s, any float dtype (float32 when IN_PLACE)
    fp8_max,  # float32 scalar; with FP8_MAX_IS_PTR a *float32 read at cols * fp8_max_stride
    history_new_ptr,  # *float32 [L, N] receiving H_new: a new contiguous tensor, or H itself when IN_PLACE
    scale_new_ptr,  # *float32 [N] receiving s_new: a new tensor, or s itself when IN_PLACE
    scale_inv_ptr,  # *float32 [N], stride stride_si: receives 1 / s (IN_PLACE only)
    amax_ptr,  # *float32 [K], stride stride_a: this step's amaxes of columns 0..K-1, folded into H[0] (HAS_AMAX only)
    margin_scale,  # float32 scalar: 2^margin
    L,  # rows of H (>= 1)
    N,  # columns of H
    amax_n,  # K: columns 0..K-1 have an entry in amax (HAS_AMAX only)
    stride_hl,  # elements between rows of H
    stride_hn,  # elements between columns of H
    stride_s,  # elements between entries of s
    stride_si,  # elements between entries of scale_inv
    stride_a,  # elements between entries of amax
    fp8_max_stride,  # elements between entries of fp8_max: 0 (one value for all) or its stride
    BLOCK_L: tl.constexpr,  # rows per loop step
    BLOCK_N: tl.constexpr,  # columns per program
    AMAX_MAX: tl.constexpr,  # True: amax = max over the L rows ("max"); False: amax = H[0] ("most_recent")
    FP8_MAX_IS_PTR: tl.constexpr,
    IN_PLACE: tl.constexpr,  # True: delayed_scaling_update_ (idle rule, H and s overwritten, scale_inv written)
    HAS_AMAX: tl.constexpr,  # True: H[0] = max(H[0], amax) before the step
):
    _update_columns(history_ptr, scale_ptr, fp8_max, history_new_ptr, scale_new_ptr, scale_inv_ptr, amax_ptr, margin_scale, L, N,
                    amax_n, stride_hl, stride_hn, stride_s, stride_si, stride_a, fp8_max_stride, tl.program_id(0),
                    BLOCK_L, BLOCK_N, AMAX_MAX, FP8_MAX_IS_PTR, IN_PLACE, HAS_AMAX)  # fmt: skip


@cached_launch
@triton.jit
def _delayed_scaling_update_many_kernel(
    table_ptr,  # *int64 [S, 9], per state: the addresses of H, s, scale_inv; L, N; strides of H (2), s, scale_inv
    fp8_max,  # float32 scalar, every state's
    margin_scale,  # float32 scalar: 2^margin
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    AMAX_MAX: tl.constexpr,
):
    """``delayed_scaling_update_`` of state program_id(1), columns of block program_id(0) (in place)."""
    row = table_ptr + tl.program_id(1) * 9
    n = tl.load(row + 4)
    if tl.program_id(0) * BLOCK_N < n:
        history = tl.load(row).to(tl.pointer_type(tl.float32))
        scale = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        scale_inv = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        _update_columns(history, scale, fp8_max, history, scale, scale_inv, scale_inv, margin_scale, tl.load(row + 3), n, 0,
                        tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8), 0, 0, tl.program_id(0),
                        BLOCK_L, BLOCK_N, AMAX_MAX, FP8_MAX_IS_PTR=False, IN_PLACE=True, HAS_AMAX=False)  # fmt: skip


def _fp8_max_arg(fp8_max, device: torch.device, n: int):
    """(kernel argument, stride) for fp8_max: a float as is, a tensor as float32 [1 or n] on ``device``."""
    if not isinstance(fp8_max, torch.Tensor):
        return float(fp8_max), 0
    vector = fp8_max.to(device=device, dtype=torch.float32).reshape(-1)
    return vector, (vector.stride(0) if vector.numel() == n else 0)


def delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo):
    """The catalog's ``delayed_scaling_update`` (new H_new and s_new; H may have any strides) in one launch:
    a program owns a block of columns and walks down the L rows. Bit-identical to the reference backend;
    raises as it does (shapes that do not match, a non-finite margin, an unknown amax_compute_algo)."""
    check_delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo)
    length, n = amax_history.shape
    history_new = torch.empty((length, n), dtype=torch.float32, device=amax_history.device)
    scale_new = torch.empty(n, dtype=torch.float32, device=amax_history.device)
    if n == 0:
        return history_new, scale_new
    _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, (history_new, scale_new, None))
    return history_new, scale_new


def delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax=None) -> None:
    """The catalog's ``delayed_scaling_update_`` (H, s and scale_inv of the active columns, in place; H
    may have any strides; ``amax`` of the first K columns folded into H[0] first) in one launch of ``delayed_scaling_update``'s
    kernel (IN_PLACE), bit-identical to the reference backend's. Raises as the reference backend does
    (float32 tensors, matching shapes and devices, a finite margin, a known amax_compute_algo).

    Under torch.compile this function is traced as it is (``UNDER_COMPILE``): Dynamo records the kernel,
    which Inductor launches on the states' own tensors, one launch per state where the tensor ops of
    the reference take three or four."""
    check_delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax)
    if amax_history.shape[1]:
        _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, (amax_history, scale, scale_inv), amax)


def delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo) -> None:
    """The catalog's ``delayed_scaling_update_many_``: every state's in-place update in one launch of
    ``_delayed_scaling_update_many_kernel``, which reads the states' addresses, sizes and strides from a
    device table (built and checked once per layout, see :mod:`._tables`). Inside a CUDA-graph capture
    that meets a new layout, one ``delayed_scaling_update_`` launch per state. Bit-identical to the
    reference backend; raises as it does."""
    check_update_lists(amax_histories, scales, scale_invs)  # (each call: the table's key does not cover these)
    check_shared_update_args(fp8_max, margin, amax_compute_algo)
    states = list(zip(amax_histories, scales, scale_invs))
    if not states:
        return
    device = amax_histories[0].device
    key = tuple((h.data_ptr(), h.dtype, h.device, h.shape, h.stride(), s.data_ptr(), s.dtype, s.device, s.shape, s.stride(),
                 i.data_ptr(), i.dtype, i.device, i.shape, i.stride()) for h, s, i in states)

    def build() -> torch.Tensor:
        check_delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo)
        rows = [[h.data_ptr(), s.data_ptr(), i.data_ptr(), *h.shape, *h.stride(), s.stride(0), i.stride(0)] for h, s, i in states]
        return torch.tensor(rows, dtype=torch.int64, device=device)

    table = _STATE_TABLES.get(key, build, device)
    if table is None:  # a new layout inside a capture
        for state in states:
            delayed_scaling_update_(*state, fp8_max, margin, amax_compute_algo)
        return
    length, n = max(h.shape[0] for h in amax_histories), max(h.shape[1] for h in amax_histories)
    if n == 0:
        return
    block_l, block_n = _blocks(length, n)
    with device_guard(amax_histories[0]):
        _delayed_scaling_update_many_kernel[(cdiv(n, block_n), len(states))](
            table, float(fp8_max), 2.0 ** float(margin), BLOCK_L=block_l, BLOCK_N=block_n, AMAX_MAX=amax_compute_algo == "max",
        )  # fmt: skip


def _blocks(length: int, n: int):
    """(BLOCK_L, BLOCK_N) of the update kernels for a history of ``length`` rows and ``n`` columns (at most)."""
    block_n = min(_UPDATE_COLS, next_power_of_2(n))
    return min(next_power_of_2(length), _UPDATE_TILE // block_n), block_n


def _launch_delayed_update(amax_history, scale, fp8_max, margin, amax_compute_algo, outputs, amax=None) -> None:
    """One launch of ``_delayed_scaling_update_kernel`` on checked arguments with N > 0.

    ``outputs`` = (H_new, s_new, None): new contiguous float32 tensors; or (H, s, scale_inv): in place.
    ``amax``: float32 [K] folded into H[0, :K] first (in place only), or None.
    """
    history_new, scale_new, scale_inv = outputs
    length, n = amax_history.shape
    fp8_max_arg, fp8_max_stride = _fp8_max_arg(fp8_max, amax_history.device, n)
    block_l, block_n = _blocks(length, n)
    in_place = scale_inv is not None
    with device_guard(amax_history):
        _delayed_scaling_update_kernel[(cdiv(n, block_n),)](
            amax_history, scale, fp8_max_arg, history_new, scale_new, scale_inv if in_place else scale_new,
            scale if amax is None else amax, 2.0 ** float(margin), length, n, 0 if amax is None else amax.shape[0],
            amax_history.stride(0), amax_history.stride(1),
            scale.stride(0), scale_inv.stride(0) if in_place else 0, 0 if amax is None else amax.stride(0), fp8_max_stride,
            BLOCK_L=block_l, BLOCK_N=block_n, AMAX_MAX=amax_compute_algo == "max",
            FP8_MAX_IS_PTR=isinstance(fp8_max_arg, torch.Tensor), IN_PLACE=in_place, HAS_AMAX=amax is not None,
        )  # fmt: skip


def _on_history_device(amax_history, named_tensors):
    """Reject any (name, tensor) on another device than the history (the kernel reads them all)."""
    for name, t in named_tensors:
        if isinstance(t, torch.Tensor) and isinstance(amax_history, torch.Tensor) and t.device != amax_history.device:
            return Reject(f"{name} must be on the history's device {amax_history.device}, got {t.device}")
    return True


def _scale_with_history(amax_history, scale, fp8_max, margin, amax_compute_algo):
    """Reject a scale on another device than the history."""
    return _on_history_device(amax_history, (("scale", scale),))


def _scales_with_history(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax=None):
    """Reject a scale, scale_inv or amax on another device than the history."""
    return _on_history_device(amax_history, (("scale", scale), ("scale_inv", scale_inv), ("amax", amax)))


SUPPORTS = {
    "delayed_scaling_update": _scale_with_history,
    "delayed_scaling_update_": _scales_with_history,
}
UNDER_COMPILE = {"delayed_scaling_update_": "trace"}
