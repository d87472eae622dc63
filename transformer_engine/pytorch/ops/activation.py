"""Activation operations (TE's ``ops.GELU`` ... ``ops.ClampedSwiGLU``), forward and backward by the catalog ops.

Element-wise: y = act(x). Gated (GLU variants): x = [a, b] split in halves along the last dim and
y = act(a) * b (TE's convention: the gate is the *first* half, unlike ``torch.nn.functional.glu``).

    GELU  tanh approximation          QGELU  x * sigmoid(1.702 x)      ReLU  max(x, 0)
    SReLU max(x, 0)^2                 SiLU   x * sigmoid(x)
    GLU   sigmoid(a) * b              GEGLU, QGEGLU, ReGLU, SReGLU, SwiGLU: act(a) * b
    ClampedSwiGLU  (GPT-OSS)  min(a, limit) * sigmoid(alpha min(a, limit)) * (clamp(b, -limit, limit) + 1)

``glu_interleave_size`` s (SwiGLU, ClampedSwiGLU): x holds alternating blocks of s gate and s linear
features, [a_1..a_s, b_1..b_s, a_s+1..]; they are gathered into [a, b] first (and dx scattered back).
``cache_quantized_input``: backward keeps x in FP8 E4M3 with a current-scaling scale (less memory,
an FP8 rounding of x in act'(x)). The math of each kernel is in ``plugin/catalog/activation.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.common.recipe import QParams

from .._functions.activation import ActivationConfig
from .._functions.activation_function import ActivationArgs, apply_activation
from ..quantization.quantizer import Float8CurrentScalingQuantizer
from .op import BasicOperation

__all__ = ["ClampedSwiGLU", "GEGLU", "GELU", "GLU", "QGEGLU", "QGELU", "ReGLU", "ReLU", "SReGLU", "SReLU", "SiLU", "SwiGLU"]

_INPUT_CACHE_QUANTIZER = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, QParams())


class _Activation(BasicOperation):
    """An activation op: ``_NAME`` is the catalog's name of the activation.

    Args:
        cache_quantized_input: keep x in FP8 for backward (see the module docstring).
    """

    _NAME = ""

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        self.cache_quantized_input = cache_quantized_input
        self._act = self._config()
        self._cache_quantizer = _INPUT_CACHE_QUANTIZER if cache_quantized_input else None
        self._interleave: Optional[int] = None

    def _config(self) -> ActivationConfig:
        return ActivationConfig.create(self._NAME)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._act.gated and x.shape[-1] % (2 * (self._interleave or 1)):
            raise ValueError(f"{type(self).__name__} splits the last dim into gate and linear halves"
                             f"{'' if self._interleave is None else f' of {self._interleave}-blocks'}; got shape {tuple(x.shape)}")
        on = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if on else x.dtype
        return apply_activation(x, ActivationArgs(self._act, dtype, self._interleave, self._cache_quantizer))


class GELU(_Activation):
    """y = GELU(x), tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    _NAME = "gelu"


class GLU(_Activation):
    """y = sigmoid(a) * b, x = [a, b]."""

    _NAME = "glu"


class GEGLU(_Activation):
    """y = GELU(a) * b, x = [a, b]."""

    _NAME = "geglu"


class QGELU(_Activation):
    """y = x * sigmoid(1.702 x) (quick GELU)."""

    _NAME = "qgelu"


class QGEGLU(_Activation):
    """y = QGELU(a) * b, x = [a, b]."""

    _NAME = "qgeglu"


class ReLU(_Activation):
    """y = max(x, 0)."""

    _NAME = "relu"


class ReGLU(_Activation):
    """y = ReLU(a) * b, x = [a, b]."""

    _NAME = "reglu"


class SReLU(_Activation):
    """y = max(x, 0)^2 (squared ReLU)."""

    _NAME = "srelu"


class SReGLU(_Activation):
    """y = SReLU(a) * b, x = [a, b]."""

    _NAME = "sreglu"


class SiLU(_Activation):
    """y = x * sigmoid(x)."""

    _NAME = "silu"


class SwiGLU(_Activation):
    """y = SiLU(a) * b, x = [a, b].

    Args:
        cache_quantized_input: keep x in FP8 for backward.
        glu_interleave_size: x holds alternating blocks of this many gate / linear features.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.SwiGLU()(torch.randn(2, 8)).shape
        torch.Size([2, 4])
    """

    _NAME = "swiglu"

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        if glu_interleave_size is not None and (isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int)
                                                or glu_interleave_size < 1):
            raise ValueError(f"glu_interleave_size must be None or a positive int, got {glu_interleave_size!r}")
        self.glu_interleave_size = self._interleave = glu_interleave_size


class ClampedSwiGLU(SwiGLU):
    """GPT-OSS's SwiGLU: y = a_c sigmoid(alpha a_c) (b_c + 1), a_c = min(a, limit), b_c = clamp(b, -limit, limit).

    Args:
        limit, alpha: as in the formula.
        glu_linear_offset: must be 1.0 (the +1 of the formula).
        cache_quantized_input, glu_interleave_size: as :class:`SwiGLU`.
    """

    _NAME = "clamped_swiglu"

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
                 cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size)

    def _config(self) -> ActivationConfig:
        return ActivationConfig.create(self._NAME, {"limit": self.limit, "alpha": self.alpha,
                                                    "glu_linear_offset": self.glu_linear_offset})
