"""``MXFP8Tensor``: FP8 values with one E8M0 (power-of-two) scale per 32 elements (MXFP8BlockScaling).

    x[i, j] ~= data[i, j] * 2^(scale_inv[i, j // 32] - 127)        (scale_inv: uint8 biased exponents)

An MXFP8 GEMM reads both operands along K with their scales along K, so each GEMM layout is its own
quantization of the high-precision tensor (``ops.quantize_mxfp8``, math in plugin/catalog/mxfp8.py):

- ``data`` [M, K] with blocks of 32 along K, for the GEMMs that contract over K (fprop, dgrad);
- ``data_t`` [K, M] with ``scale_inv_t``, blocks of 32 along M, for those that contract over M (wgrad
  reads x^T and dy^T; dgrad reads W^T). It is a second quantization of x, written by the same cast, and
  cannot be made from ``data`` (its blocks, and so its scales, differ).

The GEMMs run through ``ops.gemm_mxfp8``, which the reference backend emulates exactly: dequantize,
then a float32 GEMM.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.plugin import ops

from .float8_blockwise_tensor import Float8BlockwiseTensor

__all__ = ["MXFP8_BLOCK", "MXFP8Tensor"]

#: elements per MXFP8 block (TE's MXFP8_BLOCK_SCALING_SIZE)
MXFP8_BLOCK = 32


class MXFP8Tensor(Float8BlockwiseTensor):
    """MXFP8 data of a 2-D tensor: an FP8 operand of 1 x 32 blocks with uint8 E8M0 scales.

    A :class:`Float8BlockwiseTensor` with ``block = (1, 32)`` whose scales are E8M0 codes rather than
    float32 (see the module docstring), so the module layer saves, releases and routes it like the
    other block-scaled operands; ``_functions/gemm.py`` sends its GEMMs to ``ops.gemm_mxfp8``.

    Attributes:
        data: [M, K] FP8 values quantized along K (None when only ``data_t`` is kept).
        scale_inv: uint8 [M, K / 32], the biased exponents s of the decode scales 2^(s - 127).
        data_t: [K, M] FP8 values quantized along M, or None.
        scale_inv_t: uint8 [K, M / 32], or None.

    Example:
        >>> import torch
        >>> from transformer_engine.plugin import ops
        >>> x = torch.full((32, 32), 3.0)
        >>> t = MXFP8Tensor(*ops.quantize_mxfp8(x, torch.float8_e4m3fn, True, True))
        >>> int(t.scale_inv[0, 0]) - 127, torch.equal(t.dequantize(torch.float32), x)
        (-7, True)
    """

    __slots__ = ()

    def __init__(self, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor], data_t: Optional[torch.Tensor] = None,
                 scale_inv_t: Optional[torch.Tensor] = None):
        super().__init__(data, scale_inv, data_t, scale_inv_t, block=(1, MXFP8_BLOCK))

    def __repr__(self) -> str:
        return (f"MXFP8Tensor(data={self.data!r}, scale_inv={self.scale_inv!r}, data_t={self.data_t!r}, "
                f"scale_inv_t={self.scale_inv_t!r})")

    def to_saved(self):
        """(tensors, rebuild): what ``save_for_backward`` stores and the callable that makes this operand again."""
        return (self.data, self.scale_inv, self.data_t, self.scale_inv_t), MXFP8Tensor

    def _transposed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(data_t, scale_inv_t).

        Raises:
            RuntimeError: there is no column-wise copy (it is a quantization of x^T, which needs x).
        """
        if self.data_t is None:
            raise RuntimeError(
                "this MXFP8 tensor has no column-wise copy: quantize it with columnwise=True (blocks of 32 along "
                "the first dim cannot be made from the row-wise copy)"
            )
        return self.data_t, self.scale_inv_t

    def with_transpose(self) -> "MXFP8Tensor":
        """This tensor, which must already carry its column-wise copy."""
        self._transposed()
        return self

    def transpose_only(self) -> "MXFP8Tensor":
        """The same tensor keeping only the column-wise copy (what wgrad and dgrad read)."""
        return MXFP8Tensor(None, None, *self._transposed())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = data * 2^(scale_inv - 127) per block, in float32, cast to ``dtype`` (from ``data_t`` when it is all there is)."""
        if self.data is None:
            return ops.dequantize_mxfp8(self.data_t, self.scale_inv_t, dtype).t()
        return ops.dequantize_mxfp8(self.data, self.scale_inv, dtype)
