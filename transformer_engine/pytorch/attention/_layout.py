"""Layout conversions between TE's q/k/v formats and the catalog's ("bshd" or packed "thd").

- "sbhd" [s, b, h, d] is a transposed view of "bshd" [b, s, h, d];
- "thd" [t, h, d] packs sequence i into rows cu_seqlens[i]:cu_seqlens[i + 1]; with
  ``cu_seqlens_padded`` sequence i starts at row cu_seqlens_padded[i] and the rows after its
  cu_seqlens[i + 1] - cu_seqlens[i] real tokens are padding;
- a padded "bshd" batch holds sequence i in rows [i, :len_i].

Moving tokens between these layouts is a row gather (:func:`gather_rows`) and its inverse, a
scatter into zeros (:func:`scatter_rows`); both are differentiable.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = [
    "FORMATS",
    "to_bshd",
    "from_bshd",
    "seqlens",
    "max_seqlen",
    "token_rows",
    "gather_rows",
    "scatter_rows",
    "pack_bshd",
    "unpack_to_bshd",
]

FORMATS = ("sbhd", "bshd", "thd")


def to_bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x in "bshd" order: a transposed view for "sbhd", x itself for "bshd"."""
    return x.transpose(0, 1) if fmt == "sbhd" else x


def from_bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of :func:`to_bshd`."""
    return x.transpose(0, 1) if fmt == "sbhd" else x


def seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [b] lengths from int32 offsets [b + 1]."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def max_seqlen(cu_seqlens: torch.Tensor, given: Optional[int]) -> int:
    """``given`` when set, else the longest sequence (reads the offsets on the host)."""
    if given is not None:
        return int(given)
    lengths = seqlens(cu_seqlens)
    return int(lengths.max()) if lengths.numel() else 0


def token_rows(cu_seqlens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """int64 [t]: for token l of sequence i (packed order), row starts[i] + l of another layout.

    Example: cu_seqlens [0, 2, 5], starts [0, 8] -> [0, 1, 8, 9, 10].
    """
    lengths = seqlens(cu_seqlens)
    total = int(lengths.sum())
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    position = torch.arange(total, device=lengths.device) - cu_seqlens[:-1].long()[seq]
    return starts.long().to(lengths.device)[seq] + position


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] along dim 0 (differentiable)."""
    return x.index_select(0, rows.to(x.device))


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """zeros [total, ...] with row rows[n] = x[n] (differentiable; the inverse of :func:`gather_rows`)."""
    return x.new_zeros((total,) + tuple(x.shape[1:])).index_copy(0, rows.to(x.device), x)


def _batch_starts(cu_seqlens: torch.Tensor, stride: int) -> torch.Tensor:
    return torch.arange(cu_seqlens.numel() - 1, device=cu_seqlens.device) * stride


def pack_bshd(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """"thd" [t, ...] from a padded "bshd" batch x [b, s, ...] holding len_i real tokens in row i."""
    b, s = x.shape[:2]
    rows = token_rows(cu_seqlens, _batch_starts(cu_seqlens, s))
    return gather_rows(x.reshape((b * s,) + tuple(x.shape[2:])), rows)


def unpack_to_bshd(x: torch.Tensor, cu_seqlens: torch.Tensor, s: int) -> torch.Tensor:
    """Padded "bshd" [b, s, ...] (zeros after each sequence) from packed "thd" x [t, ...]."""
    b = cu_seqlens.numel() - 1
    rows = token_rows(cu_seqlens, _batch_starts(cu_seqlens, s))
    tail: List[int] = list(x.shape[1:])
    return scatter_rows(x, rows, b * s).reshape([b, s] + tail)
