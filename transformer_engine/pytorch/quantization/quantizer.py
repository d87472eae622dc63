"""Quantizers: one object per tensor role that turns a high-precision tensor into its GEMM operand.

All quantizers share one interface, so module code never asks which recipe is active:

- ``quantize(x)`` returns the operand: a :class:`Float8Tensor`, or ``x`` itself in high precision;
- ``produce(run)`` quantizes the output of a producer op that can fuse the cast (norm, activation).
  ``run(fp8_scale, fp8_dtype)`` calls the op and returns ``(y, scale_inv, amax, extras)``; given
  ``(None, None)`` it must return a high-precision ``y`` (and Nones). ``produce`` returns
  ``(operand, extras)``.

The recipe picks the quantizer class:

| class | recipe | scale |
|---|---|---|
| :class:`IdentityQuantizer` | none (high precision) | - |
| :class:`Float8Quantizer` | DelayedScaling | ``state.scale[i]`` from earlier steps; amax recorded into ``amax_history[0, i]`` |
| :class:`Float8CurrentScalingQuantizer` | Float8CurrentScaling | fp8_max / amax(x) of this very tensor |
| :class:`AmaxObserver` | calibration (``autocast(calibrating=True)``) | none: records amax, stays high precision |
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from transformer_engine.common.recipe import QParams
from transformer_engine.plugin import ops

from .float8_tensor import Float8Tensor
from .scaling import amax_to_scale, fp8_max

__all__ = [
    "AmaxObserver",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "IDENTITY",
    "IdentityQuantizer",
    "Quantizer",
]

ProducerFn = Callable[..., Tuple]


class Quantizer:
    """Base class: quantize a tensor, or the output of a fusable producer (see the module docstring)."""

    #: True when ``quantize`` returns FP8 operands (the FP8 shape rules apply).
    is_fp8 = False

    def quantize(self, x: torch.Tensor):
        """The GEMM operand for ``x``."""
        raise NotImplementedError

    def produce(self, run: ProducerFn):
        """Run ``run`` in high precision, then :meth:`quantize` its output; returns (operand, extras)."""
        y, _, _, extras = run(None, None)
        return self.quantize(y), extras


class IdentityQuantizer(Quantizer):
    """High precision: the operand is the tensor itself."""

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return x


IDENTITY = IdentityQuantizer()


class Float8Quantizer(Quantizer):
    """Delayed scaling: cast with the current ``scale[index]`` of a state and record max|x| into its history.

    q = cast_fp8(clip(x * scale[i])); amax_history[0, i] = max(amax_history[0, i], max|x|)
    (a module called twice in one step keeps the larger amax).
    """

    is_fp8 = True

    def __init__(self, state, index: int):
        self.state = state
        self.index = index

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.state.fp8_dtype

    @property
    def scale(self) -> torch.Tensor:
        """The 0-d scale this quantizer casts with."""
        return self.state.scale[self.index]

    def record(self, amax: torch.Tensor) -> None:
        """amax_history[0, i] = max(amax_history[0, i], amax)."""
        row = self.state.amax_history[0]
        row[self.index] = torch.maximum(row[self.index], amax.to(row.dtype))

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        q, scale_inv, amax = ops.quantize(x, self.scale, self.fp8_dtype)
        self.record(amax)
        return Float8Tensor(q, scale_inv)

    def produce(self, run: ProducerFn):
        """Fused cast: the producer writes FP8 with this scale and reports the amax of its output."""
        q, scale_inv, amax, extras = run(self.scale, self.fp8_dtype)
        self.record(amax)
        return Float8Tensor(q, scale_inv), extras


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: scale = fp8_max / max|x| of the tensor being cast (see :func:`amax_to_scale`)."""

    is_fp8 = True

    def __init__(self, fp8_dtype: torch.dtype, qparams: QParams):
        self.fp8_dtype = fp8_dtype
        self.qparams = qparams

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        scale = amax_to_scale(ops.compute_amax(x), fp8_max(self.fp8_dtype), self.qparams)
        q, scale_inv, _ = ops.quantize(x, scale, self.fp8_dtype)
        return Float8Tensor(q, scale_inv)


class AmaxObserver(Quantizer):
    """Calibration: record max|x| into a delayed-scaling slot and keep computing in high precision."""

    def __init__(self, target: Float8Quantizer):
        self.target = target

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        self.target.record(ops.compute_amax(x))
        return x
