"""``Float8BlockwiseTensor``: FP8 values with one float32 scale per tile (Float8BlockScaling).

    x[i, j] ~= data[i, j] * scale_inv[i // block[0], j // block[1]]

Tiles are 1 x 128 ("1-D", activations and gradients) or 128 x 128 ("2-D", weights). A block-scaled
GEMM reads both operands along K with their scales along K, so each GEMM layout is its own copy:

- ``data`` [M, K] quantized in ``block`` tiles, for the GEMMs that contract over K (fprop, dgrad);
- ``data_t`` [K, M] with ``scale_inv_t`` for those that contract over M (wgrad reads x^T and dy^T).
  For 1-D tiles it is a second quantization of x^T (its blocks run over 128 rows of x, with their
  own scales), written by the same cast (``ops.cast_transpose_blockwise``); for 2-D tiles it is the
  exact transpose of ``data`` (a 128 x 128 tile transposes into one), made when needed.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch

from transformer_engine.plugin import ops

from .float8_tensor import Float8Tensor

__all__ = ["Float8BlockwiseTensor"]

Block = Tuple[int, int]


class Float8BlockwiseTensor(Float8Tensor):
    """Block-scaled FP8 data of a 2-D tensor; an FP8 operand like :class:`Float8Tensor` (see the module docstring).

    Attributes:
        data: [M, K] FP8 values (None when only ``data_t`` is kept).
        scale_inv: float32 [ceil(M / block[0]), ceil(K / block[1])], any strides.
        data_t: [K, M] FP8 values quantized along M, or None.
        scale_inv_t: float32 scales of ``data_t``'s tiles (``block_t``), or None.
        block: the (rows, cols) tile of ``data``: (1, B) or (B, B).

    Raises:
        ValueError: neither ``data`` nor ``data_t`` is given, or a copy comes without its scales.
    """

    __slots__ = ("scale_inv_t", "block")

    def __init__(self, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor], data_t: Optional[torch.Tensor] = None,
                 scale_inv_t: Optional[torch.Tensor] = None, *, block: Block):
        super().__init__(data, scale_inv, data_t)
        if (data is not None and scale_inv is None) or (data_t is not None and scale_inv_t is None):
            raise ValueError("every FP8 copy of a Float8BlockwiseTensor needs its scale_inv")
        self.scale_inv_t = scale_inv_t
        self.block = tuple(block)

    def __repr__(self) -> str:
        return (f"Float8BlockwiseTensor(block={self.block}, data={self.data!r}, scale_inv={self.scale_inv!r}, "
                f"data_t={self.data_t!r}, scale_inv_t={self.scale_inv_t!r})")

    @property
    def is_2d_block(self) -> bool:
        """True for square tiles, whose transposed copy is the plain transpose of ``data``."""
        return self.block[0] == self.block[1]

    @property
    def block_t(self) -> Block:
        """The tile of ``data_t``: (1, B) for 1-D tiles (quantized along M), (B, B) for 2-D."""
        return self.block if self.is_2d_block else (1, self.block[1])

    def to_saved(self):
        """(tensors, rebuild): what ``save_for_backward`` stores and the callable that makes this operand again."""
        return (self.data, self.scale_inv, self.data_t, self.scale_inv_t), partial(Float8BlockwiseTensor, block=self.block)

    def _transposed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(data_t, scale_inv_t), transposing ``data`` for 2-D tiles when they are missing.

        Raises:
            RuntimeError: 1-D tiles without ``data_t`` (it is a quantization of x^T, which needs x).
        """
        if self.data_t is not None:
            return self.data_t, self.scale_inv_t
        if not self.is_2d_block:
            raise RuntimeError(
                "this 1-D block-scaled tensor has no column-wise copy: quantize it with columnwise=True "
                "(a 1 x 128 copy of x^T cannot be made from the row-wise one)"
            )
        return ops.fp8_transpose(self.data), self.scale_inv.t()

    def gemm_operand(self, transposed: bool) -> Tuple[torch.Tensor, torch.Tensor, Block]:
        """(data, scale_inv, block) of t, or of t^T when ``transposed``, row-major and quantized along its rows."""
        if transposed:
            data_t, scale_inv_t = self._transposed()
            return data_t, scale_inv_t, self.block_t
        if self.data is None:
            raise RuntimeError("this block-scaled tensor keeps only its column-wise copy (it was saved for wgrad)")
        return self.data, self.scale_inv, self.block

    def with_transpose(self) -> "Float8BlockwiseTensor":
        """This tensor with its column-wise copy (2-D tiles: the transpose of ``data``)."""
        if self.data_t is not None:
            return self
        return Float8BlockwiseTensor(self.data, self.scale_inv, *self._transposed(), block=self.block)

    def transpose_only(self) -> "Float8BlockwiseTensor":
        """The same tensor keeping only the column-wise copy (what wgrad and dgrad read)."""
        return Float8BlockwiseTensor(None, None, *self._transposed(), block=self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x[i, j] = data[i, j] * scale_inv[tile of (i, j)] in float32, cast to ``dtype``."""
        if self.data is None:
            rows, cols = self.block_t
            return ops.dequantize_blockwise(self.data_t, self.scale_inv_t, block_rows=rows, block_cols=cols, out_dtype=dtype).t()
        return ops.dequantize_blockwise(self.data, self.scale_inv, block_rows=self.block[0], block_cols=self.block[1], out_dtype=dtype)
