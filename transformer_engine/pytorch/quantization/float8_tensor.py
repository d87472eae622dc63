"""``Float8Tensor``: the FP8 values of one tensor together with the scale that decodes them.

    x ~= data * scale_inv      (data in torch.float8_e4m3fn or torch.float8_e5m2, scale_inv float32)

It is a plain container, not a ``torch.Tensor`` subclass: modules pass it to the catalog's FP8 ops
(``gemm`` takes ``data`` and ``scale_inv`` of each operand) and keep it for backward instead of the
high-precision tensor, which is where FP8 saves activation memory.

A 2-D tensor may also carry its transpose ``data_t = data^T`` (contiguous): Hopper's FP8 GEMMs read
both operands along K (the "TN" layout), so dgrad and wgrad need the transposed copies of W, dy and
x. They are made once, where the tensor is quantized (``cast_transpose``), instead of per GEMM. An
operand kept only for wgrad drops its row-major ``data`` (``transpose_only``).

A weight's W^T need not live from forward to backward at all: :class:`DeferredTranspose` keeps the
high-precision weight (alive anyway as the parameter) and casts W^T again when dgrad needs it, with
the scale forward used, so the values are the same. For a whole layer this takes one byte per weight
element off the peak of a training step, for one more read of W per step (modules do so for weights
larger than ``module.base.KEEP_WEIGHT_T_MAX_NUMEL``; smaller ones keep W^T, which costs the host less). A weight stored in FP8
(``quantized_model_init``) has nothing to cast: :class:`StoredTranspose` transposes its FP8 bytes in
backward instead (the same values, no rounding).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from transformer_engine.plugin import ops

__all__ = ["DeferredTranspose", "Float8Tensor", "StoredTranspose"]


class Float8Tensor:
    """Per-tensor-scaled FP8 data (immutable by convention: the methods return new objects).

    A slotted class rather than a frozen dataclass: modules build several per GEMM, and a frozen
    dataclass costs twice as much host time to create.

    Attributes:
        data: FP8 values with the tensor's logical shape (None when only ``data_t`` is kept).
        scale_inv: 0-d (or one-element) float32 tensor, 1 / scale.
        data_t: the contiguous transpose of a 2-D ``data``, or None.
        deferred_t: for a weight whose transpose backward casts again, the :class:`DeferredTranspose`
            that does it (see ``Quantizer.quantize_weight``); else None.

    Raises:
        ValueError: neither ``data`` nor ``data_t`` is given.

    Example:
        >>> import torch
        >>> from transformer_engine.plugin import ops
        >>> q, scale_inv, _ = ops.quantize(torch.tensor([1.0, -2.0]), torch.tensor(4.0), torch.float8_e4m3fn)
        >>> Float8Tensor(q, scale_inv).dequantize(torch.float32)
        tensor([ 1., -2.])
    """

    __slots__ = ("data", "scale_inv", "data_t", "deferred_t")

    def __init__(self, data: Optional[torch.Tensor], scale_inv: torch.Tensor, data_t: Optional[torch.Tensor] = None):
        if data is None and data_t is None:
            raise ValueError("a Float8Tensor needs data, data_t or both")
        self.data = data
        self.scale_inv = scale_inv
        self.data_t = data_t
        self.deferred_t = None

    def __repr__(self) -> str:
        return f"Float8Tensor(data={self.data!r}, scale_inv={self.scale_inv!r}, data_t={self.data_t!r})"

    @property
    def _stored(self) -> torch.Tensor:
        return self.data if self.data is not None else self.data_t

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 dtype of the values."""
        return self._stored.dtype

    @property
    def shape(self) -> torch.Size:
        """The logical shape."""
        return self.data.shape if self.data is not None else self.data_t.t().shape

    @property
    def device(self) -> torch.device:
        """The device of the values."""
        return self._stored.device

    def to_saved(self):
        """(tensors, rebuild): what ``save_for_backward`` stores and the callable that makes this operand again."""
        return (self.data, self.scale_inv, self.data_t), Float8Tensor

    def _data_t(self) -> torch.Tensor:
        """``data_t``, or the transpose of ``data`` made now."""
        return self.data_t if self.data_t is not None else ops.fp8_transpose(self.data)

    def with_transpose(self) -> "Float8Tensor":
        """This tensor with ``data_t`` (made by ``ops.fp8_transpose`` if it is missing)."""
        if self.data_t is not None:
            return self
        return Float8Tensor(self.data, self.scale_inv, self._data_t())

    def transpose_only(self) -> "Float8Tensor":
        """The same tensor keeping only ``data_t`` (what wgrad reads), made if missing."""
        return Float8Tensor(None, self.scale_inv, self._data_t())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = data * scale_inv, computed in float32 and cast to ``dtype``."""
        if self.data is None:
            return ops.dequantize(self.data_t, self.scale_inv, dtype).t()
        return ops.dequantize(self.data, self.scale_inv, dtype)


class DeferredTranspose:
    """W^T for the dgrad GEMM, cast again from the weight W in backward instead of kept from forward.

    ``quantizer.quantize(W, columnwise=True)`` must give the values forward's cast gave: the same
    scale (``FixedScaleQuantizer``, holding a copy of a delayed or current scale once :meth:`snapshot`
    took it) or a cast that depends on W alone (block scaling). Autograd saves W itself (``to_saved``), so an in-place change of W
    before backward is caught by its version counter, as for any saved tensor.

    Attributes:
        weight: the high-precision weight [N, K].
        quantizer: casts it again, recording no amax.
    """

    __slots__ = ("weight", "quantizer")

    def __init__(self, weight: torch.Tensor, quantizer):
        self.weight = weight
        self.quantizer = quantizer

    def to_saved(self):
        """((weight,), rebuild): what ``save_for_backward`` stores and the callable that makes this object again."""
        return (self.weight,), partial(DeferredTranspose, quantizer=self.quantizer)

    def snapshot(self) -> "DeferredTranspose":
        """This deferred cast as backward must run it, taken now (``Quantizer.snapshot``: a copy of a
        scale that the update after forward rewrites in place). Forward calls it when it saves the
        operand, after its GEMMs are queued, so the copy does not delay them."""
        return DeferredTranspose(self.weight, self.quantizer.snapshot())

    def materialize(self) -> Float8Tensor:
        """W^T as an FP8 operand keeping only ``data_t``, cast now."""
        return self.quantizer.quantize_transposed(self.weight)


class StoredTranspose(DeferredTranspose):
    """W^T for dgrad from a weight stored in FP8 (an FP8 parameter): its bytes transposed in backward.

    W^T = transpose(data), decoded with the same ``scale_inv``: no cast, so the values are exactly the
    stored ones. Forward saves the parameter's own buffers (no copy; an in-place update of the parameter
    before backward is caught by their version counters), and the transpose lives only for the dgrad.

    Attributes:
        data: the FP8 weight [N, K] (the parameter's buffer).
        scale_inv: its float32 1 / scale.
    """

    __slots__ = ("data", "scale_inv")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor):  # pylint: disable=super-init-not-called
        self.data = data
        self.scale_inv = scale_inv

    def to_saved(self):
        """((data, scale_inv), rebuild)."""
        return (self.data, self.scale_inv), StoredTranspose

    def snapshot(self) -> "StoredTranspose":
        """Self: the stored scale_inv is the one the data was cast with (an update rewrites both)."""
        return self

    def materialize(self) -> Float8Tensor:
        """W^T as an FP8 operand keeping only ``data_t`` (``ops.fp8_transpose`` of the stored bytes)."""
        return Float8Tensor(None, self.scale_inv, ops.fp8_transpose(self.data))
