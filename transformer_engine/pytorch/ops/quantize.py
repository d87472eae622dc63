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
from ..tensor.quantized_tensor import QuantizedTensor
from .op import BasicOperation

__all__ = ["Quantize"]


class _QuantizeFunction(torch.autograd.Function):
    """y = cast_forward(x) (or a copy of x); dx = cast_backward(dy, amaxes) (or dy; a quantized dy as it is), then the
    module's backward update with the amaxes its traced casts handed over (eager casts record their own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast_forward: Optional[Callable], cast_backward: Optional[Callable],
                backward_update: Optional[Callable[[list], None]]):
        ctx.cast_backward, ctx.backward_update = cast_backward, backward_update
        return x.clone() if cast_forward is None else cast_forward(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        amaxes = []
        dx = dy if ctx.cast_backward is None or isinstance(dy, QuantizedTensor) else ctx.cast_backward(dy, amaxes)
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
        if torch.compiler.is_compiling():  # the module's quantizers, decoded: plain tensors of the same values
            gemm = q.gemms[0]
            cast_forward = lambda t: gemm.input.quantize(t).dequantize(t.dtype)  # noqa: E731
            cast_backward = lambda t, amaxes: gemm.grad_output.recording_into(amaxes).quantize(t).dequantize(t.dtype)  # noqa: E731
        else:  # TE's public quantizers: quantized tensors
            public = self.quantizers
            cast_forward = public["scaling_fwd"][0].quantize
            cast_backward = lambda t, amaxes: public["scaling_bwd"][0].quantize(t)  # noqa: E731
        forward = self._quantize_forward and not isinstance(x, QuantizedTensor)
        return _QuantizeFunction.apply(x, cast_forward if forward else None, cast_backward if self._quantize_backward else None,
                                       q.backward_update)
