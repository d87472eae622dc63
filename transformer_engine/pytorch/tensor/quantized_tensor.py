"""``QuantizedTensor`` and ``Quantizer``: TE's public base classes for quantized tensors.

A ``Quantizer`` turns a high-precision tensor into a ``QuantizedTensor``:

    x_q = quantizer(x),   x ~= x_q.dequantize()

A ``QuantizedTensor`` is a ``torch.Tensor`` wrapper subclass: it reports the nominal (high-precision)
``dtype``, shape and device of the tensor it encodes and keeps the encoded buffers as attributes. Any
torch op it has no rule for runs in high precision (``__torch_dispatch__``):

    out-of-place op f:  f(x_q, ...) = f(x_q.dequantize(), ...)        (a plain tensor)
    in-place op f_:     x_q.quantize_(f(x_q.dequantize(), ...))        (x_q keeps its type and quantizer)

``copy_`` into a quantized tensor quantizes the source into it; ``detach`` and ``clone`` keep the
subclass. Autograd treats quantize and dequantize as identities (straight-through gradients).
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

__all__ = ["QuantizedTensor", "Quantizer"]

aten = torch.ops.aten


def _default_device(device) -> torch.device:
    """``device``, or the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Quantizer(abc.ABC):
    """Builds quantized tensors from high-precision ones.

    ``rowwise_usage``: make the data a GEMM reads along the last dimension (x as the B operand of the
    TN GEMM y = x W^T). ``columnwise_usage``: also make the data read along the first dimensions
    (x^T for the wgrad GEMM dW = dy^T x), e.g. a transposed FP8 copy.
    """

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage})"

    @abc.abstractmethod
    def quantize_impl(self, tensor: torch.Tensor) -> QuantizedTensor:
        """A new quantized tensor holding ``tensor`` (no autograd)."""

    @abc.abstractmethod
    def _update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> QuantizedTensor:
        """Quantize ``src`` into the existing ``dst`` (checked by :meth:`update_quantized`) in place; returns ``dst``."""

    def _tensor_type(self) -> type:
        """The quantized tensor class this quantizer writes."""
        return QuantizedTensor

    def _state_tensors(self) -> List[torch.Tensor]:
        """The tensors of this quantizer that a cast writes (delayed scaling: its amax)."""
        return []

    def update_quantized(self, src: torch.Tensor, dst: QuantizedTensor, *, noop_flag: Optional[torch.Tensor] = None) -> QuantizedTensor:
        """Quantize ``src`` into the existing ``dst`` in place; returns ``dst``.

        With ``noop_flag`` (a one-element tensor, NVIDIA TE's skip flag): where it is nonzero nothing changes
        (dst's buffers and this quantizer's amax keep their values). Decided on the device without a host
        synchronization: the cast runs, then each written tensor selects its old or new values.

        Raises:
            TypeError: dst is not of this quantizer's tensor class or src is not a float tensor.
            ValueError: the shapes differ, or noop_flag has more than one element.
        """
        if not isinstance(dst, self._tensor_type()):
            raise TypeError(f"{type(self).__name__} can only update a {self._tensor_type().__name__}, got {type(dst).__name__}")
        check_high_precision(src)
        if src.shape != dst.shape:
            raise ValueError(f"cannot quantize a tensor of shape {tuple(src.shape)} "
                             f"into a {type(dst).__name__} of shape {tuple(dst.shape)}")
        if noop_flag is None:
            return self._update_quantized(src, dst)
        if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1:
            raise ValueError(f"noop_flag must be a one-element tensor, got {noop_flag!r}")
        written = [t for t in dst.get_metadata().values() if isinstance(t, torch.Tensor)] + self._state_tensors()
        before = [t.clone() for t in written]
        self._update_quantized(src, dst)
        skip = noop_flag.reshape(()).to(dst.device) != 0
        for tensor, old in zip(written, before):
            tensor.copy_(torch.where(skip, old, tensor))
        return dst

    @abc.abstractmethod
    def copy(self) -> Quantizer:
        """A shallow copy (shares scale / amax tensors, not the usage flags)."""

    def quantize(self, tensor: torch.Tensor, *, out: Optional[QuantizedTensor] = None) -> QuantizedTensor:
        """``tensor`` quantized into ``out`` (in place) or into a new tensor; differentiable (dL/dx = dL/dx_q)."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if torch.is_grad_enabled():
            return _QuantizeFunc.apply(tensor, self.quantize_impl)
        return self.quantize_impl(tensor)

    def __call__(self, tensor: torch.Tensor) -> QuantizedTensor:
        return self.quantize(tensor)

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> QuantizedTensor:
        """A quantized tensor of ``shape`` with uninitialized data."""
        raise NotImplementedError(f"{type(self).__name__} does not implement make_empty")

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Update the quantizer's state as a cast of ``tensor`` would, without casting (no state here)."""

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Set the usages the next quantized tensors are made for; None keeps the current one."""
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def get_usages(self) -> Dict[str, bool]:
        """{"rowwise": ..., "columnwise": ...}."""
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensors: a wrapper subclass with a nominal dtype and high-precision fallback.

    Subclasses implement ``_dequantize(dtype)``, ``get_metadata()`` (their constructor keywords besides
    shape, dtype, device and requires_grad), ``_adopt(other)`` and the usage methods.

    Example:
        >>> qt = QuantizedTensor((2, 3), torch.bfloat16, device="cpu")
        >>> qt.shape, qt.dtype
        (torch.Size([2, 3]), torch.bfloat16)
    """

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, requires_grad: bool = False, device=None,
                stride: Optional[Iterable[int]] = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), strides=stride, dtype=dtype, layout=torch.strided,
            requires_grad=requires_grad, device=_default_device(device),
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    #: the quantizer ``quantize_``, in-place ops and ``.data`` assignment cast with (None: none given)
    _quantizer: Optional[Quantizer] = None

    # ---- what subclasses provide -------------------------------------------------------------------

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The high-precision values in ``dtype`` (no autograd)."""
        raise NotImplementedError(f"{type(self).__name__} class does not implement dequantize")

    def get_metadata(self) -> Dict[str, Any]:
        """Constructor keywords that make a tensor sharing this one's quantized buffers."""
        raise NotImplementedError(f"{type(self).__name__} class does not implement get_metadata")

    def _reshaped(self, shape: tuple, method: str) -> QuantizedTensor:
        """The same values with another shape; ``method`` is "view" (share buffers) or "reshape" (copy if needed)."""
        raise NotImplementedError(f"{type(self).__name__} class does not support tensor views")

    def _adopt(self, other: QuantizedTensor) -> None:
        """Take ``other``'s buffers and quantizer (``.data`` assignment)."""
        raise NotImplementedError(f"{type(self).__name__} class does not support .data assignment")

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make or drop the row-wise / column-wise data; None keeps the current state."""
        raise NotImplementedError(f"{type(self).__name__} class does not implement update_usage")

    def get_usages(self) -> Dict[str, bool]:
        """Which data the tensor holds: {"rowwise": ..., "columnwise": ...}."""
        raise NotImplementedError(f"{type(self).__name__} class does not implement get_usages")

    @classmethod
    def _buffer_keywords(cls) -> Dict[str, str]:
        """Attribute -> constructor keyword of every buffer (tensor) a tensor of this class may hold."""
        raise NotImplementedError(f"{cls.__name__} class does not name its buffers")

    # ---- torch.compile: a traceable wrapper subclass -----------------------------------------------

    def __tensor_flatten__(self) -> Tuple[List[str], tuple]:
        """The buffers this tensor holds (by attribute), and what rebuilds it around them: the nominal dtype and the
        constructor's other keywords (formats, tile flags; not the quantizer, which a traced step does not use)."""
        buffers = self._buffer_keywords()
        constants = tuple((k, v) for k, v in self.get_metadata().items() if k not in buffers.values() and k != "quantizer")
        return [attr for attr in buffers if getattr(self, attr) is not None], (self.dtype, constants)

    @classmethod
    def __tensor_unflatten__(cls, inner: Dict[str, torch.Tensor], context: tuple, outer_size, outer_stride) -> QuantizedTensor:
        """The tensor of :meth:`__tensor_flatten__`'s buffers and context, with the given shape and strides."""
        dtype, constants = context
        buffers = {keyword: inner.get(attr) for attr, keyword in cls._buffer_keywords().items()}
        return cls(shape=outer_size, dtype=dtype, stride=outer_stride, **dict(constants), **buffers)

    # ---- public API --------------------------------------------------------------------------------

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """x = decode(x_q) in ``dtype`` (default: the nominal dtype); differentiable (straight-through)."""
        dtype = self.dtype if dtype is None else dtype
        if torch.is_grad_enabled():
            return _DequantizeFunc.apply(self, dtype)
        return self._dequantize(dtype)

    def _get_quantizer(self) -> Quantizer:
        if self._quantizer is None:
            raise ValueError(
                f"this {type(self).__name__} has no quantizer, so it cannot be re-quantized in place; "
                "build it with a quantizer (quantizer(x)) or pass quantizer= to the constructor"
            )
        return self._quantizer

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> QuantizedTensor:
        """Re-quantize in place: self = Q(tensor) with this tensor's quantizer (unchanged where ``noop_flag`` is
        nonzero, see :meth:`Quantizer.update_quantized`); returns self."""
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor._dequantize(tensor.dtype)
        self._get_quantizer().update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    @classmethod
    def make_like(cls, tensor: QuantizedTensor, *, shape: Optional[Iterable[int]] = None,
                  dtype: Optional[torch.dtype] = None, requires_grad: bool = False) -> QuantizedTensor:
        """A new tensor sharing ``tensor``'s quantized buffers, with another nominal shape or dtype if given."""
        return cls(shape=tensor.shape if shape is None else shape, dtype=tensor.dtype if dtype is None else dtype,
                   requires_grad=requires_grad, device=tensor.device, **tensor.get_metadata())

    def detach(self) -> QuantizedTensor:
        """The same quantized buffers outside the autograd graph."""
        return type(self).make_like(self)

    def clone(self) -> QuantizedTensor:
        """A copy with its own buffers (scale_inv included); differentiable."""
        metadata = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.get_metadata().items()}
        return _IdentityFunc.apply(self, metadata)

    def view(self, *shape) -> QuantizedTensor:
        """A view with another shape over the same quantized buffers; differentiable."""
        return _ReshapeFunc.apply(self, _shape_arg(shape), "view")

    def reshape(self, *shape) -> QuantizedTensor:
        """``view`` where the buffers allow it, else a reshaped copy of them; differentiable."""
        return _ReshapeFunc.apply(self, _shape_arg(shape), "reshape")

    def float(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float32)

    def half(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float16)

    def bfloat16(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.bfloat16)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{type(self).__name__}(data={self._repr_values()})"

    def _holds_values(self) -> bool:
        """False while torch.compile traces the tensor (its buffers are fake tensors): a repr there, as compile's
        debug and trace logging prints one, must not launch a kernel or read a scalar (``.item()`` on a fake
        tensor leaves an unbacked symbol that fails Inductor's compilation)."""
        return not any(is_fake(getattr(self, attr)) for attr in self._buffer_keywords() if getattr(self, attr) is not None)

    def _repr_values(self) -> Any:
        """The dequantized values for a repr, or a note saying why there are none."""
        return self._dequantize(self.dtype) if self._holds_values() else "<fake tensor: traced, no values>"

    # ---- .data -------------------------------------------------------------------------------------

    def _get_data(self) -> QuantizedTensor:
        return self.detach()

    @torch.no_grad()
    def _set_data(self, tensor: torch.Tensor) -> None:
        """``x.data = t``: take t's buffers if t has this class, else quantize t with x's quantizer."""
        if not isinstance(tensor, type(self)):
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor._dequantize(tensor.dtype)
            tensor = self._get_quantizer().quantize_impl(tensor)
        wrapper = torch.Tensor._make_wrapper_subclass(
            type(self), tensor.size(), strides=tensor.stride(), dtype=tensor.dtype, layout=torch.strided,
            device=tensor.device,
        )
        torch._C.TensorBase.data.__set__(self, wrapper)
        self._adopt(tensor)

    data = property(_get_data, _set_data)

    # ---- dispatch ----------------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return args[0].detach()
        if func is aten.clone.default:
            return args[0].clone()
        if func is aten.copy_.default:
            return _copy_into(args[0], args[1])
        if func is aten._to_copy.default and isinstance(args[0], QuantizedTensor) and _only_moves(args[0], kwargs):
            return _moved(args[0], torch.device(kwargs.get("device") or args[0].device))
        if func is aten.view.default:  # a subclass that supports views implements _reshaped
            return args[0]._reshaped(tuple(args[1]), "view")
        if func._schema.is_mutable:
            return _run_inplace_in_high_precision(func, args, kwargs)
        return func(*tree_map(_dequantized, args), **tree_map(_dequantized, kwargs))


