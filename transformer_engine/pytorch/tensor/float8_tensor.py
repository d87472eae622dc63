"""``Float8Tensor`` and its per-tensor quantizers (TE's public FP8 tensor API).

    x ~= _data * _scale_inv,   _data = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),   _scale_inv = 1 / scale

- :class:`Float8Quantizer` (delayed scaling): ``scale`` is given (from earlier steps' amaxes) and the
  cast max-accumulates this tensor's amax into ``amax``: amax = max(amax, max|x|).
- :class:`Float8CurrentScalingQuantizer`: scale = fp8_max / max(max|x|, amax_epsilon) of the very tensor
  being cast (1 when that amax is 0 or not finite), rounded down to a power of two with
  ``force_pow_2_scales``: scale = 2^floor(log2(scale)).

``_data`` holds the FP8 bytes as uint8, as NVIDIA TE keeps them (code that swaps in a buffer of its own, as
Megatron-Core's distributed optimizer does, hands uint8); the constructor also accepts torch float8 tensors,
and the casts and GEMMs read the bytes through views in the FP8 dtype (``_fp8_dtype``). With column-wise usage
the tensor also holds ``_transpose``, its FP8 bytes with the last dimension moved first: shape (N, *lead) for a
logical (*lead, N), i.e. (x.reshape(-1, N))^T.
The casts are the catalog's ops (``quantize``, ``cast_transpose``, ``quantize_transposed``,
``current_scale``, ``dequantize``, ``fp8_transpose``), so they run on every backend, the CPU included.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from transformer_engine.common.recipe import QParams
from transformer_engine.plugin import ops

from ..quantization.float8_tensor import Float8Tensor as Float8Operand
from ..quantization.float8_tensor import StoredTranspose
from ..quantization.quantizer import FixedScaleQuantizer
from ..quantization.quantizer import Float8CurrentScalingQuantizer as ModuleCurrentScalingQuantizer

from .dtype import DType, fp8_torch_dtype
from .quantized_tensor import QuantizedTensor, Quantizer, _default_device, _IdentityFunc, check_high_precision

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Tensor"]

FP8DType = Union[DType, torch.dtype]


def _columnwise_shape(shape: Iterable[int]) -> torch.Size:
    """Shape of the transposed data: (*lead, N) -> (N, *lead); a 0-d shape stays 0-d."""
    shape = torch.Size(shape)
    return shape if len(shape) == 0 else torch.Size((shape[-1], *shape[:-1]))


def _matrix_dims(shape: Iterable[int]) -> Tuple[int, int]:
    """(M, K) of the matrix [prod(lead), last] a tensor of ``shape`` is quantized as (0-d: (1, 1))."""
    shape = torch.Size(shape)
    return math.prod(shape[:-1]), (shape[-1] if len(shape) else 1)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """x as the matrix [prod(lead), N] its transposed data is made from (0-d: [1, 1])."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _byte_buffer(buffer: Optional[torch.Tensor], fp8_dtype: torch.dtype, name: str) -> Optional[torch.Tensor]:
    """``buffer`` as the uint8 bytes the tensors store (TE's storage): uint8 as it is, ``fp8_dtype`` viewed as bytes.

    Raises:
        TypeError: ``buffer`` holds another dtype.
    """
    if buffer is None or buffer.dtype == torch.uint8:
        return buffer
    if buffer.dtype == fp8_dtype:
        return buffer.view(torch.uint8)
    raise TypeError(f"{name} has dtype {buffer.dtype}; a tensor with fp8 dtype {fp8_dtype} needs uint8 or {fp8_dtype} data")


