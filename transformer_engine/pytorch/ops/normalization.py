"""``LayerNorm`` and ``RMSNorm`` operations over the last ``len(normalized_shape)`` dims, and ``L2Normalization`` (TE's ops).

    LayerNorm:       y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta
    RMSNorm:         y = x / sqrt(mean(x^2) + eps) * gamma
    gamma -> 1 + gamma with ``zero_centered_gamma``
    L2Normalization: y = x / sqrt(sum(x^2) + eps) over the last dim (no parameters; e.g. query-key norm)

LayerNorm and RMSNorm compute in the autocast dtype, else the weight's (x is cast to it); their forward and
backward are the modules' (``_functions.norm_function.NormFunction``). L2Normalization computes in float32 and
rounds once to x's dtype; its backward is autograd's through those tensor ops (which torch.compile fuses).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Union

import torch

from .._functions.common import apply_without_torch_autocast
from .._functions.norm import NormConfig
from .._functions.norm_function import NormArgs, NormFunction
from ..module.base import default_device
from .op import BasicOperation, high_precision

__all__ = ["L2Normalization", "LayerNorm", "RMSNorm"]


class _Normalization(BasicOperation):
    """The shared body of :class:`LayerNorm` and :class:`RMSNorm` (``_KIND`` picks the math)."""

    _KIND = ""

    def __init__(self, normalized_shape: Union[int, Iterable[int]], *, eps: float = 1e-5,
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, sm_margin: Union[int, Dict[str, int]] = 0) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}")
        if not eps >= 0:
            raise ValueError(f"eps={eps!r} must be >= 0")
        self.eps, self.zero_centered_gamma = float(eps), zero_centered_gamma
        self._sm_margin = sm_margin  # a CUDA scheduling hint of TE's kernels: no effect on the result here
        self._norm = NormConfig(self._KIND, self.eps, zero_centered_gamma)
        self._hidden = math.prod(shape)
        device, dtype = default_device(device), dtype or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) if self._norm.has_bias else None
        if device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """gamma = 1 (0 with ``zero_centered_gamma``), beta = 0; "meta" parameters are first materialized."""
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            if param.is_meta:
                param = torch.nn.Parameter(torch.empty_like(param, device=default_device()), requires_grad=param.requires_grad)
                setattr(self, name, param)
            with torch.no_grad():
                param.fill_(1.0 if name == "weight" and not self.zero_centered_gamma else 0.0)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:
            self.reset_parameters()
        shape = self.weight.shape
        if x.dim() < len(shape) or x.shape[-len(shape):] != shape:
            raise ValueError(f"{type(self).__name__} normalizes the last dims {tuple(shape)}, got input shape {tuple(x.shape)}")
        on = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if on else self.weight.dtype
        return apply_without_torch_autocast(NormFunction, x.device, x, self.weight, self.bias, NormArgs(self._norm, dtype, self._hidden))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Normalization):
    """y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta; parameters ``weight`` (gamma) and ``bias`` (beta).

    Args (TE's; all but ``normalized_shape`` keyword-only):
        normalized_shape: size (or sizes) of the normalized last dims.
        eps: added to the variance.
        device: parameter device; None = current CUDA device if any, else CPU; "meta" defers
            initialization to the first forward (or :meth:`reset_parameters`).
        dtype: parameter dtype (default ``torch.get_default_dtype()``).
        zero_centered_gamma: learn gamma around 0 (initialized to 0), applied as 1 + gamma.
        sm_margin: accepted (TE reserves SMs for its CUDA kernels; no effect on the result).

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> y = te_ops.LayerNorm(8, device="cpu")(torch.randn(2, 8))
        >>> bool(y.mean(-1).abs().max() < 1e-5)
        True
    """

    _KIND = "LayerNorm"


class RMSNorm(_Normalization):
    """y = x / sqrt(mean(x^2) + eps) * gamma; its only parameter is ``weight`` (gamma). Args as :class:`LayerNorm`.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> y = te_ops.RMSNorm(8, device="cpu")(torch.randn(2, 8))
        >>> bool(((y ** 2).mean(-1) - 1).abs().max() < 1e-4)
        True
    """

    _KIND = "RMSNorm"


class L2Normalization(BasicOperation):
    """y = x * rsqrt(sum(x^2) + eps) over the last dim (TE's op: a parameter-free norm, e.g. of queries and keys).

    ``seq_length`` and ``micro_batch_size`` are TE's hints to warm up its JIT-fused kernels before training; nothing
    here is compiled ahead, so they change nothing.

    Raises:
        ValueError: ``eps`` < 0.

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.L2Normalization(eps=0.0)(torch.tensor([[3.0, 4.0]])).tolist()
        [[0.6000000238418579, 0.800000011920929]]
    """

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None) -> None:
        super().__init__()
        if not eps >= 0:
            raise ValueError(f"eps={eps!r} must be >= 0")
        self.eps = float(eps)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = high_precision(x)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().sum(dim=-1, keepdim=True) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
