"""What TE's two block-scaled public tensors share: a row-wise and a column-wise FP8 copy, each with its own scales.

A tensor of any rank is quantized as its matrix [M, K] = [prod(leading dims), last dim]: the row-wise copy
has its blocks along K, the column-wise copy (what GEMMs that contract over M read) its blocks along M.
The subclasses (``Float8BlockwiseQTensor``, ``MXFP8Tensor``, ``NVFP4Tensor``) keep the buffers ``_rowwise_data``,
``_rowwise_scale_inv``, ``_columnwise_data``, ``_columnwise_scale_inv`` (the data as uint8 bytes, as NVIDIA TE
stores them, read through views in the FP8 dtype: :meth:`BlockScaledTensor._values`), NVFP4 also an amax per copy
(``_amax_rowwise``, ``_amax_columnwise``); this base gives them the usage bookkeeping, views that keep the last
dimension (which keep every block), byte copies between tensors of one layout and the in-place write of a new
quantization.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .float8_tensor import _bytes, _values, _write
from .quantized_tensor import QuantizedTensor

__all__ = ["BlockScaledTensor", "write_copies"]

_BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class BlockScaledTensor(QuantizedTensor):
    """Base of the block-scaled public tensors (see the module docstring).

    A subclass gives ``_layout`` (the attributes besides the buffers and the element format that a byte copy
    must match), ``_columnwise_shape(shape)`` (the column-wise data's shape for a logical shape),
    ``_with_buffers(shape, data, data_t)`` (a tensor of its class over other data with these scales) and,
    where a missing copy can be made from the other, ``_make_columnwise()``; where they differ from FP8's,
    ``_rowwise_attrs`` / ``_columnwise_attrs`` (each copy's buffers, the data first), ``_format_attr`` (the
    attribute naming the element format) and ``_rowwise_shape(shape)`` (the row-wise data's shape).
    """

    _layout: Tuple[str, ...] = ()
    _rowwise_attrs: Tuple[str, ...] = ("_rowwise_data", "_rowwise_scale_inv")
    _columnwise_attrs: Tuple[str, ...] = ("_columnwise_data", "_columnwise_scale_inv")
    _format_attr = "_fp8_dtype"

    @classmethod
    def _rowwise_shape(cls, shape: torch.Size) -> torch.Size:
        return shape

    @classmethod
    def _columnwise_shape(cls, shape: torch.Size) -> torch.Size:
        raise NotImplementedError

    def _with_buffers(self, shape: torch.Size, data: Optional[torch.Tensor], data_t: Optional[torch.Tensor]) -> BlockScaledTensor:
        raise NotImplementedError

    def _make_columnwise(self) -> None:
        """Write the column-wise copy from the row-wise one, or raise RuntimeError saying why it cannot be."""
        raise RuntimeError(f"the column-wise copy of a {type(self).__name__} is a quantization of its own (blocks along the "
                           "first dims); it cannot be made from the row-wise quantized values: quantize with columnwise=True")

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self._rowwise_data is not None, "columnwise": self._columnwise_data is not None}

    @classmethod
    def _buffer_keywords(cls) -> Dict[str, str]:
        """Each copy's buffers by attribute, the constructor keyword being the attribute's name without its underscore."""
        return {attr: attr[1:] for attr in cls._rowwise_attrs + cls._columnwise_attrs}

    def _values(self, buffer: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A stored data buffer viewed as the FP8 values of this tensor's dtype."""
        return _values(buffer, self._fp8_dtype)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop either copy, or make the column-wise one where the subclass can (``_make_columnwise``).

        Raises:
            RuntimeError: a copy is asked for that cannot be made from the FP8 values held, or the tensor
                would be left with no data.
        """
        rowwise = self._rowwise_data is not None if rowwise_usage is None else rowwise_usage
        columnwise = self._columnwise_data is not None if columnwise_usage is None else columnwise_usage
        name = type(self).__name__
        if not (rowwise or columnwise):
            raise RuntimeError(f"update_usage(rowwise_usage=False, columnwise_usage=False) would leave the {name} without data")
        if rowwise and self._rowwise_data is None:
            raise RuntimeError(f"cannot make the row-wise data of a {name} that only holds its column-wise copy")
        if columnwise and self._columnwise_data is None:
            self._make_columnwise()
        for kept, keys in ((rowwise, self._rowwise_attrs), (columnwise, self._columnwise_attrs)):
            if not kept:
                for key in keys:
                    setattr(self, key, None)

    def _adopt(self, other: BlockScaledTensor) -> None:
        for key in self._rowwise_attrs + self._columnwise_attrs + (self._format_attr,) + self._layout:
            setattr(self, key, getattr(other, key))
        self._quantizer = None if other._quantizer is None else other._quantizer.copy()

    def _reshaped(self, shape: tuple, method: str) -> BlockScaledTensor:
        """The same FP8 values and scales with another shape whose last dimension is unchanged (the blocks run
        over the matrix [prod(leading dims), last dim], which such a shape keeps).

        Raises:
            NotImplementedError: the last dimension would change.
        """
        logical = getattr(torch.empty(self.shape, device="meta"), method)(shape).shape
        if logical[-1:] != self.shape[-1:]:
            raise NotImplementedError(
                f"a {type(self).__name__} of shape {tuple(self.shape)} cannot take the shape {tuple(logical)}: its blocks run "
                "along the last dimension, which must stay the same (dequantize first)"
            )
        data = None if self._rowwise_data is None else getattr(self._rowwise_data, method)(self._rowwise_shape(logical))
        data_t = None if self._columnwise_data is None else getattr(self._columnwise_data, method)(self._columnwise_shape(logical))
        return self._with_buffers(logical, data, data_t)

    def _same_layout(self, src: BlockScaledTensor) -> bool:
        """True when src's bytes can be copied into self as they are: shape, FP8 dtype and layout agree, and src
        holds every copy self keeps (else self = Q(src) re-quantizes)."""
        held = all(not used or src.get_usages()[k] for k, used in self.get_usages().items())
        return (self.shape == src.shape and getattr(self, self._format_attr) == getattr(src, self._format_attr) and held
                and all(getattr(self, key) == getattr(src, key) for key in self._layout))

    def _copy_bytes(self, src: BlockScaledTensor) -> BlockScaledTensor:
        """self.copy_(src) of one layout: src's bytes, scales (and amaxes) into self's buffers, the copies self holds (a
        checkpoint loads bit for bit)."""
        held = self.get_usages()
        for usage, keys in (("rowwise", self._rowwise_attrs), ("columnwise", self._columnwise_attrs)):
            if held[usage]:
                for key in keys:
                    setattr(self, key, _write(getattr(self, key), getattr(src, key).detach().to(self.device)))
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten.copy_.default and isinstance(args[0], cls) and type(args[1]) is type(args[0])
                and args[0]._same_layout(args[1])):
            return args[0]._copy_bytes(args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)


def write_copies(dst: BlockScaledTensor, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor],
                 data_t: Optional[torch.Tensor], scale_inv_t: Optional[torch.Tensor]) -> None:
    """Store a new quantization in ``dst`` (FP8 values stored as their bytes): each buffer written into dst's memory
    where it fits (views of dst see the update), a copy given as None dropped."""
    for key, new in zip(_BUFFERS, (_bytes(data), scale_inv, _bytes(data_t), scale_inv_t)):
        setattr(dst, key, _write(getattr(dst, key), new))