def check_high_precision(x) -> None:
    """TypeError unless ``x`` is a float32, bfloat16 or float16 tensor (what the quantizers cast)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"can only quantize a float32, bfloat16 or float16 tensor, got {got}")


def _shape_arg(shape) -> tuple:
    """``view(2, 3)`` and ``view((2, 3))`` both as (2, 3)."""
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else tuple(shape)


def _dequantized(arg):
    return arg._dequantize(arg.dtype) if isinstance(arg, QuantizedTensor) else arg


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src): quantize into a quantized dst, dequantize a quantized src."""
    if isinstance(dst, QuantizedTensor):
        return dst.quantize_(src)
    dst.copy_(_dequantized(src))
    return dst


def _only_moves(tensor: QuantizedTensor, kwargs: Dict[str, Any]) -> bool:
    """True when a ``_to_copy`` keeps the nominal dtype (``.to(device)``, ``.cpu()``): the subclass survives."""
    return kwargs.get("dtype") in (None, tensor.dtype)


def _moved(tensor: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    """``tensor`` with its buffers copied to ``device``."""
    metadata = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensor.get_metadata().items()}
    return type(tensor)(shape=tensor.shape, dtype=tensor.dtype, requires_grad=tensor.requires_grad, device=device,
                        **metadata)


