"""The dropout ops' keep mask, bit-packed: eight elements per byte.

Element i of the flattened (row-major) tensor is kept when bit i % 8 (least significant first) of
byte i // 8 is set; the mask holds ceil(numel / 8) bytes and the bits past numel are 0. A bool mask
would take one byte per element: at a Transformer layer's [8192, 4096] that is 32 MiB saved for
backward per dropout instead of 4 MiB, and the kernels move eight times the mask bytes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["pack_keep", "packed_bytes", "unpack_keep"]


def packed_bytes(numel: int) -> int:
    """Bytes of the packed mask of ``numel`` elements."""
    return (numel + 7) // 8


def _bit_positions(device) -> torch.Tensor:
    """[0, 1, ..., 7]: the shift of each element of a byte (made on the device: no host-to-device copy)."""
    return torch.arange(8, dtype=torch.int32, device=device)


def pack_keep(keep: torch.Tensor) -> torch.Tensor:
    """The packed uint8 mask [ceil(numel / 8)] of a bool ``keep`` of any shape."""
    flat = keep.reshape(-1).to(torch.int32)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) << _bit_positions(keep.device)).sum(dim=1).to(torch.uint8)


def unpack_keep(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool keep mask of ``shape`` (True = kept) from the packed uint8 ``mask``."""
    bits = (mask.to(torch.int32).reshape(-1, 1) >> _bit_positions(mask.device)) & 1
    return bits.reshape(-1)[: math.prod(shape)].view(tuple(shape)).bool()
