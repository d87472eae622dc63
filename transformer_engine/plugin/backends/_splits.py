"""The row splits of a grouped op: their bounds on the host, and on the device ends[g] = m_0 + ... + m_g and the
split of each row, built once per (splits, device).

Grouped kernels (``cast_transpose_grouped``, the grouped GEMM) find the split g of row r as the number of
ends <= r. The splits of a mixture-of-experts layer repeat from step to step, so the device vectors are
cached (least recently used out first); a new one travels from pinned memory without a host sync.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import List, Sequence, Tuple

import torch

__all__ = ["split_bounds", "split_ends", "split_of_rows"]

_CACHED_SPLITS = 16  # distinct (splits, device) pairs whose ends are kept on the devices
_CACHED_ROWS = 4  # ... and whose row index is


def split_bounds(m_splits: Sequence[int]) -> List[Tuple[int, int]]:
    """(start, stop) of each split along the split dimension."""
    return [(stop - m, stop) for m, stop in zip(m_splits, accumulate(m_splits))]


def split_of_rows(m_splits: Sequence[int], device) -> torch.Tensor:
    """int32 [M] on ``device``: the split each row belongs to (an index that spreads per-split values over the rows
    in one gather); do not write it. Few are kept (M entries each): a forward's and its backward's."""
    return _rows_on(tuple(m_splits), torch.device(device))


def split_ends(m_splits: Sequence[int], device) -> torch.Tensor:
    """int32 [G] on ``device``: ends[g] = sum(m_splits[: g + 1]) (the callers checked the splits); do not write it."""
    return _ends_on(tuple(m_splits), torch.device(device))


@functools.lru_cache(maxsize=_CACHED_SPLITS)
def _ends_on(m_splits: tuple, device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(m_splits, dtype=torch.int64).cumsum(0).to(torch.int32), device, m_splits)


@functools.lru_cache(maxsize=_CACHED_ROWS)
def _rows_on(m_splits: tuple, device: torch.device) -> torch.Tensor:
    rows = torch.arange(len(m_splits), dtype=torch.int32).repeat_interleave(torch.tensor(m_splits, dtype=torch.int64))
    return _to_device(rows, device, m_splits)


def _to_device(host: torch.Tensor, device: torch.device, m_splits: tuple) -> torch.Tensor:
    """host on ``device``; on CUDA from pinned memory, queued on the stream (no host sync).

    Raises:
        RuntimeError: a CUDA graph is being captured: the graph would copy from a host buffer freed after this call.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the device vectors of the row splits {list(m_splits)} are made while a CUDA graph is captured; run the "
                "grouped op once with the same splits before capturing (make_graphed_callables' warm-up does)"
            )
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
