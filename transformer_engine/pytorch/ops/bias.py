"""``Bias``: y = x + b over the last dim (db = sum of dy over all leading dims)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..module.base import default_device
from ..parallel import comm
from .basic_linear import default_group
from .op import BasicOperation

__all__ = ["Bias"]


class Bias(BasicOperation):
    """y = x + b, b of shape [size] (this rank's size / P entries with ``tensor_parallel``).

    Args (TE's; all but ``size`` keyword-only):
        size: the number of features.
        device: parameter device; None = current CUDA device if any, else CPU; "meta" defers
            initialization to the first forward (or :meth:`reset_parameters`).
        dtype: parameter dtype (default ``torch.get_default_dtype()``).
        tensor_parallel: split b along its dim over ``tensor_parallel_group``.
        tensor_parallel_group: process group (default: the world group).

    Raises:
        ValueError: ``size`` is not divisible by the group size.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.Bias(3, device="cpu")(torch.ones(2, 3))
        tensor([[1., 1., 1.],
                [1., 1., 1.]], grad_fn=<AddBackward0>)
    """

    def __init__(self, size: int, *, device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel: bool = False, tensor_parallel_group=None) -> None:
        super().__init__()
        group = default_group(tensor_parallel_group) if tensor_parallel else None
        parts = comm.group_size(group) if tensor_parallel else 1
        if size % parts:
            raise ValueError(f"Bias(size={size}, tensor_parallel=True) must split evenly over {parts} ranks")
        self.tensor_parallel, self.tensor_parallel_group, self.tensor_parallel_size = parts > 1, group if parts > 1 else None, parts
        self.local_size = size // parts
        self.bias = torch.nn.Parameter(torch.empty(self.local_size, device=default_device(device),
                                                   dtype=dtype or torch.get_default_dtype()))
        if not self.bias.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """b = 0 (a "meta" bias is first materialized on the default device)."""
        if self.bias.is_meta:
            self.bias = torch.nn.Parameter(torch.empty_like(self.bias, device=default_device()), requires_grad=self.bias.requires_grad)
        with torch.no_grad():
            self.bias.zero_()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias.is_meta:
            self.reset_parameters()
        if x.dim() < 1 or x.shape[-1] != self.local_size:
            raise ValueError(f"Bias expects the last input dim to be {self.local_size}, got shape {tuple(x.shape)}")
        return x + self.bias
