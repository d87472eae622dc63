"""``MXFP8Tensor`` and ``MXFP8Quantizer``: TE's public MXFP8 tensor (MXFP8BlockScaling), emulated where the hardware lacks it.

    x[i, j] ~= rowwise_data[i, j] * 2^(rowwise_scale_inv[i, j // 32] - 127)          (x as the matrix [M, K])
    x[i, j] ~= columnwise_data[i, j] * 2^(columnwise_scale_inv[i // 32, j] - 127)

One E8M0 scale (a uint8 biased exponent) per 32 consecutive elements, rounded up to a power of two
(``ops.quantize_mxfp8``, exact rule in plugin/catalog/mxfp8.py). A tensor of any rank is quantized as its
matrix [M, K] = [prod(leading dims), last dim], which needs K % 32 == 0 (row-wise) and M % 32 == 0
(column-wise). The two copies are two quantizations of x, one with blocks along K (what GEMMs that
contract over K read), one with blocks along M (the GEMMs that contract over M): neither can be made
from the other's FP8 values.

Layout, as NVIDIA TE's: both data buffers have x's shape; the scales are compact, ``[M, K / 32]`` and
``[M / 32, K]`` (NVIDIA TE pads them to multiples of 128 x 4 for cuBLAS; the values are the same).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from transformer_engine.plugin import ops

from ..quantization.mxfp8_tensor import MXFP8_BLOCK
from ..quantization.mxfp8_tensor import MXFP8Tensor as MXFP8Operand
from ..quantization.quantizer import MXFP8Quantizer as ModuleMXFP8Quantizer
from ._block_scaled import BlockScaledTensor, write_copies
from .dtype import DType, fp8_torch_dtype
from .float8_tensor import FP8DType, _as_2d, _byte_buffer, _matrix_dims
from .quantized_tensor import QuantizedTensor, Quantizer, _default_device, check_high_precision

__all__ = ["MXFP8Quantizer", "MXFP8Tensor"]

_UNIT_SCALE = 127  # the E8M0 code of 2^0


def _scale_grid(shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
    """The shape of one copy's E8M0 scales: [M, K / 32] row-wise, [M / 32, K] column-wise ([M, K] the tensor's matrix)."""
    m, k = _matrix_dims(shape)
    return (m // MXFP8_BLOCK, k) if columnwise else (m, k // MXFP8_BLOCK)


class MXFP8Quantizer(Quantizer):
    """MXFP8 casts: one power-of-two E8M0 scale per 32 elements (see the module docstring).

    Args:
        fp8_dtype: ``DType.kFloat8E4M3`` (MXFP8BlockScaling's) or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        rowwise, columnwise: usages (see :class:`Quantizer`): the copies each cast writes.

    Example:
        >>> q = MXFP8Quantizer(DType.kFloat8E4M3)
        >>> x = q(torch.full((32, 64), 3.0))
        >>> x._rowwise_scale_inv.shape, x._columnwise_scale_inv.shape, x.dequantize().eq(3).all().item()
        (torch.Size([32, 2]), torch.Size([1, 64]), True)
    """

    def __init__(self, fp8_dtype: FP8DType, *, rowwise: bool = True, columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_torch_dtype(fp8_dtype)  # validates
        self.dtype = DType.cast(fp8_dtype)

    def copy(self) -> MXFP8Quantizer:
        return MXFP8Quantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)

    def module_quantizer(self) -> ModuleMXFP8Quantizer:
        """The quantizer the modules cast with under a ``CustomRecipe`` that returns this one (the same rule)."""
        return ModuleMXFP8Quantizer(fp8_torch_dtype(self.dtype))

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` has the shape MXFP8 needs: 2 or more dims, the last and the product of the others multiples of 32."""
        return inp.dim() >= 2 and inp.shape[-1] % MXFP8_BLOCK == 0 and math.prod(inp.shape[:-1]) % MXFP8_BLOCK == 0

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool):
        """(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv) of x, the asked copies only, in
        this tensor's layout (the catalog writes the column-wise copy transposed: it is transposed back here).

        Raises:
            ValueError: neither usage is asked for, or a dim that is not a multiple of 32 (the op names it).
        """
        if not (rowwise or columnwise):
            raise ValueError("MXFP8Quantizer has rowwise=False and columnwise=False; enable at least one usage with set_usage")
        x2d = _as_2d(x)
        data, scale_inv, data_t, scale_inv_t = ops.quantize_mxfp8(x2d, fp8_torch_dtype(self.dtype), rowwise=rowwise, columnwise=columnwise)
        data = None if data is None else data.view(x.shape)
        data_c = None if data_t is None else data_t.t().contiguous().view(x.shape)
        scale_c = None if scale_inv_t is None else scale_inv_t.t().contiguous()
        return data, scale_inv, data_c, scale_c

    def quantize_impl(self, tensor: torch.Tensor) -> MXFP8Tensor:
        check_high_precision(tensor)
        data, scale_inv, data_c, scale_c = self._cast(tensor.detach(), self.rowwise_usage, self.columnwise_usage)
        return MXFP8Tensor(shape=tensor.shape, dtype=tensor.dtype, rowwise_data=data, rowwise_scale_inv=scale_inv,
                           columnwise_data=data_c, columnwise_scale_inv=scale_c, fp8_dtype=self.dtype, quantizer=self,
                           device=tensor.device)

    def _tensor_type(self) -> type:
        return MXFP8Tensor

    def _update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> MXFP8Tensor:
        """dst = Q(src), written into dst's buffers (the usages dst holds)."""
        usages = dst.get_usages()
        write_copies(dst, *self._cast(src.detach().to(device=dst.device), usages["rowwise"], usages["columnwise"]))
        dst._fp8_dtype = self.dtype
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> MXFP8Tensor:
        """An MXFP8Tensor of ``shape`` with uninitialized values and unit scales (E8M0 code 127).

        Raises:
            ValueError: a shape MXFP8 cannot hold (see :meth:`is_quantizable`).
        """
        device, shape = _default_device(device), torch.Size(shape)
        units = lambda columnwise: torch.full(_scale_grid(shape, columnwise), _UNIT_SCALE, dtype=torch.uint8, device=device)  # noqa: E731
        data = scale_inv = data_c = scale_c = None
        if self.rowwise_usage:
            data, scale_inv = torch.empty(shape, dtype=torch.uint8, device=device), units(columnwise=False)
        if self.columnwise_usage:
            data_c, scale_c = torch.empty(shape, dtype=torch.uint8, device=device), units(columnwise=True)
        return MXFP8Tensor(shape=shape, dtype=dtype, rowwise_data=data, rowwise_scale_inv=scale_inv, columnwise_data=data_c,
                           columnwise_scale_inv=scale_c, fp8_dtype=self.dtype, quantizer=self, requires_grad=requires_grad,
                           device=device)


