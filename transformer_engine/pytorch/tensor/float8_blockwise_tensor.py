"""``Float8BlockwiseQTensor`` and ``Float8BlockQuantizer``: TE's public block-scaled FP8 tensor (Float8BlockScaling).

    x[i, j] ~= rowwise_data[i, j] * rowwise_scale_inv[i // b, j // 128]     (x as the matrix [M, K])

with b = 128 for 2-D tiles (128 x 128, weights) and b = 1 for 1-D tiles (1 x 128, activations and
gradients); each tile's scale = fp8_max / max(max|tile|, amax_epsilon), a power of two with
``force_pow_2_scales`` (the catalog's ``quantize_blockwise``). A tensor of any rank is quantized as its
matrix [prod(leading dims), last dim]. The column-wise copy is what GEMMs that contract over M read
(x^T, shape (K, *lead)): for 2-D tiles the exact transpose of the row-wise values and scales (a 128 x 128
tile transposes into one); for 1-D tiles a second quantization of x^T along M (its own scales), which
only the high-precision tensor can give.

Scales are kept compact, [ceil(M / b), ceil(K / 128)] (column-wise: [ceil(K / b'), ceil(M / 128)]), where
NVIDIA TE pads and transposes them into cuBLAS's layout: the values are the same, the buffers' shapes
differ (code that reads ``_rowwise_scale_inv`` directly sees ours).

Data formats (``_data_format``, NVIDIA TE's ``Float8BlockScaleTensorFormat``): ``GEMM_READY`` as above;
``COMPACT`` (a 1 x 128 quantizer with ``all_gather_usage=True``, the layout TE all-gathers along the first
dims) keeps the column-wise copy untransposed: data of the tensor's own shape and scales [ceil(M / 128), K],
one per 128 x 1 block, the same values as the ``GEMM_READY`` copy. A GEMM reads a ``COMPACT`` tensor through
a transposed copy of that data (:meth:`Float8BlockwiseQTensor.operand`).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from transformer_engine.common.recipe import QParams

from ..quantization.float8_blockwise_tensor import Float8BlockwiseTensor as BlockOperand
from ..quantization.quantizer import Float8BlockQuantizer as ModuleBlockQuantizer
from .dtype import DType, fp8_torch_dtype
from ._block_scaled import BlockScaledTensor, write_copies
from .float8_tensor import FP8DType, _as_2d, _byte_buffer, _columnwise_shape, _matrix_dims, _transposed_bytes
from .quantized_tensor import QuantizedTensor, Quantizer, _default_device, check_high_precision

__all__ = ["Float8BlockQuantizer", "Float8BlockScaleTensorFormat", "Float8BlockwiseQTensor"]

_BLOCK_LEN = 128


class Float8BlockScaleTensorFormat(enum.Enum):
    """How a :class:`Float8BlockwiseQTensor` stores its column-wise copy (see the module docstring)."""

    GEMM_READY = 0
    COMPACT = 1


def _tile(is_2d: bool) -> Tuple[int, int]:
    """The (rows, cols) tile of the row-wise copy (the column-wise copy of 1-D tiles is also (1, 128))."""
    return (_BLOCK_LEN, _BLOCK_LEN) if is_2d else (1, _BLOCK_LEN)


def _scale_grid(shape: Iterable[int], is_2d: bool, columnwise: bool, compact: bool = False) -> Tuple[int, int]:
    """The shape of one copy's scales: [ceil(M / b), ceil(K / 128)] row-wise, [ceil(K / b), ceil(M / 128)]
    column-wise (b = 128 for 128 x 128 tiles, 1 for 1 x 128), with [M, K] the tensor's matrix; a ``compact``
    column-wise copy (1 x 128 tiles only) [ceil(M / 128), K]."""
    m, k = _matrix_dims(shape)
    if columnwise and compact:
        return (math.ceil(m / _BLOCK_LEN), k)
    rows = _tile(is_2d)[0]
    return (math.ceil(k / rows), math.ceil(m / _BLOCK_LEN)) if columnwise else (math.ceil(m / rows), math.ceil(k / _BLOCK_LEN))


def _columnwise_data_shape(shape: Iterable[int], compact: bool) -> torch.Size:
    """The column-wise data's shape: the tensor's own when ``compact``, else its last dimension first."""
    return torch.Size(shape) if compact else _columnwise_shape(shape)


def _transposed_copy(data: Optional[torch.Tensor], scale: Optional[torch.Tensor], shape: torch.Size, to_compact: bool):
    """The column-wise (data, scales) in the other format: the data's matrix transposed ([K, M] <-> [M, K], bytes
    copied) and the scales transposed ([K, ceil(M / 128)] <-> [ceil(M / 128), K])."""
    if data is None:
        return None, None
    m, k = _matrix_dims(shape)
    matrix = data.reshape(k, m) if to_compact else data.reshape(m, k)
    return matrix.t().contiguous().view(_columnwise_data_shape(shape, to_compact)), scale.t().contiguous()


class Float8BlockQuantizer(Quantizer):
    """Block-scaled FP8 casts: one scale per 1 x 128 (``block_scaling_dim=1``) or 128 x 128 (``2``) tile.

    Args:
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        rowwise, columnwise: usages (see :class:`Quantizer`).
        amax_epsilon: lower bound of each tile's amax (a finite float >= 0).
        force_pow_2_scales: round each scale down to a power of two (NVIDIA TE's default).
        block_scaling_dim: 1 or 2.
        all_gather_usage: the ``COMPACT`` data format (1 x 128 tiles only): the column-wise copy untransposed,
            as NVIDIA TE all-gathers it.

    Raises:
        ValueError: a bad block_scaling_dim, amax_epsilon or fp8_dtype, or all_gather_usage with 128 x 128 tiles.

    Example:
        >>> q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)
        >>> x = q(torch.ones(128, 256))
        >>> x._rowwise_scale_inv.shape, x.dequantize().eq(1).all().item()
        (torch.Size([1, 2]), True)
    """

    def __init__(self, fp8_dtype: FP8DType, *, rowwise: bool, columnwise: bool, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = True, block_scaling_dim: int = 2, all_gather_usage: bool = False) -> None:
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim={block_scaling_dim!r} must be 1 (1 x 128 tiles) or 2 (128 x 128 tiles)")
        if not isinstance(amax_epsilon, (int, float)) or isinstance(amax_epsilon, bool) or not 0.0 <= amax_epsilon < math.inf:
            raise ValueError(f"amax_epsilon={amax_epsilon!r} must be a finite float >= 0 "
                             "(the smallest amax a tile's scale is computed from)")
        if all_gather_usage and block_scaling_dim != 1:
            raise ValueError("Float8BlockQuantizer(all_gather_usage=True) takes block_scaling_dim=1: the compact format "
                             "applies to 1 x 128 tiles (as in NVIDIA TE; 128 x 128 tiles are GEMM-ready either way)")
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_torch_dtype(fp8_dtype)  # validates
        self.dtype = DType.cast(fp8_dtype)
        self.block_len = _BLOCK_LEN
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = block_scaling_dim
        self.all_gather_usage = bool(all_gather_usage)

    @property
    def data_format(self) -> Float8BlockScaleTensorFormat:
        """The format of the tensors this quantizer makes (``COMPACT`` with ``all_gather_usage``)."""
        return Float8BlockScaleTensorFormat.COMPACT if self.all_gather_usage else Float8BlockScaleTensorFormat.GEMM_READY

    def copy(self) -> Float8BlockQuantizer:
        return Float8BlockQuantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                    amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
                                    block_scaling_dim=self.block_scaling_dim, all_gather_usage=self.all_gather_usage)

    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
        """The shape of the scales of a tensor of ``shape`` (see :func:`_scale_grid`)."""
        return _scale_grid(shape, self.block_scaling_dim == 2, columnwise, compact=self.all_gather_usage)

    def get_columnwise_shape(self, shape: Iterable[int]) -> torch.Size:
        """The shape of the column-wise data of a tensor of ``shape``: its last dimension first (``COMPACT``: its own)."""
        return _columnwise_data_shape(shape, self.all_gather_usage)

    def module_quantizer(self) -> ModuleBlockQuantizer:
        """The quantizer the modules cast with under a ``CustomRecipe`` that returns this one (the same tiles and rule)."""
        qparams = QParams(power_2_scale=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        return ModuleBlockQuantizer(fp8_torch_dtype(self.dtype), self.block_scaling_dim, qparams)

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool):
        """(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv) of x, the asked copies only: the
        module quantizer's cast of the matrix [prod(lead), last] (one pass for both 1 x 128 copies, the transpose
        of the tiles for the column-wise 128 x 128 copy), shaped as this tensor's buffers.

        Raises:
            ValueError: neither usage is asked for.
        """
        if not (rowwise or columnwise):
            raise ValueError("Float8BlockQuantizer has rowwise=False and columnwise=False; enable at least one usage with set_usage")
        quantizer, x2d = self.module_quantizer(), _as_2d(x)
        operand = quantizer.quantize(x2d, columnwise=columnwise) if rowwise else quantizer.quantize_transposed(x2d)
        data = None if operand.data is None else operand.data.view(x.shape)
        data_t = None if operand.data_t is None else operand.data_t.view(_columnwise_shape(x.shape))
        return data, operand.scale_inv, data_t, operand.scale_inv_t

    def _cast_in_format(self, x: torch.Tensor, rowwise: bool, columnwise: bool, compact: bool):
        """:meth:`_cast`, the column-wise copy in the ``compact`` format when asked."""
        data, scale_inv, data_t, scale_inv_t = self._cast(x, rowwise, columnwise)
        if compact:
            data_t, scale_inv_t = _transposed_copy(data_t, scale_inv_t, x.shape, to_compact=True)
        return data, scale_inv, data_t, scale_inv_t

    def quantize_impl(self, tensor: torch.Tensor) -> Float8BlockwiseQTensor:
        check_high_precision(tensor)
        data, scale_inv, data_t, scale_inv_t = self._cast_in_format(tensor.detach(), self.rowwise_usage, self.columnwise_usage,
                                                                    self.all_gather_usage)
        return Float8BlockwiseQTensor(shape=tensor.shape, dtype=tensor.dtype, rowwise_data=data, rowwise_scale_inv=scale_inv,
                                      columnwise_data=data_t, columnwise_scale_inv=scale_inv_t, fp8_dtype=self.dtype,
                                      quantizer=self, is_2D_scaled=self.block_scaling_dim == 2, device=tensor.device,
                                      data_format=self.data_format)

    def _tensor_type(self) -> type:
        return Float8BlockwiseQTensor

    def _update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> Float8BlockwiseQTensor:
        """dst = Q(src), written into dst's buffers (the usages dst holds).

        Raises:
            ValueError: the tiles differ.
        """
        if dst._is_2D_scaled != (self.block_scaling_dim == 2):
            raise ValueError(f"this quantizer casts {self.block_scaling_dim}-D tiles; the tensor holds "
                             f"{2 if dst._is_2D_scaled else 1}-D tiles")
        usages = dst.get_usages()
        data, scale_inv, data_t, scale_inv_t = self._cast_in_format(src.detach().to(device=dst.device), usages["rowwise"],
                                                                    usages["columnwise"], dst._compact)
        write_copies(dst, data, scale_inv, data_t, scale_inv_t)
        dst._fp8_dtype = self.dtype
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> Float8BlockwiseQTensor:
        """A Float8BlockwiseQTensor of ``shape`` with uninitialized values and unit scales."""
        device, shape = _default_device(device), torch.Size(shape)
        ones = lambda s: torch.ones(s, dtype=torch.float32, device=device)  # noqa: E731
        data = scale_inv = data_t = scale_inv_t = None
        if self.rowwise_usage:
            data, scale_inv = torch.empty(shape, dtype=torch.uint8, device=device), ones(self.get_scale_shape(shape, columnwise=False))
        if self.columnwise_usage:
            data_t = torch.empty(self.get_columnwise_shape(shape), dtype=torch.uint8, device=device)
            scale_inv_t = ones(self.get_scale_shape(shape, columnwise=True))
        return Float8BlockwiseQTensor(shape=shape, dtype=dtype, rowwise_data=data, rowwise_scale_inv=scale_inv,
                                      columnwise_data=data_t, columnwise_scale_inv=scale_inv_t, fp8_dtype=self.dtype,
                                      quantizer=self, is_2D_scaled=self.block_scaling_dim == 2, requires_grad=requires_grad,
                                      device=device, data_format=self.data_format)


class Float8BlockwiseQTensor(BlockScaledTensor):
    """A tensor with block-scaled FP8 data that presents its nominal ``dtype`` (see the module docstring).

    Args:
        shape: the logical shape. dtype: the nominal (high-precision) dtype.
        rowwise_data: FP8 values of ``shape`` (uint8 bytes or the torch float8 dtype), or None.
        rowwise_scale_inv: float32 [ceil(M / b), ceil(K / 128)], one per tile of the row-wise data.
        columnwise_data: FP8 values of x^T, shape (K, *lead) (``COMPACT``: x's values of ``shape``), or None.
        columnwise_scale_inv: float32 scales of the column-wise tiles.
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        quantizer: the quantizer for in-place updates (a copy is kept), or None.
        is_2D_scaled: 128 x 128 tiles (True) or 1 x 128 tiles (False).
        requires_grad, device: as for any tensor (device defaults to the data's).
        data_format: ``Float8BlockScaleTensorFormat.GEMM_READY`` or ``COMPACT`` (1 x 128 tiles only).

    Raises:
        ValueError: no data, a copy without its scales, buffers or scales whose shapes do not fit ``shape``, a
            ``COMPACT`` tensor of 128 x 128 tiles.
        TypeError: a buffer that is neither uint8 nor the matching float8 dtype.
    """

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, rowwise_data: Optional[torch.Tensor],
                rowwise_scale_inv: Optional[torch.Tensor], columnwise_data: Optional[torch.Tensor] = None,
                columnwise_scale_inv: Optional[torch.Tensor] = None, fp8_dtype: FP8DType, quantizer: Optional[Quantizer] = None,
                is_2D_scaled: bool = True, requires_grad: bool = False, device=None, stride: Optional[Iterable[int]] = None,
                data_format: Float8BlockScaleTensorFormat = Float8BlockScaleTensorFormat.GEMM_READY):
        torch_fp8 = fp8_torch_dtype(fp8_dtype)
        data, data_t = _byte_buffer(rowwise_data, torch_fp8, "rowwise_data"), _byte_buffer(columnwise_data, torch_fp8, "columnwise_data")
        shape, data_format = torch.Size(shape), Float8BlockScaleTensorFormat(data_format)
        compact = data_format is Float8BlockScaleTensorFormat.COMPACT
        if compact and is_2D_scaled:
            raise ValueError("a COMPACT Float8BlockwiseQTensor holds 1 x 128 tiles (is_2D_scaled=False); 128 x 128 tiles are GEMM_READY")
        _check_blocks(shape, bool(is_2D_scaled), data, rowwise_scale_inv, data_t, columnwise_scale_inv, compact)
        device = (data if data is not None else data_t).device if device is None else torch.device(device)
        instance = super().__new__(cls, shape, dtype, requires_grad=requires_grad, device=device, stride=stride)
        instance._rowwise_data, instance._rowwise_scale_inv = data, rowwise_scale_inv
        instance._columnwise_data, instance._columnwise_scale_inv = data_t, columnwise_scale_inv
        instance._fp8_dtype = DType.cast(fp8_dtype)
        instance._is_2D_scaled = bool(is_2D_scaled)
        instance._data_format = data_format
        instance._quantizer = None if quantizer is None else quantizer.copy()
        return instance

    def __repr__(self, *, tensor_contents=None) -> str:
        tiles = "128x128" if self._is_2D_scaled else "1x128"
        return (f"Float8BlockwiseQTensor(fp8_dtype={self._fp8_dtype.name}, tiles={tiles}, data_format={self._data_format.name}, "
                f"data={self._repr_values()})")

    @property
    def _compact(self) -> bool:
        return self._data_format is Float8BlockScaleTensorFormat.COMPACT

    def get_metadata(self) -> Dict[str, Any]:
        return {"rowwise_data": self._rowwise_data, "rowwise_scale_inv": self._rowwise_scale_inv,
                "columnwise_data": self._columnwise_data, "columnwise_scale_inv": self._columnwise_scale_inv,
                "fp8_dtype": self._fp8_dtype, "quantizer": self._quantizer, "is_2D_scaled": self._is_2D_scaled,
                "data_format": self._data_format}

    def _get_quantizer(self) -> Quantizer:
        if self._quantizer is None:
            self._quantizer = Float8BlockQuantizer(self._fp8_dtype, rowwise=self._rowwise_data is not None,
                                                   columnwise=self._columnwise_data is not None,
                                                   block_scaling_dim=2 if self._is_2D_scaled else 1, all_gather_usage=self._compact)
        return self._quantizer

    @property
    def _block(self) -> Tuple[int, int]:
        """The (rows, cols) tile of the row-wise copy, as the modules' block quantizers name it."""
        return _tile(self._is_2D_scaled)

    def operand(self) -> BlockOperand:
        """The GEMM operand the modules read: the same buffers as a 2-D ``[M, K]`` block-scaled operand (a ``COMPACT``
        column-wise copy: its transpose, copied)."""
        data = None if self._rowwise_data is None else _as_2d(self._values(self._rowwise_data))
        data_t, scale_inv_t = self._columnwise_data, self._columnwise_scale_inv
        if self._compact:
            data_t, scale_inv_t = _transposed_copy(data_t, scale_inv_t, self.shape, to_compact=False)
        data_t = None if data_t is None else self._values(data_t).reshape(self.shape[-1] if self.dim() else 1, -1)
        return BlockOperand(data, self._rowwise_scale_inv, data_t, scale_inv_t, block=self._block)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x[i, j] = data[i, j] * scale_inv[tile of (i, j)] (``ops.dequantize_blockwise``), in ``dtype``."""
        return self.operand().dequantize(dtype).reshape(self.shape)

    _layout = ("_is_2D_scaled", "_data_format")

    def _columnwise_shape(self, shape: torch.Size) -> torch.Size:
        return _columnwise_data_shape(shape, self._compact)

    def _with_buffers(self, shape: torch.Size, data: Optional[torch.Tensor], data_t: Optional[torch.Tensor]) -> Float8BlockwiseQTensor:
        return Float8BlockwiseQTensor(shape=shape, dtype=self.dtype, rowwise_data=data, rowwise_scale_inv=self._rowwise_scale_inv,
                                      columnwise_data=data_t, columnwise_scale_inv=self._columnwise_scale_inv, fp8_dtype=self._fp8_dtype,
                                      quantizer=self._quantizer, is_2D_scaled=self._is_2D_scaled, device=self.device,
                                      data_format=self._data_format)

    def _make_columnwise(self) -> None:
        """2-D tiles: the exact transpose of the row-wise values and scales. 1-D tiles: RuntimeError (the column-wise
        copy is a quantization of x^T, which the row-wise FP8 values cannot give)."""
        if not self._is_2D_scaled:
            raise RuntimeError("the column-wise copy of 1 x 128 tiles is a quantization of x^T; it cannot be made from the "
                               "row-wise FP8 values: quantize with columnwise=True")
        self._columnwise_data = _transposed_bytes(self._rowwise_data, self._fp8_dtype, self.shape)
        self._columnwise_scale_inv = self._rowwise_scale_inv.t()

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle the FP8 buffers, their scales, the fp8 dtype, tiles, data format, nominal dtype and shape (not the quantizer)."""
        return (_make_blockwise_tensor_in_reduce_ex,
                (self.shape, self.dtype, self._rowwise_data, self._rowwise_scale_inv, self._columnwise_data,
                 self._columnwise_scale_inv, self._fp8_dtype, self._is_2D_scaled, self._data_format.value))


def _check_blocks(shape: torch.Size, is_2d: bool, data, scale_inv, data_t, scale_inv_t, compact: bool) -> None:
    """ValueError unless the given copies fit ``shape`` and each has scales of its tiles' grid (the column-wise
    copy in the ``compact`` format when asked)."""
    if data is None and data_t is None:
        raise ValueError("a Float8BlockwiseQTensor needs rowwise_data, columnwise_data or both; got neither")
    for name, values, scales, want, grid in (
        ("rowwise", data, scale_inv, shape, _scale_grid(shape, is_2d, columnwise=False)),
        ("columnwise", data_t, scale_inv_t, _columnwise_data_shape(shape, compact),
         _scale_grid(shape, is_2d, columnwise=True, compact=compact)),
    ):
        if values is None:
            continue
        if values.shape != want:
            raise ValueError(f"{name}_data has shape {tuple(values.shape)}; "
                             f"a Float8BlockwiseQTensor of shape {tuple(shape)} needs {tuple(want)}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != grid:
            got = f"{scales.dtype} {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales).__name__
            tile = "128 x 1" if compact and name == "columnwise" else "128 x 128" if is_2d else "1 x 128"
            raise ValueError(f"{name}_scale_inv must be float32 of shape {grid} (one per {tile} tile), got {got}")


def _make_blockwise_tensor_in_reduce_ex(shape, dtype, data, scale_inv, data_t, scale_inv_t, fp8_dtype, is_2d,
                                        data_format: int = Float8BlockScaleTensorFormat.GEMM_READY.value) -> Float8BlockwiseQTensor:
    """Rebuild a pickled Float8BlockwiseQTensor (``Float8BlockwiseQTensor.__reduce_ex__``; the data format travels as its
    int, which ``torch.load(weights_only=True)`` accepts)."""
    return Float8BlockwiseQTensor(shape=shape, dtype=dtype, rowwise_data=data, rowwise_scale_inv=scale_inv, columnwise_data=data_t,
                                  columnwise_scale_inv=scale_inv_t, fp8_dtype=fp8_dtype, is_2D_scaled=is_2d,
                                  data_format=Float8BlockScaleTensorFormat(data_format))


torch.serialization.add_safe_globals([Float8BlockwiseQTensor, _make_blockwise_tensor_in_reduce_ex])
