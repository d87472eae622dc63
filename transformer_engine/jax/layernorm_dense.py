"""LayerNorm (or RMSNorm) followed by a dense GEMM over the last axis: y = norm(x) . W (+ b).

The normalized output is what the dense quantizes (FP8) when a quantizer set is given; XLA fuses
the norm with that cast. Gradients: autodiff through the norm, the dense's custom VJP for the GEMMs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from .dense import dense
from .layernorm import layernorm
from .quantize import QuantizerSet, noop_quantizer_set
from .sharding import with_sharding_constraint_by_logical_axes

__all__ = ["layernorm_dense"]


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    bias: Optional[jax.Array] = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    layernorm_input_axes: Optional[Sequence[str]] = None,
    dot_input_axes: Optional[Sequence[str]] = None,
    kernel_axes: Optional[Sequence[str]] = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """y = norm(x) . kernel (+ bias): x (..., hidden), kernel (hidden, N...), y (..., N...).

    Args follow :func:`layernorm` and :func:`dense`; the ``*_axes`` are logical axis names for
    sharding constraints on x before the norm, on the normalized x, and on the kernel.

    Example:
        >>> import jax.numpy as jnp
        >>> layernorm_dense(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones(4), jnp.zeros(4)).shape
        (2, 3)
    """
    x = with_sharding_constraint_by_logical_axes(x, layernorm_input_axes)
    normed = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    return dense(
        normed, kernel, bias, contracting_dims=((x.ndim - 1,), (0,)),
        transpose_batch_sequence=transpose_batch_sequence, input_axes=dot_input_axes,
        kernel_axes=kernel_axes, quantizer_set=quantizer_set,
    )
