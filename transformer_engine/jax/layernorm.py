"""LayerNorm and RMSNorm over the last axis, computed in float32 and returned in the input dtype.

    layernorm: y = (x - mean(x)) * rsqrt(var(x) + eps) * gamma + beta
    rmsnorm:   y = x * rsqrt(mean(x^2) + eps) * gamma
    zero_centered_gamma: gamma is replaced by (1 + gamma) in both.

Gradients come from JAX autodiff of these float32 formulas (XLA fuses them into a few kernels).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["layernorm", "canonicalize_norm_type"]

_NORM_TYPES = ("layernorm", "rmsnorm")


def canonicalize_norm_type(norm_type: str) -> str:
    """'LayerNorm', 'layer_norm', 'RMS-Norm', ... -> 'layernorm' or 'rmsnorm'.

    Raises:
        ValueError: an unknown name.
    """
    name = str(norm_type).lower().replace("-", "").replace("_", "")
    if name not in _NORM_TYPES:
        raise ValueError(f"norm_type must be one of {list(_NORM_TYPES)}, got {norm_type!r}")
    return name


def _check(x, gamma, beta, norm_type: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"layernorm: x must be floating point, got dtype {x.dtype}")
    if tuple(gamma.shape) != x.shape[-1:]:
        raise ValueError(f"layernorm: gamma shape {tuple(gamma.shape)} must be {x.shape[-1:]} (x's last axis)")
    if norm_type == "rmsnorm" and beta is not None:
        raise ValueError("layernorm: rmsnorm has no beta; pass beta=None")
    if norm_type == "layernorm" and (beta is None or tuple(beta.shape) != x.shape[-1:]):
        got = None if beta is None else tuple(beta.shape)
        raise ValueError(f"layernorm: beta shape {got} must be {x.shape[-1:]} for norm_type='layernorm'")


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer=None,
) -> jax.Array:
    """Normalize ``x`` over its last axis (see the module docstring for the formulas).

    Args:
        x: input (..., hidden); gamma: scale (hidden,); beta: shift (hidden,) or None for rmsnorm.
        norm_type: 'layernorm' or 'rmsnorm' (case, '-' and '_' ignored).
        zero_centered_gamma: use (1 + gamma) as the scale.
        epsilon: added to the variance (or mean square).
        quantizer: must be None (the FP8 cast of the output happens in the following dense).

    Returns:
        y with x's shape and dtype.

    Raises:
        ValueError: wrong shapes or norm type. TypeError: integer input.
        NotImplementedError: a quantizer.

    Example:
        >>> y = layernorm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2), "layernorm")
        >>> [round(float(v), 3) for v in y[0]]
        [-1.0, 1.0]
    """
    norm_type = canonicalize_norm_type(norm_type)
    if quantizer is not None:
        raise NotImplementedError(
            "layernorm: a quantized output is not implemented; use layernorm_dense(..., quantizer_set=...)"
        )
    _check(x, gamma, beta, norm_type)
    x32 = x.astype(jnp.float32)
    gamma32 = gamma.astype(jnp.float32) + (1.0 if zero_centered_gamma else 0.0)
    if norm_type == "rmsnorm":
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon) * gamma32
    else:
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + epsilon) * gamma32 + beta.astype(jnp.float32)
    return y.astype(x.dtype)
