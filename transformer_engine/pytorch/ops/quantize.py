"""``Quantize``: TE's operation that hands the next operation (or the previous one, in backward) a quantized tensor.

Inside an FP8 ``te.autocast``: forward returns ``quantize(x)`` with the recipe's input quantizer (a TE
``QuantizedTensor``: ``Float8Tensor``, ``Float8BlockwiseQTensor``, ``MXFP8Tensor`` or ``NVFP4Tensor``), backward returns
``quantize(dy)`` with its grad-output quantizer, each when switched on (``forward``, ``backward``). Values pass through
as the quantized copy decodes them (straight-through: dx is dy, quantized or not). Outside such an autocast, and for
a tensor already quantized, the operation is the identity.

The scaling state is the module's, as for ``BasicLinear`` (one GEMM's slots: the input slot casts forward, the
grad-output slot backward; delayed scaling records their amaxes and updates them with the autocast's other modules).

Traced by torch.compile, the operation returns the same values as a plain tensor (quantized, then dequantized in
the input's dtype): Dynamo cannot construct a tensor subclass inside a graph, and a graph break is not an option.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..module.base import TransformerEngineBaseModule
from ..quantization.autocast import current_config
from ..tensor.quantized_tensor import QuantizedTensor, Quantizer
from .op import BasicOperation

__all__ = ["Quantize"]


class _QuantizeFunction(torch.autograd.Function):
    """y = quantize_fwd(x) (or x); dx = quantize_bwd(dy) (or dy); then the module's backward update."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_quantizer: Optional[Quantizer], backward_quantizer: Optional[Quantizer],
                backward_update: Optional[Callable[[list], None]]):
        ctx.backward_quantizer, ctx.backward_update = backward_quantizer, backward_update
        return x.clone() if forward_quantizer is None else forward_quantizer.quantize(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = dy
        if ctx.backward_quantizer is not None and not isinstance(dy, QuantizedTensor):
            dx = ctx.backward_quantizer.quantize(dy)
        if ctx.backward_update is not None:
            ctx.backward_update([])
        return dx, None, None, None


class _QuantizeDequantizeFunction(torch.autograd.Function):
    """The traced form: y = dequantize(quantize_fwd(x)); dx = dequantize(quantize_bwd(dy)), the module's quantizers
    (delayed scaling's backward amaxes handed to its update, as the modules' backward casts do)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_quantizer, backward_quantizer, backward_update):
        ctx.backward_quantizer, ctx.backward_update = backward_quantizer, backward_update
        return x.clone() if forward_quantizer is None else forward_quantizer.quantize(x).dequantize(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        amaxes = []
        dx = dy if ctx.backward_quantizer is None else ctx.backward_quantizer.recording_into(amaxes).quantize(dy).dequantize(dy.dtype)
        if ctx.backward_update is not None:
            ctx.backward_update(amaxes)
        return dx, None, None, None


class Quantize(TransformerEngineBaseModule, BasicOperation):
    """Quantize the tensor passing forward (``forward``) and the gradient passing backward (``backward``) with the
    recipe of the enclosing FP8 ``te.autocast``; the identity outside one.

    Example:
        >>> import torch, transformer_engine.pytorch as te, transformer_engine.pytorch.ops as te_ops
        >>> from transformer_engine.common.recipe import Float8CurrentScaling
        >>> with te.autocast(recipe=Float8CurrentScaling()):
        ...     y = te_ops.Quantize()(torch.randn(16, 16))
        >>> type(y).__name__
        'Float8Tensor'
    """

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__(1)
        self._quantize_forward, self._quantize_backward = bool(forward), bool(backward)

    def num_quantizers(self, mode: str) -> int:
        """TE's count of the quantizers each direction uses: 1 where it quantizes, else 0.

        Raises:
            ValueError: ``mode`` is neither "forward" nor "backward".
        """
        if mode not in ("forward", "backward"):
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        return int(self._quantize_forward if mode == "forward" else self._quantize_backward)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not current_config().enabled or not (self._quantize_forward or self._quantize_backward):
            return x
        q = self._prepare_quantization(x.device, [])
        if torch.compiler.is_compiling():
            gemm = q.gemms[0]
            return _QuantizeDequantizeFunction.apply(x, gemm.input if self._quantize_forward else None,
                                                     gemm.grad_output if self._quantize_backward else None, q.backward_update)
        public = self.quantizers
        forward_quantizer = public["scaling_fwd"][0] if self._quantize_forward and not isinstance(x, QuantizedTensor) else None
        backward_quantizer = public["scaling_bwd"][0] if self._quantize_backward else None
        return _QuantizeFunction.apply(x, forward_quantizer, backward_quantizer, q.backward_update)
