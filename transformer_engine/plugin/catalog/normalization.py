"""LayerNorm and RMSNorm, forward (optionally writing FP8) and backward.

gamma_eff = (1 + gamma) when ``zero_centered_gamma`` else gamma. Statistics are float32, one per
row of x viewed as [M, H] (H = last dim). With ``fp8_scale`` given, y is returned quantized
(saturating cast with that scale) together with its scale_inv and the amax of the unquantized y
(accumulated into ``amax_out`` when given, as in ``quantize``); otherwise y is in ``out_dtype``
(default x's dtype), scale_inv and amax are None and ``amax_out`` must be None.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): zero rows (M = 0) give empty results;
an empty last dim (H = 0) raises ValueError
(there is nothing to normalize over); a NaN or inf in a row makes that row's statistics and y NaN
(the FP8 y keeps NaN as NaN codes; the amax skips non-finite values, as everywhere); a non-finite dy
propagates into dx, dgamma and dbeta; x and dy may have any strides.
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype


@declare(mutates=("amax_out",))
def layernorm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centered_gamma: bool = False,
                  fp8_scale: Optional[Tensor] = None, fp8_dtype: Optional[dtype] = None, out_dtype: Optional[dtype] = None,
                  amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """mean = E[x], rstd = 1 / sqrt(Var[x] + eps), y = (x - mean) * rstd * gamma_eff + beta.

    Returns: (y, mean [M], rstd [M], scale_inv, amax).
    """


@declare
def layernorm_bwd(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                  zero_centered_gamma: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """x_hat = (x - mean) * rstd, g = dy * gamma_eff,
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),
    dgamma = sum_rows(dy * x_hat), dbeta = sum_rows(dy).

    Returns: (dx like x, dgamma and dbeta in weight's dtype).
    """


@declare(mutates=("amax_out",))
def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool = False, fp8_scale: Optional[Tensor] = None,
                fp8_dtype: Optional[dtype] = None, out_dtype: Optional[dtype] = None,
                amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * gamma_eff.

    Returns: (y, rstd [M], scale_inv, amax).
    """


@declare
def rmsnorm_bwd(dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, zero_centered_gamma: bool = False) -> Tuple[Tensor, Tensor]:
    """x_hat = x * rstd, g = dy * gamma_eff, dx = rstd * (g - x_hat * mean(g * x_hat)),
    dgamma = sum_rows(dy * x_hat).

    Returns: (dx like x, dgamma in weight's dtype).
    """
