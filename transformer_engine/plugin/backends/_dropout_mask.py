"""The dropout ops' keep mask, bit-packed: eight elements per byte.

Element i of the flattened (row-major) tensor is kept when bit i % 8 (least significant first) of
byte i // 8 is set; the mask holds ceil(numel / 8) bytes and the bits past numel are 0. A bool mask
would take one byte per element: at a Transformer layer's [8192, 4096] that is 32 MiB saved for
backward per dropout instead of 4 MiB, and the kernels move eight times the mask bytes.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["pack_keep", "packed_bytes", "unpack_keep"]


def packed_bytes(numel: int) -> int:
    """Bytes of the packed mask of ``numel`` elements."""
    return (numel + 7) // 8


def pack_keep(keep: torch.Tensor) -> torch.Tensor:
    """The packed uint8 mask [ceil(numel / 8)] of a bool ``keep`` of any shape."""
    flat = keep.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=keep.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_keep(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool keep mask of ``shape`` (True = kept) from the packed uint8 ``mask``."""
    shifts = torch.arange(8, dtype=torch.int32, device=mask.device)
    bits = (mask.to(torch.int32).reshape(-1, 1) >> shifts) & 1
    numel = 1
    for n in shape:
        numel *= n
    return bits.reshape(-1)[:numel].view(tuple(shape)).bool()
