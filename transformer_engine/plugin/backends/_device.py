"""CUDA device properties as the backends read them: asked once per device, constant under torch.compile."""

from __future__ import annotations

import functools

import torch

__all__ = ["cuda_properties"]


def cuda_properties(device: torch.device):
    """``torch.cuda.get_device_properties`` of CUDA ``device`` (its ``major``, ``minor``,
    ``multi_processor_count``...): built once per device index, as building it costs tens of
    microseconds; while torch.compile traces, read directly (Dynamo folds it into a constant, where the
    cached call would end the graph)."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_properties(device)
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)