def _bytes(values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """FP8 values as the uint8 bytes the tensors store (None stays None)."""
    return None if values is None else values.view(torch.uint8)


def _values(buffer: Optional[torch.Tensor], fp8_dtype: "DType") -> Optional[torch.Tensor]:
    """Stored uint8 bytes viewed as the FP8 values of ``fp8_dtype`` (what the casts and GEMMs read; None stays None)."""
    return None if buffer is None else buffer.view(fp8_torch_dtype(fp8_dtype))


def _transposed_bytes(buffer: torch.Tensor, fp8_dtype: "DType", shape: Iterable[int]) -> torch.Tensor:
    """The stored bytes of a tensor of logical ``shape``, transposed (``ops.fp8_transpose`` of its matrix), shaped
    (last dim, *lead) as the column-wise data."""
    return _bytes(ops.fp8_transpose(_as_2d(_values(buffer, fp8_dtype)))).view(_columnwise_shape(shape))


def _one_element_f32(t, name: str) -> None:
    """Raise unless ``t`` is a one-element float32 tensor (per-tensor scaling state)."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a one-element float32 tensor (per-tensor scaling), got {got}")


def _write(old: Optional[torch.Tensor], new: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``new``'s values in ``old``'s memory when they fit (views of the tensor see the update), else ``new``."""
    if old is None or new is None or old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        return new
    return old.copy_(new)


class _PerTensorQuantizer(Quantizer):
    """The cast both FP8 quantizers share; a subclass gives the scale (``_scale_and_amax_out``)."""

    dtype: DType

    def __init__(self, fp8_dtype: FP8DType, *, rowwise: bool, columnwise: bool) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        fp8_torch_dtype(fp8_dtype)  # validates
        self.dtype = DType.cast(fp8_dtype)

    @abc.abstractmethod
    def _scale_and_amax_out(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scale, amax_out) for casting ``x``: see the catalog's ``quantize``."""

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool):
        """(data, transpose, scale_inv) of x: row-wise ``ops.quantize``, both ``ops.cast_transpose``,
        column-wise only ``ops.quantize_transposed`` (each one pass over x).

        Raises:
            ValueError: neither usage is asked for.
        """
        if not (rowwise or columnwise):
            raise ValueError(f"{type(self).__name__} has rowwise=False and columnwise=False; enable at least one usage with set_usage")
        fp8_dtype = fp8_torch_dtype(self.dtype)
        scale, amax_out = self._scale_and_amax_out(x)
        data = transpose = None
        if rowwise and columnwise:
            data, transpose, scale_inv, _ = ops.cast_transpose(_as_2d(x), scale, fp8_dtype, amax_out=amax_out)
        elif rowwise:
            data, scale_inv, _ = ops.quantize(x, scale, fp8_dtype, amax_out=amax_out)
        else:
            transpose, scale_inv, _ = ops.quantize_transposed(_as_2d(x), scale, fp8_dtype, amax_out=amax_out)
        data = None if data is None else data.view(x.shape)
        transpose = None if transpose is None else transpose.view(_columnwise_shape(x.shape))
        return data, transpose, scale_inv

    def quantize_impl(self, tensor: torch.Tensor) -> Float8Tensor:
        check_high_precision(tensor)
        data, transpose, scale_inv = self._cast(tensor.detach(), self.rowwise_usage, self.columnwise_usage)
        return Float8Tensor(shape=tensor.shape, dtype=tensor.dtype, data=data, fp8_scale_inv=scale_inv.reshape(1),
                            fp8_dtype=self.dtype, data_transpose=transpose, quantizer=self, device=tensor.device)

    def _tensor_type(self) -> type:
        return Float8Tensor

    def _update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> Float8Tensor:
        """dst = Q(src), written into dst's buffers (the usages dst holds); dst takes this FP8 dtype."""
        usages = dst.get_usages()
        data, transpose, scale_inv = self._cast(src.detach().to(device=dst.device), usages["rowwise"], usages["columnwise"])
        dst._data, dst._transpose = _write(dst._data, _bytes(data)), _write(dst._transpose, _bytes(transpose))
        dst._scale_inv = _write(dst._scale_inv, scale_inv.reshape(dst._scale_inv.shape))
        dst._fp8_dtype = self.dtype
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> Float8Tensor:
        """A Float8Tensor of ``shape`` with uninitialized data (and transpose with column-wise usage)."""
        device, shape = _default_device(device), torch.Size(shape)
        data = torch.empty(shape, dtype=torch.uint8, device=device) if self.rowwise_usage else None
        transpose = torch.empty(_columnwise_shape(shape), dtype=torch.uint8, device=device) if self.columnwise_usage else None
        return Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=torch.ones(1, dtype=torch.float32, device=device),
                            fp8_dtype=self.dtype, data_transpose=transpose, quantizer=self,
                            requires_grad=requires_grad, device=device)


