"""The row splits of a grouped op: their bounds on the host, and on the device ends[g] = m_0 + ... + m_g and the
sizes m_g, built once per (splits, device).

Grouped kernels (``cast_transpose_grouped``, the grouped GEMM) find the split g of row r as the number of
ends <= r. The splits of a mixture-of-experts layer repeat from step to step, so the device vectors are
cached (least recently used out first); a new one travels from pinned memory without a host sync.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import List, Sequence, Tuple

import torch

__all__ = ["split_bounds", "split_ends", "split_sizes"]

_CACHED_SPLITS = 16  # distinct (splits, device) pairs kept on the devices


def split_bounds(m_splits: Sequence[int]) -> List[Tuple[int, int]]:
    """(start, stop) of each split along the split dimension."""
    return [(stop - m, stop) for m, stop in zip(m_splits, accumulate(m_splits))]


def split_sizes(m_splits: Sequence[int], device) -> torch.Tensor:
    """int64 [G] on ``device``: the sizes m_g (``repeat_interleave``'s repeats); do not write it."""
    return _on_device(tuple(m_splits), torch.device(device), cumulative=False)


def split_ends(m_splits: Sequence[int], device) -> torch.Tensor:
    """int32 [G] on ``device``: ends[g] = sum(m_splits[: g + 1]) (the callers checked the splits); do not write it."""
    return _on_device(tuple(m_splits), torch.device(device), cumulative=True)


@functools.lru_cache(maxsize=2 * _CACHED_SPLITS)
def _on_device(m_splits: tuple, device: torch.device, cumulative: bool) -> torch.Tensor:
    sizes = torch.tensor(m_splits, dtype=torch.int64)
    host = sizes.cumsum(0).to(torch.int32) if cumulative else sizes
    if device.type == "cuda" and torch.cuda.is_available():  # pinned: the copy is queued on the stream, no host sync
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