def _run_inplace_in_high_precision(func, args, kwargs):
    """An in-place op: run it on dequantized copies, then quantize each written quantized argument again."""
    hp_args, hp_kwargs = tree_map(_dequantized, args), tree_map(_dequantized, kwargs)
    out = func(*hp_args, **hp_kwargs)
    written = [(a, h) for a, h, s in zip(args, hp_args, func._schema.arguments) if _is_written(s)]
    written += [(kwargs[s.name], hp_kwargs[s.name]) for s in func._schema.arguments if s.name in kwargs and _is_written(s)]
    for arg, hp_arg in written:
        for item, hp_item in _written_pairs(arg, hp_arg):
            if isinstance(item, QuantizedTensor):
                item.quantize_(hp_item)
    for arg, hp_arg in written:
        if out is hp_arg:
            return arg
    return out


def _written_pairs(arg, hp_arg):
    """(argument, its high-precision stand-in) pairs: one, or one per element of a tensor list (foreach ops)."""
    if isinstance(arg, (list, tuple)):
        return zip(arg, hp_arg)
    return ((arg, hp_arg),)


def _is_written(schema_arg) -> bool:
    return schema_arg.alias_info is not None and schema_arg.alias_info.is_write


class _QuantizeFunc(torch.autograd.Function):
    """x_q = quantize_impl(x); straight-through gradient dL/dx = dL/dx_q."""

    @staticmethod
    def forward(ctx, tensor, quantize_impl):
        return quantize_impl(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _DequantizeFunc(torch.autograd.Function):
    """x = x_q._dequantize(dtype); straight-through gradient."""

    @staticmethod
    def forward(ctx, tensor, dtype):
        return tensor._dequantize(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _IdentityFunc(torch.autograd.Function):
    """A tensor of the input's class, shape and dtype built from ``metadata``; identity gradient."""

    @staticmethod
    def forward(ctx, tensor, metadata):
        return type(tensor)(shape=tensor.shape, dtype=tensor.dtype, device=tensor.device, **metadata)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReshapeFunc(torch.autograd.Function):
    """``tensor._reshaped(shape, method)``; the gradient is reshaped back to the input's shape."""

    @staticmethod
    def forward(ctx, tensor, shape, method):
        ctx.shape = tensor.shape
        return tensor._reshaped(shape, method)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None, None
