"""Reference (pure PyTorch) LayerNorm and RMSNorm. See plugin/catalog/normalization.py for the contract.

x is viewed as [M, H] (H = last dim); statistics and all math are float32; gamma_eff = 1 + gamma
with ``zero_centered_gamma``, else gamma.

    LayerNorm: mean = E[x], rstd = 1 / sqrt(Var[x] + eps), x_hat = (x - mean) rstd,
               y = x_hat gamma_eff + beta
               VJP: g = dy gamma_eff, dx = rstd (g - mean(g) - x_hat mean(g x_hat)),
               dgamma = sum_rows(dy x_hat), dbeta = sum_rows(dy)
    RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps), x_hat = x rstd, y = x_hat gamma_eff
               VJP: dx = rstd (g - x_hat mean(g x_hat)), dgamma = sum_rows(dy x_hat)

With ``fp8_scale`` the float32 y is quantized directly (no rounding to x's dtype first, as TE's
fused kernels do): (q, scale_inv, amax) as in ``quantize``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.plugin.backends._checks import check_norm_bwd, check_norm_fwd

from .._fp8 import quantize_fp32

__all__ = ["layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd"]


def _gamma_eff(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.float()
    return gamma + 1.0 if zero_centered_gamma else gamma


def _finish_fwd(y_f32: torch.Tensor, x: torch.Tensor, fp8_scale, fp8_dtype, out_dtype, amax_out) -> Tuple:
    """(y, scale_inv, amax): y quantized when ``fp8_scale`` is given, else in out_dtype (default x's)."""
    if fp8_scale is not None:
        return quantize_fp32(y_f32, fp8_scale, fp8_dtype, amax_out)
    return y_f32.to(out_dtype or x.dtype), None, None


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    return t.float().reshape(-1, hidden)


def layernorm_fwd(x, weight, bias, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    """y = (x - mean) * rstd * gamma_eff + beta over the last dim; statistics in float32.

    Args:
        x: [..., H] float32/bfloat16/float16.
        weight, bias: gamma and beta, [H] (bias may be None: no shift).
        eps: added to the variance.
        zero_centered_gamma: use 1 + gamma.
        fp8_scale, fp8_dtype: quantize y with this per-tensor scale (both or neither).
        out_dtype: dtype of an unquantized y (default x's dtype; ignored with fp8_scale).
        amax_out: with fp8_scale, a float32 slot that also receives max(amax_out, amax) (catalog).

    Returns:
        (y like x, mean [M] float32, rstd [M] float32, scale_inv, amax); the last two are None
        unless y is FP8.

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: weight/bias not [H], eps < 0,
        fp8_dtype without fp8_scale or not an FP8 dtype.
    """
    check_norm_fwd(x, weight, bias, eps, fp8_scale, fp8_dtype, out_dtype, amax_out)
    x_rows = _rows(x, x.shape[-1])
    mean = x_rows.mean(dim=-1)
    x_mu = x_rows - mean[:, None]
    rstd = torch.rsqrt((x_mu * x_mu).mean(dim=-1) + eps)
    y = x_mu * rstd[:, None] * _gamma_eff(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    y, scale_inv, amax = _finish_fwd(y.reshape(x.shape), x, fp8_scale, fp8_dtype, out_dtype, amax_out)
    return y, mean, rstd, scale_inv, amax


def layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma=False):
    """dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma_eff; dgamma, dbeta summed over rows.

    Returns:
        (dx like x, dgamma [H] and dbeta [H] in weight's dtype).

    Raises:
        TypeError / ValueError: shapes or dtypes that do not fit the forward's.
    """
    check_norm_bwd(dy, x, (("mean", mean), ("rstd", rstd)), weight)
    hidden = x.shape[-1]
    dy_rows, rstd_col = _rows(dy, hidden), rstd.float().reshape(-1, 1)
    x_hat = (_rows(x, hidden) - mean.float().reshape(-1, 1)) * rstd_col
    g = dy_rows * _gamma_eff(weight, zero_centered_gamma)
    dx = rstd_col * (g - g.mean(dim=-1, keepdim=True) - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    dgamma = (dy_rows * x_hat).sum(dim=0)
    return dx.reshape(x.shape).to(x.dtype), dgamma.to(weight.dtype), dy_rows.sum(dim=0).to(weight.dtype)


def rmsnorm_fwd(x, weight, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    """y = x * rstd * gamma_eff, rstd = 1 / sqrt(mean(x^2) + eps) over the last dim, in float32.

    Args: as :func:`layernorm_fwd`, without bias.

    Returns:
        (y like x, rstd [M] float32, scale_inv, amax); the last two are None unless y is FP8.

    Raises:
        TypeError / ValueError: as :func:`layernorm_fwd`.
    """
    check_norm_fwd(x, weight, None, eps, fp8_scale, fp8_dtype, out_dtype, amax_out)
    x_rows = _rows(x, x.shape[-1])
    rstd = torch.rsqrt((x_rows * x_rows).mean(dim=-1) + eps)
    y = x_rows * rstd[:, None] * _gamma_eff(weight, zero_centered_gamma)
    y, scale_inv, amax = _finish_fwd(y.reshape(x.shape), x, fp8_scale, fp8_dtype, out_dtype, amax_out)
    return y, rstd, scale_inv, amax


def rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma=False):
    """dx = rstd (g - x_hat mean(g x_hat)), g = dy gamma_eff, x_hat = x rstd; dgamma = sum_rows(dy x_hat).

    Returns:
        (dx like x, dgamma [H] in weight's dtype).

    Raises:
        TypeError / ValueError: shapes or dtypes that do not fit the forward's.
    """
    check_norm_bwd(dy, x, (("rstd", rstd),), weight)
    hidden = x.shape[-1]
    dy_rows, rstd_col = _rows(dy, hidden), rstd.float().reshape(-1, 1)
    x_hat = _rows(x, hidden) * rstd_col
    g = dy_rows * _gamma_eff(weight, zero_centered_gamma)
    dx = rstd_col * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    return dx.reshape(x.shape).to(x.dtype), (dy_rows * x_hat).sum(dim=0).to(weight.dtype)

