"""Reference (pure PyTorch) implementations: rotary position embedding. See plugin/catalog/rope.py.

With f = freqs[pos] (float32, d_rot features), c = cos f, s = sin f, elementwise, on the first d_rot
features of each head (the rest pass through):
    forward   out = x c + R(x) s
    backward  dx = dy c + R^T(dy s) = dy c - R(dy s)          (R^T = -R)
where R is rotate_half, R([x1, x2]) = [-x2, x1], or, interleaved, R(x)_{2i} = -x_{2i+1},
R(x)_{2i+1} = x_{2i}. With TE's freqs (each frequency repeated over its rotation pair) the backward
is the inverse rotation (s -> -s).

Positions, as TE's fused kernel: pos = token index l in its sequence + ``start_positions[b]``.
Under context parallelism (cp_size > 1) a rank holds two chunks of L / 2 tokens of a sequence split
into 2 cp_size chunks, so l < L / 2 maps to l + r L / 2 and l >= L / 2 to
L cp_size - (r + 1) L / 2 + (l - L / 2). For "thd", ``cu_seqlens`` are the full (padded) offsets
before the split, divided by cp_size here; rows past the last sequence pass through unchanged.
Math in float32; the result has t's dtype.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from transformer_engine.plugin.backends._checks import check_rope

__all__ = ["fused_rope_forward", "fused_rope_backward"]


@dataclass(frozen=True, eq=False)
class _RopeArgs:
    """The settings of one RoPE call (the op's arguments after ``freqs``)."""

    tensor_format: str
    interleaved: bool
    start_positions: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    cp_size: int
    cp_rank: int


def _local_positions(length: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """Position in the full sequence of each of the ``length`` tokens this rank holds."""
    idx = torch.arange(length, device=device)
    if cp_size == 1:
        return idx
    if length % 2:
        raise ValueError(f"with cp_size={cp_size} each local sequence length must be even, got {length}")
    half = length // 2
    second = length * cp_size - (cp_rank + 1) * half + (idx - half)
    return torch.where(idx < half, idx + cp_rank * half, second)


def _thd_positions(total: int, cu_seqlens, start_positions, cp_size: int, cp_rank: int):
    """(positions [total], rows inside a sequence [total] as bool) for packed sequences."""
    bounds = (cu_seqlens.long() // cp_size).tolist()
    if bounds[-1] > total:
        raise ValueError(f"cu_seqlens[-1] / cp_size = {bounds[-1]} exceeds the {total} rows of t")
    pos = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    inside = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        offset = int(start_positions[i]) if start_positions is not None else 0
        pos[start:end] = _local_positions(end - start, cp_size, cp_rank, pos.device) + offset
        inside[start:end] = True
    return pos, inside


def _angles(t, freqs, args: _RopeArgs):
    """float32 rotation angles broadcastable to t[..., :d_rot]: [s, b, 1, d], [b, s, 1, d] or [t, 1, d]."""
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    if args.tensor_format == "thd":
        cu_seqlens = args.cu_seqlens.to(t.device)
        pos, inside = _thd_positions(t.shape[0], cu_seqlens, args.start_positions, args.cp_size, args.cp_rank)
    else:
        seq_dim = 0 if args.tensor_format == "sbhd" else 1
        pos = _local_positions(t.shape[seq_dim], args.cp_size, args.cp_rank, t.device)
        pos = pos[:, None] if seq_dim == 0 else pos[None, :]  # [s, 1] or [1, s]
        if args.start_positions is not None:
            offset = args.start_positions.to(t.device).long()
            pos = pos + (offset[None, :] if seq_dim == 0 else offset[:, None])
        inside = torch.ones_like(pos, dtype=torch.bool)
    if pos.numel() and int(pos.max()) >= table.shape[0]:
        raise ValueError(f"position {int(pos.max())} is past the {table.shape[0]} rows of freqs; pass longer freqs")
    angles = table.to(t.device)[pos] * inside[..., None]  # rows outside any sequence: angle 0 = identity
    return angles.unsqueeze(-2)


def _rotate_half(x, interleaved: bool):
    """R(x): [-x2, x1] on halves, or (-x_{2i+1}, x_{2i}) on adjacent pairs."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(t, freqs, args: _RopeArgs, inverse: bool):
    """out = x c + R(x) s (forward) or dy c - R(dy s) (backward) on the first d_rot features."""
    check_rope(t, freqs, args.tensor_format, args.start_positions, args.cu_seqlens, args.cp_size, args.cp_rank)
    angles = _angles(t, freqs, args)
    cos, sin = torch.cos(angles), torch.sin(angles)
    d_rot = freqs.shape[-1]
    x = t[..., :d_rot].float()
    if inverse:
        rotated = x * cos - _rotate_half(x * sin, args.interleaved)
    else:
        rotated = x * cos + _rotate_half(x, args.interleaved) * sin
    return torch.cat((rotated.to(t.dtype), t[..., d_rot:]), dim=-1)


def fused_rope_forward(t, freqs, tensor_format="sbhd", interleaved=False, start_positions=None, cu_seqlens=None, cp_size=1, cp_rank=0):
    """out = t c + R(t) s on the first d_rot features (see the module docstring).

    Args:
        t: [s, b, h, d] ("sbhd"), [b, s, h, d] ("bshd") or [t, h, d] ("thd").
        freqs: float32 [s_max, 1, 1, d_rot] angles, d_rot even and <= d.
        tensor_format: "sbhd", "bshd" or "thd".
        interleaved: rotate adjacent pairs instead of halves.
        start_positions: optional int [b], position offset of each sequence.
        cu_seqlens: int32 [b + 1] sequence offsets, required for "thd".
        cp_size, cp_rank: context-parallel world size and this rank.

    Returns:
        Tensor with t's shape and dtype.

    Raises:
        ValueError: bad format, shapes, context-parallel settings, or freqs too short.
    """
    args = _RopeArgs(tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
    return _rope(t, freqs, args, inverse=False)


def fused_rope_backward(grad_out, freqs, tensor_format="sbhd", interleaved=False, start_positions=None, cu_seqlens=None, cp_size=1,
                        cp_rank=0):
    """grad_t = grad_out c - R(grad_out s): the transpose of :func:`fused_rope_forward`.

    Args and Raises: as :func:`fused_rope_forward`, with ``grad_out`` in place of ``t``.

    Returns:
        Tensor with grad_out's shape and dtype.
    """
    args = _RopeArgs(tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
    return _rope(grad_out, freqs, args, inverse=True)
