"""Collective operations over a process group (``torch.distributed``; default: the world group), along dim 0.

    AllReduce       y = sum_r x_r                      dx = dy (the gradient is the same on every rank)
    ReduceScatter   y_r = (sum_q x_q)[rows of r]       dx = all_gather(dy)
    AllGather       y = concat_r x_r                   dx_r = (sum_q dy_q)[rows of r]

With a group of one rank each is the identity.
"""

from __future__ import annotations

import torch

from ..parallel import comm
from .op import BasicOperation

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


class AllReduce(BasicOperation):
    """y = sum over the ranks of x (e.g. the partial output of a row-parallel linear).

    Args:
        process_group: the group (default: the world group).
        reduce_in_backward: stored (TE's argument); as in TE the gradient passes through unchanged.
    """

    def __init__(self, process_group=None, reduce_in_backward: bool = True) -> None:
        super().__init__()
        self.process_group = process_group
        self._reduce_in_backward = reduce_in_backward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.reduce_from_tensor_parallel_region(x.contiguous(), self.process_group)


class ReduceScatter(BasicOperation):
    """y_r = rows of rank r (dim 0) of the sum over the ranks of x; dim 0 must divide by the group size.

    Args:
        process_group: the group (default: the world group).
    """

    def __init__(self, process_group=None) -> None:
        super().__init__()
        self.process_group = process_group
        self.process_group_size = comm.group_size(process_group)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_to_sequence_parallel_region(x.contiguous(), self.process_group)


class AllGather(BasicOperation):
    """y = the ranks' x concatenated along dim 0.

    Args:
        process_group: the group (default: the world group).
    """

    def __init__(self, process_group=None) -> None:
        super().__init__()
        self.process_group = process_group
        self.process_group_size = comm.group_size(process_group)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_from_sequence_parallel_region(x.contiguous(), self.process_group)
