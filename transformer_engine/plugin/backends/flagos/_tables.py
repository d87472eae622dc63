"""Device tables that multi-tensor kernels read (tensor addresses, sizes, strides), built once per layout.

A table depends on its key alone (the addresses and layout it encodes), so a cached one serves every
call with that key, whichever tensor objects carry those addresses now. Building one copies it from
the host, which a CUDA-graph capture forbids: while the current stream captures, :meth:`TableCache.get`
returns only tables built before, and pins each one it returns (a captured graph keeps reading it, so
it must never be evicted).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Dict, Hashable, Optional, TypeVar

import torch

__all__ = ["TableCache"]

T = TypeVar("T")


class TableCache:
    """A least-recently-used cache of ``size`` tables, plus the tables pinned by captures (never evicted)."""

    def __init__(self, size: int):
        self._size = size
        self._tables: "collections.OrderedDict[Hashable, object]" = collections.OrderedDict()
        self._pinned: Dict[Hashable, object] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], T], device: torch.device) -> Optional[T]:
        """The table of ``key`` (``build()`` makes it on a miss); None on a miss while ``device``'s current
        stream is capturing a CUDA graph (the caller takes a path without the table)."""
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with self._lock:
            table = self._pinned.get(key)
            if table is None:
                table = self._tables.get(key)
                if table is not None:
                    self._tables.move_to_end(key)
            if table is not None:
                if capturing:
                    self._pinned[key] = table
                return table
        if capturing:
            return None
        table = build()
        with self._lock:
            self._tables[key] = table
            while len(self._tables) > self._size:
                self._tables.popitem(last=False)
        return table