class MXFP8Tensor(BlockScaledTensor):
    """A tensor with MXFP8 data that presents its nominal ``dtype`` (see the module docstring).

    Args:
        shape: the logical shape. dtype: the nominal (high-precision) dtype.
        rowwise_data: FP8 values of ``shape`` in blocks along the last dim (uint8 bytes, stored as given, or the torch
            float8 dtype), or None.
        rowwise_scale_inv: uint8 [M, K / 32], the E8M0 codes of its blocks.
        columnwise_data: FP8 values of ``shape`` in blocks along the leading dims, or None.
        columnwise_scale_inv: uint8 [M / 32, K].
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        quantizer: the quantizer for in-place updates (a copy is kept), or None.
        requires_grad, device: as for any tensor (device defaults to the data's).

    Raises:
        ValueError: no data, a copy without its scales, buffers or scales whose shapes do not fit ``shape``, or
            a dim a copy's blocks do not divide. TypeError: a buffer that is neither uint8 nor the float8 dtype.
    """

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, rowwise_data: Optional[torch.Tensor],
                rowwise_scale_inv: Optional[torch.Tensor], columnwise_data: Optional[torch.Tensor] = None,
                columnwise_scale_inv: Optional[torch.Tensor] = None, fp8_dtype: FP8DType, quantizer: Optional[Quantizer] = None,
                requires_grad: bool = False, device=None, stride: Optional[Iterable[int]] = None):
        torch_fp8 = fp8_torch_dtype(fp8_dtype)
        data, data_c = _byte_buffer(rowwise_data, torch_fp8, "rowwise_data"), _byte_buffer(columnwise_data, torch_fp8, "columnwise_data")
        shape = torch.Size(shape)
        _check_copies(shape, data, rowwise_scale_inv, data_c, columnwise_scale_inv)
        device = (data if data is not None else data_c).device if device is None else torch.device(device)
        instance = super().__new__(cls, shape, dtype, requires_grad=requires_grad, device=device, stride=stride)
        instance._rowwise_data, instance._rowwise_scale_inv = data, rowwise_scale_inv
        instance._columnwise_data, instance._columnwise_scale_inv = data_c, columnwise_scale_inv
        instance._fp8_dtype = DType.cast(fp8_dtype)
        instance._quantizer = None if quantizer is None else quantizer.copy()
        return instance

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"MXFP8Tensor(fp8_dtype={self._fp8_dtype.name}, data={self._repr_values()})"

    def get_metadata(self) -> Dict[str, Any]:
        return {"rowwise_data": self._rowwise_data, "rowwise_scale_inv": self._rowwise_scale_inv,
                "columnwise_data": self._columnwise_data, "columnwise_scale_inv": self._columnwise_scale_inv,
                "fp8_dtype": self._fp8_dtype, "quantizer": self._quantizer}

    def _get_quantizer(self) -> Quantizer:
        if self._quantizer is None:
            self._quantizer = MXFP8Quantizer(self._fp8_dtype, rowwise=self._rowwise_data is not None,
                                             columnwise=self._columnwise_data is not None)
        return self._quantizer

    @classmethod
    def _columnwise_shape(cls, shape: torch.Size) -> torch.Size:
        return shape

    def _with_buffers(self, shape: torch.Size, data: Optional[torch.Tensor], data_t: Optional[torch.Tensor]) -> MXFP8Tensor:
        return MXFP8Tensor(shape=shape, dtype=self.dtype, rowwise_data=data, rowwise_scale_inv=self._rowwise_scale_inv,
                           columnwise_data=data_t, columnwise_scale_inv=self._columnwise_scale_inv, fp8_dtype=self._fp8_dtype,
                           quantizer=self._quantizer, device=self.device)

    def operand(self) -> MXFP8Operand:
        """The GEMM operand the modules read: the row-wise copy as ``[M, K]``, the column-wise copy as its transposed
        view ``[K, M]`` with scales ``[K, M / 32]`` (no copy: the strides ``ops.quantize_mxfp8`` gives its own x^T copy,
        so a GEMM reads both alike)."""
        data = None if self._rowwise_data is None else _as_2d(self._values(self._rowwise_data))
        data_t = scale_t = None
        if self._columnwise_data is not None:
            data_t, scale_t = _as_2d(self._values(self._columnwise_data)).t(), self._columnwise_scale_inv.t()
        return MXFP8Operand(data, self._rowwise_scale_inv, data_t, scale_t)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = data * 2^(scale - 127) per block (``ops.dequantize_mxfp8``), from the row-wise copy when held, in ``dtype``."""
        return self.operand().dequantize(dtype).reshape(self.shape)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle the FP8 buffers, their scales, the fp8 dtype, nominal dtype and shape (not the quantizer)."""
        return (_make_mxfp8_tensor_in_reduce_ex, (self.shape, self.dtype, self._rowwise_data, self._rowwise_scale_inv,
                                                  self._columnwise_data, self._columnwise_scale_inv, self._fp8_dtype))


