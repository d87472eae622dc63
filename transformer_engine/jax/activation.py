"""Activations and gated linear units over activations stacked on axis -2.

The input has shape (..., n, H): slice i goes through activation i and the n results are
multiplied, y = prod_i act_i(x[..., i, :]) of shape (..., H). For example ("gelu", "linear") is
GeGLU: y = gelu(x0) * x1 ("linear" is moved to the second place, whatever order it was given in).

    gelu(x)         = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))      (tanh approximation)
    silu(x)         = x sigmoid(x)          quick_gelu(x) = x sigmoid(1.702 x)
    relu(x)         = max(x, 0)             squared_relu(x) = relu(x)^2        linear(x) = x

Computed in float32, returned in the input dtype; gradients by autodiff.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

__all__ = ["activation", "ACTIVATIONS", "canonicalize_activations"]

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "squared_relu": lambda x: jnp.square(jax.nn.relu(x)),
    "linear": lambda x: x,
}


def canonicalize_activations(activation_type: Sequence[str]) -> Tuple[str, ...]:
    """Lower-case names with "linear" moved to the second place of a gated pair.

    Raises:
        ValueError: an unknown name or an empty sequence.
    """
    names = tuple(str(a).lower() for a in ([activation_type] if isinstance(activation_type, str) else activation_type))
    unknown = [a for a in names if a not in ACTIVATIONS]
    if unknown or not names:
        raise ValueError(f"activation_type {tuple(activation_type)!r}: each must be one of {sorted(ACTIVATIONS)}")
    if len(names) == 2 and names[0] == "linear":
        names = (names[1], names[0])
    return names


def activation(x: jax.Array, activation_type: Sequence[str], quantizer=None, act_params=None) -> jax.Array:
    """y = prod_i act_i(x[..., i, :]) for x of shape (..., len(activation_type), H).

    Args:
        x: the stacked pre-activations.
        activation_type: activation names, one per slice of axis -2.
        quantizer: must be None (the FP8 cast happens in the following dense).
        act_params: must be None (clamped activations are not implemented).

    Raises:
        ValueError: x.shape[-2] differs from the number of activations, or an unknown name.
        NotImplementedError: a quantizer or act_params.

    Example:
        >>> float(activation(jnp.array([[-1.0], [3.0]]), ("relu", "linear"))[0])
        0.0
    """
    names = canonicalize_activations(activation_type)
    if quantizer is not None or act_params is not None:
        raise NotImplementedError(
            "activation: quantizer and act_params are not implemented (pass None); "
            "FP8 is applied by the dense that follows"
        )
    if x.ndim < 2 or x.shape[-2] != len(names):
        raise ValueError(
            f"activation: x of shape {x.shape} must have axis -2 of size {len(names)} (one slice per "
            f"activation in {names}); reshape to (..., {len(names)}, H)"
        )
    x32 = x.astype(jnp.float32)
    y = ACTIVATIONS[names[0]](x32[..., 0, :])
    for i, name in enumerate(names[1:], start=1):
        y = y * ACTIVATIONS[name](x32[..., i, :])
    return y.astype(x.dtype)