class Float8Quantizer(_PerTensorQuantizer):
    """Delayed scaling: cast with the given ``scale``; amax = max(amax, max|x|) in place.

    Args:
        scale: one-element float32 tensor, the scale q = cast(x * scale) uses.
        amax: one-element float32 tensor holding a value >= 0 (e.g. zeros), max-accumulated by each cast.
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        rowwise, columnwise: usages (see :class:`Quantizer`).

    Example:
        >>> q = Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), DType.kFloat8E4M3)
        >>> x_fp8 = q(torch.tensor([1.0, -2.0]))
        >>> x_fp8.dequantize(), q.amax
        (tensor([ 1., -2.]), tensor([2.]))
    """

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: FP8DType, *,
                 rowwise: bool = True, columnwise: bool = True) -> None:
        _one_element_f32(scale, "scale")
        _one_element_f32(amax, "amax")
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        self.scale = scale
        self.amax = amax

    def copy(self) -> Float8Quantizer:
        return Float8Quantizer(self.scale, self.amax, self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)

    def _scale_and_amax_out(self, x):
        return self.scale, self.amax

    def _state_tensors(self) -> List[torch.Tensor]:
        return [self.amax]

    def module_quantizer(self) -> FixedScaleQuantizer:
        """The quantizer the modules cast with under a ``CustomRecipe`` that returns this one: the same
        scale, the amax max-accumulated into ``amax``."""
        return FixedScaleQuantizer(self.scale.view(()), fp8_torch_dtype(self.dtype), self.amax.view(()))

    def calibrate(self, tensor: torch.Tensor) -> None:
        """amax = max|tensor| (finite elements), without casting."""
        self.amax.copy_(ops.compute_amax(tensor.detach()).reshape(self.amax.shape))


