"""LayerNorm / RMSNorm forward (optionally writing the FP8 GEMM operand directly) and backward.

    LayerNorm: y = (x - mean) * rstd * gamma_eff + beta,   rstd = 1 / sqrt(Var[x] + eps)
    RMSNorm:   y = x * rstd * gamma_eff,                   rstd = 1 / sqrt(mean(x^2) + eps)
    gamma_eff = 1 + gamma with ``zero_centered_gamma``, else gamma

One place knows the two kinds; modules hold a :class:`NormConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from transformer_engine.plugin import ops

from ..quantization.quantizer import Quantizer

__all__ = ["NORMALIZATIONS", "NormConfig", "norm_backward", "norm_forward"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class NormConfig:
    """Which normalization and its settings.

    Attributes:
        kind: "LayerNorm" or "RMSNorm".
        eps: added to the variance (mean square).
        zero_centered_gamma: use 1 + gamma.
    """

    kind: str
    eps: float
    zero_centered_gamma: bool = False

    def __post_init__(self):
        if self.kind not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.kind!r} is not supported; use 'LayerNorm' or 'RMSNorm'")

    @property
    def has_bias(self) -> bool:
        """LayerNorm has beta; RMSNorm has none."""
        return self.kind == "LayerNorm"


def norm_forward(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], cfg: NormConfig,
                 quantizer: Quantizer, out_dtype: torch.dtype, columnwise: bool = False):
    """Normalize the rows of x [M, H] and hand the result to ``quantizer`` (fused cast where it can;
    ``columnwise``: backward reads its transposed copy, see ``Quantizer.produce``).

    Returns:
        (y, stats): y as GEMM operand (FP8 or ``out_dtype``); stats = (mean, rstd) or (rstd,), float32 [M].
    """

    def run(fp8_scale, fp8_dtype, amax_out):
        if cfg.kind == "LayerNorm":
            y, mean, rstd, scale_inv, amax = ops.layernorm_fwd(
                x, gamma, beta, eps=cfg.eps, zero_centered_gamma=cfg.zero_centered_gamma, fp8_scale=fp8_scale,
                fp8_dtype=fp8_dtype, out_dtype=out_dtype, amax_out=amax_out,
            )
            return y, scale_inv, amax, (mean, rstd)
        y, rstd, scale_inv, amax = ops.rmsnorm_fwd(
            x, gamma, eps=cfg.eps, zero_centered_gamma=cfg.zero_centered_gamma, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype,
            out_dtype=out_dtype, amax_out=amax_out,
        )
        return y, scale_inv, amax, (rstd,)

    return quantizer.produce(run, columnwise=columnwise)


def norm_backward(dy: torch.Tensor, x: torch.Tensor, stats: Tuple[torch.Tensor, ...], gamma: torch.Tensor,
                  cfg: NormConfig) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(dx, dgamma, dbeta) of :func:`norm_forward`; dbeta is None for RMSNorm."""
    if cfg.kind == "LayerNorm":
        mean, rstd = stats
        return ops.layernorm_bwd(dy, x, mean, rstd=rstd, weight=gamma, zero_centered_gamma=cfg.zero_centered_gamma)
    (rstd,) = stats
    dx, dgamma = ops.rmsnorm_bwd(dy, x, rstd, weight=gamma, zero_centered_gamma=cfg.zero_centered_gamma)
    return dx, dgamma, None
