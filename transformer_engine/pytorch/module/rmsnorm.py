"""``RMSNorm``: y = x / sqrt(mean(x^2) + eps) * gamma over the last dims (TE's module)."""

from __future__ import annotations

from .layernorm import _Normalization

__all__ = ["RMSNorm"]


class RMSNorm(_Normalization):
    """Root-mean-square normalization: y = x / sqrt(mean(x^2) + eps) * gamma; its only parameter is ``weight``.

    Same arguments as :class:`~.layernorm.LayerNorm` (``bias`` is None).

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> rms = te.RMSNorm(8)
        >>> y = rms(torch.randn(2, 8))
        >>> bool(((y ** 2).mean(-1) - 1).abs().max() < 1e-4)
        True
    """

    _KIND = "RMSNorm"
