"""Flax ``LayerNorm`` (layernorm or rmsnorm), and the norm parameters shared with the fused modules.

Parameters: ``scale`` (gamma; ones, or zeros when zero_centered_gamma) and, for layernorm only,
``ln_bias`` (beta). The math runs in float32 (see ``transformer_engine.jax.layernorm``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..layernorm import canonicalize_norm_type, layernorm
from ._base import Initializer, check_output_dtype, logical_param

__all__ = ["LayerNorm"]


def norm_params(module: nn.Module, hidden: int, bias_init: Initializer, bias_axes) -> Tuple[jax.Array, Optional[jax.Array]]:
    """Create (gamma, beta) of ``module`` (beta None for rmsnorm) in its ``dtype``.

    Reads ``layernorm_type``, ``zero_centered_gamma``, ``scale_init`` and ``scale_axes`` from the module.
    """
    norm_type = canonicalize_norm_type(module.layernorm_type)
    scale_init = module.scale_init
    if scale_init is None:
        scale_init = nn.initializers.zeros if module.zero_centered_gamma else nn.initializers.ones
    gamma = logical_param(module, "scale", scale_init, (hidden,), module.dtype, module.scale_axes)
    beta = None
    if norm_type == "layernorm":
        beta = logical_param(module, "ln_bias", bias_init, (hidden,), module.dtype, bias_axes)
    return gamma, beta


class LayerNorm(nn.Module):
    """Layer normalization over the last axis: (x - mean) * rsqrt(var + eps) * gamma + beta.

    With ``layernorm_type="rmsnorm"``: x * rsqrt(mean(x^2) + eps) * gamma. With
    ``zero_centered_gamma``, (1 + gamma) replaces gamma.

    Attributes:
        epsilon: added to the variance.
        layernorm_type: "layernorm" or "rmsnorm".
        zero_centered_gamma: gamma is stored as (gamma - 1).
        scale_init: gamma initializer (None = ones, or zeros when zero-centered).
        scale_axes: logical axes of gamma.
        bias_init: beta initializer; bias_axes: its logical axes.
        dtype: parameter dtype (the computation runs in float32, the output in the input dtype).
        transpose_batch_sequence: inputs are (seq, batch, hidden); no effect on the math.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> ln = LayerNorm()
        >>> variables = ln.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
        >>> sorted(variables["params"])
        ['ln_bias', 'scale']
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ("embed",)
    dtype: jnp.dtype = jnp.float32
    transpose_batch_sequence: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalize ``x`` over its last axis; returns x's shape and dtype."""
        gamma, beta = norm_params(self, x.shape[-1], self.bias_init, self.bias_axes)
        y = layernorm(
            x, gamma.astype(x.dtype), None if beta is None else beta.astype(x.dtype),
            self.layernorm_type, self.zero_centered_gamma, self.epsilon,
        )
        check_output_dtype(self, x, y)
        return y
