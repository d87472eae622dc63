"""``Float8Tensor``: the FP8 values of one tensor together with the scale that decodes them.

    x ~= data * scale_inv      (data in torch.float8_e4m3fn or torch.float8_e5m2, scale_inv float32)

It is a plain container, not a ``torch.Tensor`` subclass: modules pass it to the catalog's FP8 ops
(``gemm`` takes ``data`` and ``scale_inv`` of each operand) and keep it for backward instead of the
high-precision tensor, which is where FP8 saves activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformer_engine.plugin import ops

__all__ = ["Float8Tensor"]


@dataclass(frozen=True)
class Float8Tensor:
    """Per-tensor-scaled FP8 data.

    Attributes:
        data: FP8 values with the tensor's logical shape.
        scale_inv: 0-d (or one-element) float32 tensor, 1 / scale.

    Example:
        >>> import torch
        >>> from transformer_engine.plugin import ops
        >>> q, scale_inv, _ = ops.quantize(torch.tensor([1.0, -2.0]), torch.tensor(4.0), torch.float8_e4m3fn)
        >>> Float8Tensor(q, scale_inv).dequantize(torch.float32)
        tensor([ 1., -2.])
    """

    data: torch.Tensor
    scale_inv: torch.Tensor

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 dtype of ``data``."""
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """The logical shape."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """The device of ``data``."""
        return self.data.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = data * scale_inv, computed in float32 and cast to ``dtype``."""
        return ops.dequantize(self.data, self.scale_inv, dtype)