def _check_copies(shape: torch.Size, data, scale_inv, data_c, scale_c) -> None:
    """ValueError unless the given copies fit ``shape`` and each has the uint8 scales of its blocks."""
    if data is None and data_c is None:
        raise ValueError("an MXFP8Tensor needs rowwise_data, columnwise_data or both; got neither")
    m, k = _matrix_dims(shape)
    for name, values, scales, blocked, grid in (
        ("rowwise", data, scale_inv, ("last dim", k), _scale_grid(shape, columnwise=False)),
        ("columnwise", data_c, scale_c, ("product of the leading dims", m), _scale_grid(shape, columnwise=True)),
    ):
        if values is None:
            continue
        if blocked[1] % MXFP8_BLOCK:
            raise ValueError(f"an MXFP8Tensor of shape {tuple(shape)} cannot hold {name} data: its {blocked[0]} ({blocked[1]}) "
                             f"is not a multiple of {MXFP8_BLOCK}")
        if values.shape != shape:
            raise ValueError(f"{name}_data has shape {tuple(values.shape)}; an MXFP8Tensor of shape {tuple(shape)} needs {tuple(shape)}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != grid:
            got = f"{scales.dtype} {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(f"{name}_scale_inv must be uint8 E8M0 codes of shape {grid} (one per block of {MXFP8_BLOCK}), got {got}")


def _make_mxfp8_tensor_in_reduce_ex(shape, dtype, data, scale_inv, data_c, scale_c, fp8_dtype) -> MXFP8Tensor:
    """Rebuild a pickled MXFP8Tensor (``MXFP8Tensor.__reduce_ex__``)."""
    return MXFP8Tensor(shape=shape, dtype=dtype, rowwise_data=data, rowwise_scale_inv=scale_inv, columnwise_data=data_c,
                       columnwise_scale_inv=scale_c, fp8_dtype=fp8_dtype)


torch.serialization.add_safe_globals([MXFP8Tensor, _make_mxfp8_tensor_in_reduce_ex])
