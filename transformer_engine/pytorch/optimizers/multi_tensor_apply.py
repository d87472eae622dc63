"""``multi_tensor_applier``: run one multi-tensor op over aligned lists of tensors (TE's convention).

An op is called as ``op(chunk_size, noop_flag, tensor_lists, *args)``; ``tensor_lists`` holds lists of
equal length, one tensor per parameter (e.g. ``[grads, params, exp_avgs, exp_avg_sqs]``). Slots whose
first tensor is empty are dropped, and DTensors travel as their local shards.

Example:
    >>> import torch
    >>> from transformer_engine.pytorch.optimizers import multi_tensor_applier, multi_tensor_scale
    >>> src, dst = [torch.ones(3)], [torch.empty(3)]
    >>> flag = torch.zeros(1, dtype=torch.int32)
    >>> multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.5)
    >>> dst[0]
    tensor([0.5000, 0.5000, 0.5000])
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch
from torch.distributed.tensor import DTensor

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args, **kwargs)`` with the lists cleaned up.

    Args:
        chunk_size: elements per chunk the op may process at once (a launch hint for the backends).
    """

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, op: Callable, noop_flag_buffer: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]], *args, **kwargs):
        """Run ``op`` on the non-empty slots of ``tensor_lists``; None when every slot is empty.

        Raises:
            RuntimeError: the lists do not all have the same length.
        """
        lengths = [len(tensors) for tensors in tensor_lists]
        if len(set(lengths)) > 1:
            raise RuntimeError(f"multi_tensor_applier: expected aligned tensor lists (one tensor per slot in each), got lengths {lengths}")
        keep = [tensor.numel() > 0 for tensor in tensor_lists[0]]
        lists = [[_local(t) for t, kept in zip(tensors, keep) if kept] for tensors in tensor_lists]
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args, **kwargs)


multi_tensor_applier = MultiTensorApply(2048 * 32)
