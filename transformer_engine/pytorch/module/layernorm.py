"""``LayerNorm``: y = (x - mean) / sqrt(Var[x] + eps) * gamma + beta over the last dims (TE's module).

The shared ``_Normalization`` base also serves :class:`~.rmsnorm.RMSNorm`.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Union

import torch

from .._checks import check_eps
from .._functions.common import apply_without_torch_autocast
from .._functions.norm import NormConfig
from .._functions.norm_function import NormArgs, NormFunction
from ._params import add_norm_params
from .base import ParallelConfig, TransformerEngineBaseModule, default_device, resolve_params_dtype

__all__ = ["LayerNorm"]

_KWARGS = ("device", "dtype", "sm_margin")
_NN_FLAGS = ("elementwise_affine", "bias")  # torch.nn.LayerNorm's, so the classes can be swapped


class _Normalization(TransformerEngineBaseModule):
    """Base of LayerNorm and RMSNorm: TE's signature, parameters ``weight`` (and ``bias``), one Function."""

    _KIND = ""

    def __init__(self, normalized_shape: Union[int, Iterable[int], None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None, **kwargs):
        super().__init__(0)
        _check_kwargs(type(self).__name__, kwargs)
        self.normalized_shape = _resolve_shape(normalized_shape, hidden_size)
        check_eps(type(self).__name__, eps)
        self.eps, self.zero_centered_gamma = float(eps), zero_centered_gamma
        self.parallel = ParallelConfig(sequence_parallel=bool(sequence_parallel))
        self.norm = NormConfig(self._KIND, self.eps, zero_centered_gamma=zero_centered_gamma)
        if params_dtype is not None:
            warnings.warn("params_dtype is deprecated; use dtype", DeprecationWarning, stacklevel=3)
        device = default_device(kwargs.get("device"))
        add_norm_params(self, "", self.normalized_shape, self.norm, dtype=resolve_params_dtype(params_dtype, kwargs.get("dtype")),
                        device=device, sequence_parallel=self.sequence_parallel)
        self.reset_parameters(defer_init=device.type == "meta")

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize ``inp`` over its last ``len(normalized_shape)`` dims; output in the input (or torch.autocast) dtype."""
        if not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point torch.Tensor input, got {getattr(inp, 'dtype', type(inp))}")
        k = len(self.normalized_shape)
        if tuple(inp.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"{type(self).__name__} normalizes the last dims {self.normalized_shape}, got input shape {tuple(inp.shape)}")
        on = torch.is_autocast_enabled(inp.device.type)
        dtype = torch.get_autocast_dtype(inp.device.type) if on else inp.dtype
        args = NormArgs(self.norm, dtype, math.prod(self.normalized_shape))
        return apply_without_torch_autocast(NormFunction, inp.device, inp, self.weight, self.bias, args)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


def _check_kwargs(owner: str, kwargs: dict) -> None:
    """TE's kwargs (device, dtype, sm_margin), plus torch.nn.LayerNorm's ``elementwise_affine`` / ``bias`` at True."""
    unknown = sorted(set(kwargs) - set(_KWARGS) - set(_NN_FLAGS))
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword arguments {unknown}; accepted: {list(_KWARGS + _NN_FLAGS)}")
    for flag in _NN_FLAGS:
        if not kwargs.get(flag, True):
            raise NotImplementedError(f"{owner}({flag}=False) is not supported: the norm always has learnable parameters")


def _resolve_shape(normalized_shape, hidden_size):
    if hidden_size is not None:
        warnings.warn("hidden_size is deprecated; use normalized_shape", DeprecationWarning, stacklevel=4)
        if normalized_shape is not None:
            raise ValueError("pass normalized_shape or hidden_size (deprecated), not both")
        normalized_shape = hidden_size
    if normalized_shape is None:
        raise TypeError("normalized_shape is required")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}")
    return shape


class LayerNorm(_Normalization):
    """Layer normalization: y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta (gamma -> 1 + gamma with zero_centered_gamma).

    Args:
        normalized_shape: size (or sizes) of the normalized last dims.
        eps: added to the variance.
        sequence_parallel: marks the parameters ``sequence_parallel`` (Megatron).
        params_dtype: deprecated alias of ``dtype``.
        zero_centered_gamma: learn gamma around 0 (initialized to 0), applied as 1 + gamma.
        hidden_size: deprecated alias of ``normalized_shape``.
        **kwargs: ``device`` (None = current CUDA device if any, else CPU; "meta" defers init),
            ``dtype`` (parameter dtype), ``sm_margin`` (accepted, unused); ``torch.nn.LayerNorm``'s
            ``elementwise_affine`` and ``bias`` are accepted at True.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> ln = te.LayerNorm(8, eps=1e-5)
        >>> y = ln(torch.randn(2, 8))
        >>> bool(y.mean(-1).abs().max() < 1e-5)
        True
    """

    _KIND = "LayerNorm"
