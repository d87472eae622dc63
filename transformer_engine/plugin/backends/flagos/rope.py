"""Rotary position embedding (RoPE) in Triton, forward and backward, "sbhd" and "bshd" layouts.

For one token at position pos (its index in the sequence, plus ``start_positions[b]``) and one
head, with f = freqs[pos] (d_rot features), c = cos f, s = sin f, on feature j < d_rot:

    forward   out_j = x_j c_j + R_j x_p s_j
    backward  dx_j  = dy_j c_j - R_j dy_p s_p          (the transpose: R^T = -R)

where p is j's partner and R_j its sign: halves (p = j +- d_rot/2, R_j = -1 on the first half,
+1 on the second) or, interleaved, adjacent pairs (p = j xor 1, R_j = -1 on even j). Features
j >= d_rot pass through. Math in float32, result in the input's dtype.

One program per (token, batch) pair loads the angles once and walks the heads in blocks.
Packed sequences ("thd") and context parallelism (cp_size > 1) are declined (``SUPPORTS``) and
run on the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import check_rope
from transformer_engine.plugin.core import Reject

from ._common import device_guard, next_power_of_2
from ._launch import cached_launch

__all__ = ["fused_rope_forward", "fused_rope_backward"]

_FORMATS = ("sbhd", "bshd")
_HEAD_BLOCK_ELEMENTS = 4096  # BLOCK_H * BLOCK_D per step of the head loop


@cached_launch
@triton.jit
def _rope_kernel(
    t_ptr,  # *t [S, B, H, D] or [B, S, H, D] (strides below)
    out_ptr,  # *out, same shape, contiguous in t's layout
    freqs_ptr,  # *float32 [S_f, D_ROT] angles (row stride stride_f)
    start_ptr,  # *int start_positions [B] (HAS_START only)
    S,  # sequence length
    B,  # batch size
    H,  # heads
    D,  # head dim
    D_ROT,  # rotated features (even, <= D)
    S_F,  # rows of freqs
    stride_s,  # elements between tokens of t
    stride_b,  # elements between batch entries of t
    stride_h,  # elements between heads of t
    out_stride_s,  # elements between tokens of out
    out_stride_b,  # elements between batch entries of out
    stride_f,  # elements between rows of freqs
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    s_idx = pid // B
    b_idx = pid % B
    pos = s_idx
    if HAS_START:
        pos = pos + tl.load(start_ptr + b_idx).to(tl.int32)
    j = tl.arange(0, BLOCK_D)
    rot = j < D_ROT
    if INTERLEAVED:
        partner = j ^ 1
        sign = tl.where(j % 2 == 0, -1.0, 1.0)
    else:
        half = D_ROT // 2
        partner = tl.where(j < half, j + half, j - half)
        sign = tl.where(j < half, -1.0, 1.0)
    pos_j = pos + 0 * j  # broadcast before "&": the interpreter mishandles tensor & scalar masks
    in_table = rot & (pos_j < S_F) & (pos_j >= 0)
    f_row = freqs_ptr + pos.to(tl.int64) * stride_f
    # a position past freqs reads NaN angles, so the error shows instead of a silent identity
    cos = tl.cos(tl.load(f_row + j, mask=in_table, other=float("nan")))
    if BACKWARD:
        sin = -sign * tl.sin(tl.load(f_row + partner, mask=in_table, other=float("nan")))
    else:
        sin = sign * tl.sin(tl.load(f_row + j, mask=in_table, other=float("nan")))
    base = s_idx.to(tl.int64) * stride_s + b_idx.to(tl.int64) * stride_b
    out_base = s_idx.to(tl.int64) * out_stride_s + b_idx.to(tl.int64) * out_stride_b
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = heads < H
        mask = h_mask[:, None] & (j < D)[None, :]
        offs = heads[:, None].to(tl.int64) * stride_h
        x = tl.load(t_ptr + base + offs + j[None, :], mask=mask, other=0.0).to(tl.float32)
        x_p = tl.load(t_ptr + base + offs + partner[None, :], mask=h_mask[:, None] & rot[None, :], other=0.0)
        rotated = x * cos[None, :] + x_p.to(tl.float32) * sin[None, :]
        y = tl.where(rot[None, :], rotated, x)
        out_offs = out_base + heads[:, None].to(tl.int64) * D + j[None, :]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    """The catalog's checks, then this kernel's limits (``_fits`` declines those calls before they get here)."""
    check_rope(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    if tensor_format not in _FORMATS or cp_size != 1:
        raise NotImplementedError(f"flagos fused_rope: tensor_format={tensor_format!r}, cp_size={cp_size}: the kernel "
                                  "handles sbhd and bshd without context parallelism; use another backend for this call")
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if start_positions is None and seq > freqs.shape[0]:
        raise ValueError(f"position {seq - 1} is past the {freqs.shape[0]} rows of freqs; pass longer freqs")


def _rope(t, freqs, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank, backward: bool):
    """Launch ``_rope_kernel`` over the (token, batch) pairs of t."""
    _check(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    if t.stride(-1) != 1:
        t = t.contiguous()
    seq_dim, batch_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
    s, b, h, d = t.shape[seq_dim], t.shape[batch_dim], t.shape[2], t.shape[3]
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    table = table if table.dtype == torch.float32 and table.stride(-1) == 1 else table.float().contiguous()
    block_d = next_power_of_2(d)
    block_h = max(1, min(next_power_of_2(h), _HEAD_BLOCK_ELEMENTS // block_d))
    if out.numel():
        with device_guard(t):
            _rope_kernel[(s * b,)](
                t, out, table, start_positions if start_positions is not None else table,
                s, b, h, d, table.shape[1], table.shape[0],
                t.stride(seq_dim), t.stride(batch_dim), t.stride(2), out.stride(seq_dim), out.stride(batch_dim),
                table.stride(0),
                BLOCK_H=block_h, BLOCK_D=block_d, INTERLEAVED=bool(interleaved), BACKWARD=backward,
                HAS_START=start_positions is not None, num_warps=4,
            )  # fmt: skip
    return out


def fused_rope_forward(t, freqs, tensor_format="sbhd", interleaved=False, start_positions=None, cu_seqlens=None, cp_size=1, cp_rank=0):
    """out = rope(t, freqs) (plugin/catalog/rope.py) on the first d_rot features of each head.

    This kernel's limits: "sbhd" and "bshd" only, without context parallelism (cp_size 1); packed
    sequences ("thd", t [t, h, d] with cu_seqlens) and cp_size > 1 are declined by ``SUPPORTS`` and
    run on the reference. A position past the rows of freqs (through start_positions) gives NaN.

    Returns:
        Tensor with t's shape and dtype.

    Raises:
        ValueError: an argument the catalog's checks reject (``check_rope``), or freqs too short.
        NotImplementedError: tensor_format "thd" or cp_size > 1 (this kernel's limits).
    """
    return _rope(t, freqs, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank, backward=False)


def fused_rope_backward(grad_out, freqs, tensor_format="sbhd", interleaved=False, start_positions=None, cu_seqlens=None, cp_size=1,
                        cp_rank=0):
    """grad_t = grad_out c - R(grad_out s): the transpose of :func:`fused_rope_forward`.

    Returns:
        Tensor with grad_out's shape and dtype.

    Raises:
        ValueError / NotImplementedError: as :func:`fused_rope_forward`.
    """
    return _rope(grad_out, freqs, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank, backward=True)


def _fits(t, freqs, tensor_format="sbhd", interleaved=False, start_positions=None, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Decline packed sequences, context parallelism and operands on another device."""
    if tensor_format not in _FORMATS:
        return Reject(f"tensor_format={tensor_format!r}: the Triton kernel handles {', '.join(_FORMATS)} only")
    if cp_size != 1 or cu_seqlens is not None:
        return Reject("context parallelism (cp_size > 1) and cu_seqlens are handled by the reference")
    if isinstance(t, torch.Tensor):
        for name, other in (("freqs", freqs), ("start_positions", start_positions)):
            if isinstance(other, torch.Tensor) and other.device != t.device:
                return Reject(f"{name} is on {other.device} but the input on {t.device}")
    return True


SUPPORTS = {"fused_rope_forward": _fits, "fused_rope_backward": _fits}
