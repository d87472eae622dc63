"""Reading device and dtype off an argument by duck typing, and compute-capability probes.

The core imports no tensor library. An argument with ``.device`` (having ``.type`` and ``.index``)
and ``.dtype`` is described by an :class:`~.types.ArgKey`; a list or tuple is described by its first
element (the multi-tensor optimizer ops take lists of lists). Compute capability comes from probes
that a framework-aware backend registers per device type (the PyTorch backends register one for
``"cuda"``); a device type without a probe reports none.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple

from .types import ArgKey

__all__ = ["arg_key", "register_capability_probe", "compute_capability", "clear_probe_cache"]

_NO_KEY = ArgKey(None, None, None)
_probes: Dict[str, Callable[[Optional[int]], Optional[Tuple[int, int]]]] = {}
_probe_cache: Dict[Tuple[str, Optional[int]], Optional[Tuple[int, int]]] = {}
_lock = threading.Lock()


def arg_key(value: Any) -> ArgKey:
    """Device type, device index and dtype name of ``value`` (or of its first element)."""
    while isinstance(value, (list, tuple)):
        if not value:
            return _NO_KEY
        value = value[0]
    device = getattr(value, "device", None)
    dtype = getattr(value, "dtype", None)
    if device is None and dtype is None:
        return _NO_KEY
    dtype_name = None
    if dtype is not None:
        dtype_name = str(dtype)
        if dtype_name.startswith("torch."):
            dtype_name = dtype_name[6:]
    if device is None:
        return ArgKey(None, None, dtype_name)
    if isinstance(device, str):  # e.g. JAX-like objects; "cuda:0"
        kind, _, index = device.partition(":")
        return ArgKey(kind, int(index) if index.isdigit() else None, dtype_name)
    return ArgKey(getattr(device, "type", str(device)), getattr(device, "index", None), dtype_name)


def register_capability_probe(device_type: str, probe: Callable[[Optional[int]], Optional[Tuple[int, int]]]) -> None:
    """Register ``probe(device_index) -> (major, minor) | None`` for a device type."""
    with _lock:
        _probes[device_type.lower()] = probe
        _probe_cache.clear()


def compute_capability(device_type: Optional[str], device_index: Optional[int]) -> Optional[Tuple[int, int]]:
    """The (major, minor) compute capability of a device, or None if unknown. Cached per device."""
    if device_type is None:
        return None
    key = (device_type, device_index)
    try:
        return _probe_cache[key]
    except KeyError:
        pass
    probe = _probes.get(device_type)
    value = None
    if probe is not None:
        try:
            found = probe(device_index)
            value = (int(found[0]), int(found[1])) if found is not None else None
        except Exception:  # a broken probe means "unknown", never a failed dispatch
            value = None
    with _lock:
        _probe_cache[key] = value
    return value


def clear_probe_cache() -> None:
    """Forget probed capabilities."""
    with _lock:
        _probe_cache.clear()


def _reinit_after_fork() -> None:
    """In a forked child: a fresh lock (another thread may have held the old one) and no cached probes."""
    global _lock
    _lock = threading.Lock()
    _probe_cache.clear()