class Float8CurrentScalingQuantizer(_PerTensorQuantizer):
    """Current scaling: scale = fp8_max / max(max|x|, amax_epsilon) of each tensor cast (``ops.current_scale``).

    ``scale`` and ``amax`` (float32 [1], TE's buffers, each quantizer its own) hold the values of the last cast;
    they follow the device of the tensors cast.

    Args:
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        device: where ``scale`` and ``amax`` start (default: the current CUDA device, else the CPU).
        rowwise, columnwise: usages (see :class:`Quantizer`).
        force_pow_2_scales: round the scale down to a power of two, 2^floor(log2(scale)).
        amax_epsilon: lower bound of the amax the scale is computed from (>= 0).

    Example:
        >>> q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
        >>> q(torch.tensor([1.0, -2.0]))._scale_inv  # 2 / 448
        tensor([0.0045])
    """

    def __init__(self, fp8_dtype: FP8DType, device=None, *, rowwise: bool = True, columnwise: bool = True,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0) -> None:
        if not isinstance(amax_epsilon, (int, float)) or isinstance(amax_epsilon, bool) or not 0.0 <= amax_epsilon < math.inf:
            raise ValueError(f"amax_epsilon={amax_epsilon!r} must be a finite float >= 0 (the smallest amax a scale is computed from)")
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)
        device = _default_device(device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.amax = torch.zeros(1, dtype=torch.float32, device=device)

    def copy(self) -> Float8CurrentScalingQuantizer:
        """A copy sharing ``scale`` and ``amax`` (as every quantizer's ``copy``)."""
        made = Float8CurrentScalingQuantizer(self.dtype, self.scale.device, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                             force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        made.scale, made.amax = self.scale, self.amax
        return made

    def _state_tensors(self) -> List[torch.Tensor]:
        return [self.scale, self.amax]

    def _scale_and_amax_out(self, x):
        """(scale, amax) of ``ops.current_scale`` (the cast max-accumulates into that amax, which already holds max|x|);
        both are also written into ``scale`` / ``amax``, which move to x's device first when they are elsewhere."""
        scale, amax = ops.current_scale(x, fp8_torch_dtype(self.dtype), amax_epsilon=self.amax_epsilon,
                                        power_2_scale=self.force_pow_2_scales)
        if self.scale.device != x.device:
            self.scale, self.amax = self.scale.to(x.device), self.amax.to(x.device)
        torch._foreach_copy_([self.scale, self.amax], [scale.view(1), amax.view(1)])
        return scale, amax

    def module_quantizer(self) -> ModuleCurrentScalingQuantizer:
        """The quantizer the modules cast with under a ``CustomRecipe`` that returns this one (the same rule)."""
        qparams = QParams(power_2_scale=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        return ModuleCurrentScalingQuantizer(fp8_torch_dtype(self.dtype), qparams)


class Float8Tensor(QuantizedTensor):
    """A tensor with per-tensor-scaled FP8 data that presents its nominal ``dtype``.

    Args:
        shape: the logical shape. dtype: the nominal (high-precision) dtype.
        data: FP8 values of ``shape`` (uint8 bytes, stored as given, or the torch float8 dtype), or None (column-wise only).
        fp8_scale_inv: one-element float32 tensor, 1 / scale.
        fp8_dtype: ``DType.kFloat8E4M3`` or ``DType.kFloat8E5M2`` (or the torch float8 dtype).
        requires_grad: autograd flag of the new tensor.
        data_transpose: the transposed FP8 values, shape (N, *lead), or None.
        quantizer: the quantizer for in-place updates (a copy is kept), or None.
        device: defaults to the data's device.

    Raises:
        ValueError: no data at all, a buffer whose shape does not fit ``shape``, a bad scale_inv or fp8_dtype.
        TypeError: a buffer that is neither uint8 nor the matching float8 dtype.

    Example:
        >>> x = Float8Tensor(shape=(2,), dtype=torch.float32, data=torch.tensor([56, 64], dtype=torch.uint8),
        ...                  fp8_scale_inv=torch.tensor([0.5]), fp8_dtype=DType.kFloat8E4M3)
        >>> x.dequantize()
        tensor([0.5000, 1.0000])
    """

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, data: Optional[torch.Tensor],
                fp8_scale_inv: torch.Tensor, fp8_dtype: FP8DType, requires_grad: bool = False,
                data_transpose: Optional[torch.Tensor] = None, quantizer: Optional[Quantizer] = None,
                device=None, stride: Optional[Iterable[int]] = None):
        torch_fp8 = fp8_torch_dtype(fp8_dtype)
        data, data_transpose = _byte_buffer(data, torch_fp8, "data"), _byte_buffer(data_transpose, torch_fp8, "data_transpose")
        shape = torch.Size(shape)
        _check_buffers(shape, data, data_transpose)
        _one_element_f32(fp8_scale_inv, "fp8_scale_inv")
        device = (data if data is not None else data_transpose).device if device is None else torch.device(device)
        instance = super().__new__(cls, shape, dtype, requires_grad=requires_grad, device=device, stride=stride)
        instance._data = data
        instance._transpose = data_transpose
        instance._scale_inv = fp8_scale_inv.to(device)
        instance._fp8_dtype = DType.cast(fp8_dtype)
        instance._quantizer = None if quantizer is None else quantizer.copy()
        return instance

    def __repr__(self, *, tensor_contents=None) -> str:
        scale_inv = self._scale_inv.item() if self._holds_values() else "<traced>"
        return f"Float8Tensor(fp8_dtype={self._fp8_dtype.name}, scale_inv={scale_inv}, data={self._repr_values()})"

    def get_metadata(self) -> Dict[str, Any]:
        return {"data": self._data, "fp8_scale_inv": self._scale_inv, "fp8_dtype": self._fp8_dtype,
                "data_transpose": self._transpose, "quantizer": self._quantizer}

    @classmethod
    def _buffer_keywords(cls) -> Dict[str, str]:
        return {"_data": "data", "_transpose": "data_transpose", "_scale_inv": "fp8_scale_inv"}

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = data * scale_inv (``ops.dequantize``), from the transposed data when there is no row-wise copy."""
        if self._data is not None:
            return ops.dequantize(_values(self._data, self._fp8_dtype), self._scale_inv, dtype)
        x_t = ops.dequantize(_values(self._transpose, self._fp8_dtype), self._scale_inv, dtype)
        return x_t if x_t.dim() == 0 else x_t.movedim(0, -1).contiguous()

    def operand(self) -> Float8Operand:
        """The GEMM operand the modules read (a 2-D tensor with row-wise data): its FP8 values and scale_inv as they
        are, with W^T from the stored transpose, or else its bytes transposed when backward needs them (exact).
        scale_inv goes as a 0-d view, as the modules' casts make theirs: Inductor's ``_scaled_mm`` lowering wants both
        scales of one rank (TE's one-element ``_scale_inv`` against a cast's 0-d one fails there)."""
        data, transpose = _values(self._data, self._fp8_dtype), _values(self._transpose, self._fp8_dtype)
        scale_inv = self._scale_inv.reshape(())
        operand = Float8Operand(data, scale_inv, transpose)
        if transpose is None:
            operand.deferred_t = StoredTranspose(data, scale_inv)
        return operand

    def _adopt(self, other: Float8Tensor) -> None:
        self._data, self._transpose, self._scale_inv = other._data, other._transpose, other._scale_inv
        self._fp8_dtype = other._fp8_dtype
        self._quantizer = None if other._quantizer is None else other._quantizer.copy()

    def _reshaped(self, shape: tuple, method: str) -> Float8Tensor:
        """The same FP8 values with another shape (``method``: "view" or "reshape" of the buffers).

        The transposed data survives when the last dimension does (flattening the leading ones keeps
        their order); otherwise it is dropped, which needs row-wise data.
        """
        logical = getattr(torch.empty(self.shape, device="meta"), method)(shape).shape
        data = None if self._data is None else getattr(self._data, method)(logical)
        transpose = None
        if self._transpose is not None and logical[-1:] == self.shape[-1:]:
            transpose = getattr(self._transpose, method)(_columnwise_shape(logical))
        if data is None and transpose is None:
            raise NotImplementedError(
                f"cannot reshape a column-wise-only Float8Tensor of shape {tuple(self.shape)} to {tuple(logical)}: "
                "the last dimension must stay the same (or call update_usage(rowwise_usage=True) on a tensor with row-wise data)"
            )
        return Float8Tensor(shape=logical, dtype=self.dtype, data=data, fp8_scale_inv=self._scale_inv,
                            fp8_dtype=self._fp8_dtype, data_transpose=transpose, quantizer=self._quantizer, device=self.device)

    def contiguous(self, memory_format=torch.contiguous_format) -> Float8Tensor:
        """Self when its buffers are contiguous, else a tensor with contiguous copies of them."""
        buffers = {"data": self._data, "data_transpose": self._transpose}
        if all(b is None or b.is_contiguous(memory_format=memory_format) for b in buffers.values()):
            return self
        contiguous = {k: None if b is None else b.contiguous(memory_format=memory_format) for k, b in buffers.items()}
        return _IdentityFunc.apply(self, {**self.get_metadata(), **contiguous})

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make the transposed data (``ops.fp8_transpose`` of the row-wise data) or drop either copy.

        Raises:
            RuntimeError: row-wise data is asked for but only the transposed copy exists (FP8 values are
                not transposed back), or the tensor would be left with no data.
        """
        rowwise = self._data is not None if rowwise_usage is None else rowwise_usage
        columnwise = self._transpose is not None if columnwise_usage is None else columnwise_usage
        if rowwise and self._data is None:
            raise RuntimeError("cannot make row-wise FP8 data of a Float8Tensor that only holds its transposed data")
        if not (rowwise or columnwise):
            raise RuntimeError("update_usage(rowwise_usage=False, columnwise_usage=False) would leave the Float8Tensor without data")
        if columnwise and self._transpose is None:
            self._transpose = _transposed_bytes(self._data, self._fp8_dtype, self.shape)
        self._data = self._data if rowwise else None
        self._transpose = self._transpose if columnwise else None

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self._data is not None, "columnwise": self._transpose is not None}

    def _reset_caches(self) -> None:
        """Drop the transposed copy (NVIDIA TE's name for it): code that rewrites the bytes calls it first."""
        self._transpose = None

    @property
    def _transpose_invalid(self) -> bool:
        """NVIDIA TE's flag: True when the tensor has no transposed copy to read. Setting it True drops the copy
        (Megatron-Core's FSDP does after rewriting the bytes)."""
        return self._transpose is None

    @_transpose_invalid.setter
    def _transpose_invalid(self, invalid: bool) -> None:
        if invalid:
            self._transpose = None
        elif self._transpose is None:
            raise ValueError("_transpose_invalid = False, but this Float8Tensor has no transposed copy; "
                             "call update_usage(columnwise_usage=True)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and isinstance(args[0], Float8Tensor) and isinstance(args[1], Float8Tensor):
            return _copy_fp8(args[0], args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle the FP8 buffers, scale_inv, fp8 dtype, nominal dtype and shape (not the quantizer)."""
        return (_make_float8_tensor_in_reduce_ex,
                (self._data, self._fp8_dtype, self._scale_inv, self.dtype, self.shape, self._transpose))


def _copy_fp8(dst: Float8Tensor, src: Float8Tensor) -> Float8Tensor:
    """dst.copy_(src) between Float8Tensors: src's FP8 bytes and scale_inv copied into dst's buffers (no
    re-quantization, as TE: a checkpoint loads bit for bit); dst's transpose, if it keeps one, is made
    from the copied bytes. Another shape, FP8 dtype, or a src without row-wise data: dst = Q(src)."""
    if src.shape != dst.shape or src._fp8_dtype != dst._fp8_dtype or src._data is None:
        return dst.quantize_(src)
    data = src._data.detach().to(dst.device)
    transpose = None
    if dst._transpose is not None:
        transpose = src._transpose if src._transpose is not None else _transposed_bytes(data, src._fp8_dtype, src.shape)
        transpose = transpose.detach().to(dst.device).view(_columnwise_shape(dst.shape))
    dst._data = None if dst._data is None else _write(dst._data, data)
    dst._transpose = _write(dst._transpose, transpose)
    dst._scale_inv = _write(dst._scale_inv, src._scale_inv.detach().to(dst.device).reshape(dst._scale_inv.shape))
    return dst


def _check_buffers(shape: torch.Size, data: Optional[torch.Tensor], transpose: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless data has ``shape`` and the transpose (N, *lead), with at least one given."""
    if data is None and transpose is None:
        raise ValueError("a Float8Tensor needs data, data_transpose or both; got neither")
    if data is not None and data.shape != shape:
        raise ValueError(f"data has shape {tuple(data.shape)} but the Float8Tensor has shape {tuple(shape)}; they must match")
    if transpose is not None and transpose.shape != _columnwise_shape(shape):
        raise ValueError(f"data_transpose has shape {tuple(transpose.shape)}; a Float8Tensor of shape {tuple(shape)} "
                         f"needs {tuple(_columnwise_shape(shape))} (the last dimension first)")


def _make_float8_tensor_in_reduce_ex(data: Optional[torch.Tensor], fp8_dtype: DType, fp8_scale_inv: torch.Tensor,
                                     dtype: torch.dtype, shape: torch.Size,
                                     data_transpose: Optional[torch.Tensor] = None) -> Float8Tensor:
    """Rebuild a pickled Float8Tensor (``Float8Tensor.__reduce_ex__``)."""
    return Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=fp8_scale_inv, fp8_dtype=fp8_dtype,
                        data_transpose=data_transpose)


torch.serialization.add_safe_globals([DType, Float8Tensor, _make_float8_tensor_in_reduce_ex])
