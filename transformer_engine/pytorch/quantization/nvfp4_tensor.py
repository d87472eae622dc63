"""``NVFP4Tensor``: E2M1 values, one E4M3 scale per 16 elements and a float32 amax per copy (NVFP4BlockScaling).

    x[i, j] ~= e2m1(data)[i, j] * e4m3(scale_inv[i, j // 16]) * amax / (448 * 6)

Two E2M1 values share a byte, so ``data`` is [M, K / 2] for a tensor of logical shape [M, K] (math and
layout in plugin/catalog/nvfp4.py). An NVFP4 GEMM reads both operands along K, so each GEMM layout is its
own quantization of the high-precision tensor (``ops.quantize_nvfp4``), each with its own amax:

- ``data`` [M, K / 2] with blocks of 16 along K (fprop, dgrad), and ``amax``;
- ``data_t`` [K, M / 2] with blocks of 16 along M (wgrad reads x^T and dy^T, dgrad W^T), ``amax_t``.
  For inputs and gradients it is quantized after the random Hadamard transform of x^T along M
  (``rht_t``): both wgrad operands carry the same orthogonal transform along the GEMM's K, which the
  product cancels. Weights use 16 x 16 tiles (``block`` (16, 16)) and no transform.

Under 4over6 the global scale's E4M3 bound may be 256 instead of 448 (``e4m3_max``, both copies): it enters
the decode, x ~= e2m1 * e4m3 * amax / (6 * e4m3_max), so the tensor carries it to the GEMM and dequantize.

The GEMMs run through ``ops.gemm_nvfp4``, which the reference backend emulates exactly: dequantize,
then a float32 GEMM.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch

from transformer_engine.plugin import ops

from .float8_blockwise_tensor import Block, Float8BlockwiseTensor

__all__ = ["NVFP4_BLOCK", "NVFP4Tensor"]

#: elements per NVFP4 block (TE's NVFP4_BLOCK_SCALING_SIZE)
NVFP4_BLOCK = 16


class NVFP4Tensor(Float8BlockwiseTensor):
    """NVFP4 data of a 2-D tensor: an operand of 1 x 16 (or 16 x 16) blocks with E4M3 scales and an amax per copy.

    A :class:`Float8BlockwiseTensor` whose values are packed E2M1 codes and whose copies each carry
    their float32 amax (see the module docstring), so the module layer saves, releases and routes it
    like the other block-scaled operands; ``_functions/gemm.py`` sends its GEMMs to ``ops.gemm_nvfp4``.

    Attributes:
        data: uint8 [M, K / 2] packed E2M1 codes quantized along K (None when only ``data_t`` is kept).
        scale_inv: uint8 [M, K / 16], E4M3 bit patterns of the block decode scales.
        amax: float32 [1], the amax of what ``data`` quantizes.
        data_t, scale_inv_t, amax_t: the same for x^T ([K, M / 2], [K, M / 16]), or None.
        rht_t: ``data_t`` quantizes the random Hadamard transform of x^T (its dequantized values are
            those of the transformed tensor; a GEMM against another transformed copy is exact).
        block: (1, 16), or (16, 16) for 2-D tiles (weights).
        e4m3_max: the global scale's E4M3 bound of both copies, 448 (or 256 under 4over6).

    Example:
        >>> import torch
        >>> x = torch.full((16, 32), 3.0)
        >>> t = NVFP4Tensor(*ops.quantize_nvfp4(x, True, False, False, False, False, None))
        >>> t.shape, torch.equal(t.dequantize(torch.float32), x)
        (torch.Size([16, 32]), True)
    """

    __slots__ = ("amax", "amax_t", "rht_t", "e4m3_max")

    def __init__(self, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                 data_t: Optional[torch.Tensor] = None, scale_inv_t: Optional[torch.Tensor] = None,
                 amax_t: Optional[torch.Tensor] = None, *, rht_t: bool = False, block: Block = (1, NVFP4_BLOCK),
                 e4m3_max: int = 448):
        super().__init__(data, scale_inv, data_t, scale_inv_t, block=block)
        if (data is not None and amax is None) or (data_t is not None and amax_t is None):
            raise ValueError("every copy of an NVFP4Tensor needs its amax")
        self.amax, self.amax_t, self.rht_t, self.e4m3_max = amax, amax_t, rht_t, e4m3_max

    def __repr__(self) -> str:
        return (f"NVFP4Tensor(block={self.block}, rht_t={self.rht_t}, e4m3_max={self.e4m3_max}, data={self.data!r}, "
                f"scale_inv={self.scale_inv!r}, amax={self.amax!r}, data_t={self.data_t!r}, scale_inv_t={self.scale_inv_t!r}, "
                f"amax_t={self.amax_t!r})")

    @property
    def fp8_dtype(self) -> torch.dtype:
        """None: the values are E2M1 codes packed two a byte, not an FP8 dtype."""
        return None

    @property
    def shape(self) -> torch.Size:
        """The logical shape [M, K] (``data`` holds K / 2 bytes a row)."""
        if self.data is not None:
            return torch.Size((self.data.shape[0], 2 * self.data.shape[1]))
        return torch.Size((2 * self.data_t.shape[1], self.data_t.shape[0]))

    def to_saved(self):
        """(tensors, rebuild): what ``save_for_backward`` stores and the callable that makes this operand again."""
        tensors = (self.data, self.scale_inv, self.amax, self.data_t, self.scale_inv_t, self.amax_t)
        return tensors, partial(NVFP4Tensor, rht_t=self.rht_t, block=self.block, e4m3_max=self.e4m3_max)

    def _transposed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(data_t, scale_inv_t).

        Raises:
            RuntimeError: there is no column-wise copy (a quantization of x^T, which needs x).
        """
        if self.data_t is None:
            raise RuntimeError(
                "this NVFP4 tensor has no column-wise copy: quantize it with columnwise=True (blocks of 16 along "
                "the first dim cannot be made from the packed row-wise copy)"
            )
        return self.data_t, self.scale_inv_t

    def nvfp4_operand(self, transposed: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(data, scale_inv, amax) of t, or of t^T when ``transposed``, quantized along its rows."""
        if transposed:
            return (*self._transposed(), self.amax_t)
        if self.data is None:
            raise RuntimeError("this NVFP4 tensor keeps only its column-wise copy (it was saved for wgrad)")
        return self.data, self.scale_inv, self.amax

    def with_transpose(self) -> "NVFP4Tensor":
        """This tensor, which must already carry its column-wise copy."""
        self._transposed()
        return self

    def transpose_only(self) -> "NVFP4Tensor":
        """The same tensor keeping only the column-wise copy (what wgrad and dgrad read)."""
        return NVFP4Tensor(None, None, None, *self._transposed(), self.amax_t, rht_t=self.rht_t, block=self.block,
                           e4m3_max=self.e4m3_max)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = e2m1(data) * e4m3(scale_inv) * amax / (6 * e4m3_max) per block, in float32, cast to ``dtype``.

        Raises:
            RuntimeError: only a Hadamard-transformed column-wise copy is left (it holds RHT(x^T), not x^T).
        """
        if self.data is not None:
            return ops.dequantize_nvfp4(self.data, self.scale_inv, self.amax, out_dtype=dtype, e4m3_max=self.e4m3_max)
        if self.rht_t:
            raise RuntimeError("this NVFP4 tensor keeps only its Hadamard-transformed column-wise copy, which is not x^T")
        return ops.dequantize_nvfp4(self.data_t, self.scale_inv_t, self.amax_t, out_dtype=dtype, e4m3_max=self.e4m3_max).t()
