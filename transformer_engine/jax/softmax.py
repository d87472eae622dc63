"""Scaled (masked) softmax over the last axis, computed in float32.

    SCALED:                      y = softmax(scale * x)
    SCALED_MASKED:               y = softmax(where(mask, -inf, scale * x))      (mask: 1 = masked out)
    SCALED_UPPER_TRIANG_MASKED:  the mask is j > i (causal, aligned top-left)

"-inf" is float32's lowest finite value, so a row whose every entry is masked becomes uniform
rather than NaN. Gradients by autodiff.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["SoftmaxFusionType", "softmax", "causal_mask"]

_MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


class SoftmaxFusionType(Enum):
    """Which mask the softmax applies."""

    SCALED = "scaled"
    SCALED_MASKED = "scaled_masked"
    SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang_masked"


def causal_mask(q_len: int, kv_len: int, bottom_right: bool = False) -> jax.Array:
    """(q_len, kv_len) bool, True where key j is after query i (offset kv_len - q_len if bottom_right)."""
    offset = kv_len - q_len if bottom_right else 0
    return jnp.arange(kv_len)[None, :] > jnp.arange(q_len)[:, None] + offset


def softmax(
    logits: jax.Array,
    mask: Optional[jax.Array] = None,
    scale_factor: float = 1.0,
    softmax_fusion_type: SoftmaxFusionType = SoftmaxFusionType.SCALED,
) -> jax.Array:
    """Softmax of ``scale_factor * logits`` over the last axis, with the fusion type's mask.

    Args:
        logits: (..., q, k). mask: broadcastable to logits, nonzero = masked out (SCALED_MASKED only).
        scale_factor: multiplies the logits first.
        softmax_fusion_type: a :class:`SoftmaxFusionType`.

    Returns:
        Probabilities with logits' shape and dtype.

    Raises:
        ValueError: SCALED_MASKED without a mask, or a mask with another fusion type.

    Example:
        >>> softmax(jnp.zeros((1, 2)), scale_factor=2.0).tolist()
        [[0.5, 0.5]]
    """
    fusion = SoftmaxFusionType(softmax_fusion_type)
    if (mask is None) == (fusion == SoftmaxFusionType.SCALED_MASKED):
        raise ValueError(
            f"softmax: mask={'None' if mask is None else 'array'} does not fit {fusion}: "
            "SCALED_MASKED needs a mask, SCALED and SCALED_UPPER_TRIANG_MASKED take none"
        )
    x = logits.astype(jnp.float32) * scale_factor
    if fusion == SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED:
        mask = causal_mask(x.shape[-2], x.shape[-1])
    if mask is not None:
        x = jnp.where(mask.astype(bool), _MASKED_LOGIT, x)
    return jax.nn.softmax(x, axis=-1).astype(logits.dtype)
