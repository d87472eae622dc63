"""Rotary position embedding (RoPE): the frequency table and its application to q / k.

``RotaryPositionEmbedding(dim)(s)`` returns the angles f[p, k] = p * base^(-2k / d_rot) for positions
p < s, as float32 [s, 1, 1, d_rot] with each frequency repeated over its rotation pair (halves, or
adjacent elements when interleaved). ``apply_rotary_pos_emb`` rotates the first d_rot features of
each head, at each token's position p (its index in the sequence, plus ``start_positions[b]``):

    out = x cos f + rotate(x) sin f,   rotate([x1, x2]) = [-x2, x1]   (or per adjacent pair)

``fused=True`` runs the catalog ops ``fused_rope_forward`` / ``fused_rope_backward`` (float32 math);
``fused=False`` is TE's unfused path in plain PyTorch (math in the input's dtype, autograd).
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.plugin import ops

from ..module.base import default_device
from . import _layout

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]


class RotaryPositionEmbedding(torch.nn.Module):
    """The RoPE angle table (Su et al., https://arxiv.org/abs/2104.09864).

    Args:
        dim: rotary dimension (usually the head size).
        rotary_percent: rotate only ``int(dim * rotary_percent)`` features.
        seq_len_interpolation_factor: with ``pretrained_max_position_embeddings``, divide positions by
            this factor (position interpolation); lengths beyond pretrained * factor scale positions
            by pretrained / length instead. Ignored without ``pretrained_max_position_embeddings`` (TE).
        pretrained_max_position_embeddings: context length the model was trained with.
        rotary_base: the base of the frequencies (10000).
        interleaved: repeat each frequency over adjacent elements instead of over the two halves.

    Example:
        >>> rope = RotaryPositionEmbedding(8)
        >>> rope(5).shape
        torch.Size([5, 1, 1, 8])
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[int] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(f"the rotary dimension (dim * rotary_percent = {dim}) must be a positive even number")
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=default_device()) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponent))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """float32 angles [max_seq_len, 1, 1, d_rot] for positions offset .. offset + max_seq_len - 1."""
        with torch.autocast(device_type=self.inv_freq.device.type, enabled=False):
            seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
            factor, pretrained = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
            if factor is not None and pretrained is not None:  # TE scales only when both are set
                if max_seq_len > pretrained * factor:
                    seq = seq * (pretrained / max_seq_len)  # dynamic scaling beyond the learned range
                else:
                    seq = seq / factor
            freqs = torch.outer(seq, self.inv_freq.float())
            if self.interleaved:
                emb = freqs.repeat_interleave(2, dim=-1)
            else:
                emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


class _FusedRoPEFunc(torch.autograd.Function):
    """out = fused_rope_forward(t, ...); grad = fused_rope_backward(grad_out, ...)."""

    @staticmethod
    def forward(ctx, t, freqs, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank):
        freqs = freqs.float()
        ctx.save_for_backward(freqs, start_positions, cu_seqlens)
        ctx.settings = (tensor_format, interleaved, cp_size, cp_rank)
        return ops.fused_rope_forward(t, freqs, tensor_format=tensor_format, interleaved=interleaved, start_positions=start_positions,
                                      cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)

    @staticmethod
    def backward(ctx, grad_out):
        freqs, start_positions, cu_seqlens = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.settings
        grad = ops.fused_rope_backward(
            grad_out.contiguous(), freqs, tensor_format=tensor_format, interleaved=interleaved, start_positions=start_positions,
            cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank,
        )
        return grad, None, None, None, None, None, None, None


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] on the halves, or (-x_{2i+1}, x_{2i}) on adjacent pairs."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cp_positions(length: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """Positions in the full sequence of the ``length`` tokens a context-parallel rank holds (chunks r, 2cp-1-r)."""
    idx = torch.arange(length, device=device)
    if cp_size == 1:
        return idx
    half = length // 2
    return torch.where(idx < half, idx + cp_rank * half, length * cp_size - (cp_rank + 1) * half + (idx - half))


def _unfused(t, freqs, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x cos f + rotate(x) sin f in t's dtype; positions broadcast against t's leading dims (without h, d)."""
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1])[positions].unsqueeze(-2)
    cos, sin = torch.cos(angles).to(t.dtype), torch.sin(angles).to(t.dtype)
    d_rot = freqs.shape[-1]
    x, x_pass = t[..., :d_rot], t[..., d_rot:]
    return torch.cat((x * cos + _rotate_half(x, interleaved=interleaved) * sin, x_pass), dim=-1)


def _positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> torch.Tensor:
    """The position of every token: [s, 1] or [s, b] (sbhd), [1, s] or [b, s] (bshd), [n] for the
    n = cu_seqlens[-1] / cp_size packed rows (thd)."""
    if tensor_format == "thd":
        bounds = (cu_seqlens.long() // cp_size).tolist()
        parts = []
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            offset = 0 if start_positions is None else int(start_positions[i])
            parts.append(_cp_positions(end - start, cp_size, cp_rank, t.device) + offset)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=t.device)
    seq_dim = 0 if tensor_format == "sbhd" else 1
    pos = _cp_positions(t.shape[seq_dim], cp_size, cp_rank, t.device)
    pos = pos[:, None] if seq_dim == 0 else pos[None, :]
    if start_positions is not None:
        offset = start_positions.to(t.device).long()
        pos = pos + (offset[None, :] if seq_dim == 0 else offset[:, None])
    return pos


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Rotate the first d_rot features of every head of ``t`` by its tokens' positions.

    Args:
        t: [s, b, h, d] ("sbhd"), [b, s, h, d] ("bshd") or [t, h, d] ("thd").
        freqs: float32 [s_max, 1, 1, d_rot] from :class:`RotaryPositionEmbedding`, d_rot <= d.
        tensor_format: "sbhd", "bshd" or "thd".
        start_positions: int [b], position of each sequence's first token (KV-cache inference).
        interleaved: rotate adjacent pairs instead of halves.
        fused: run the catalog op (float32 math) instead of the unfused PyTorch path.
        cu_seqlens: int32 [b + 1] sequence offsets, required for "thd".
        cp_size, cp_rank: context parallelism (this rank holds chunks r and 2 cp_size - 1 - r).

    Returns:
        A tensor like ``t``.

    Raises:
        ValueError: unknown format, "thd" without cu_seqlens, or start_positions with cp_size > 1.

    Example:
        >>> freqs = RotaryPositionEmbedding(8)(6)
        >>> apply_rotary_pos_emb(torch.randn(6, 2, 3, 8), freqs).shape
        torch.Size([6, 2, 3, 8])
    """
    if tensor_format not in _layout.FORMATS:
        raise ValueError(f"tensor_format={tensor_format!r} is not one of {', '.join(_layout.FORMATS)}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("tensor_format='thd' needs cu_seqlens (int32 [b + 1])")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("start_positions is only supported without context parallelism (cp_size=1)")
    if fused:
        return _FusedRoPEFunc.apply(t, freqs, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
    positions = _positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    if positions.numel() and int(positions.max()) >= freqs.shape[0]:
        raise ValueError(f"position {int(positions.max())} is past the {freqs.shape[0]} rows of freqs; pass longer freqs")
    if tensor_format != "thd":
        return _unfused(t, freqs, positions, interleaved=interleaved)
    n = positions.shape[0]  # rows after the last packed sequence pass through unchanged
    return torch.cat((_unfused(t[:n], freqs, positions, interleaved=interleaved), t[n:]))
