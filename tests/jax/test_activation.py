"""activation: each activation and the gated products against float64 formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.activation import activation, canonicalize_activations

from ._utils import assert_allclose, randn

_F64 = {
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "squared_relu": lambda x: np.maximum(x, 0) ** 2,
    "linear": lambda x: x,
}

COMBOS = [(n,) for n in _F64 if n != "linear"] + [("gelu", "linear"), ("linear", "silu"), ("relu", "squared_relu")]


def test_activations_match_float64():
    x = randn(1, (4, 2, 53), scale=2.0)  # (tokens, n_acts <= 2, odd width)

    @jax.jit
    def run(x):
        return [activation(x[:, : len(c)], c) for c in COMBOS]

    x64 = np.asarray(x, np.float64)
    for combo, got in zip(COMBOS, run(x)):
        names = canonicalize_activations(combo)
        want = np.prod([_F64[n](x64[:, i]) for i, n in enumerate(names)], axis=0)
        assert_allclose(got, want, jnp.float32)


def test_gated_gradient_bf16():
    x, dy = randn(2, (3, 2, 16), jnp.bfloat16), randn(3, (3, 16), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(activation(x, ("gelu", "linear")).astype(jnp.float32) * dy)))(x)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    h = 1e-6
    dgelu = (_F64["gelu"](x64[:, 0] + h) - _F64["gelu"](x64[:, 0] - h)) / (2 * h)
    want = np.stack([dgelu * x64[:, 1] * dy64, _F64["gelu"](x64[:, 0]) * dy64], axis=1)
    assert grad.dtype == jnp.bfloat16
    assert_allclose(grad, want, jnp.bfloat16)


def test_activation_errors():
    with pytest.raises(ValueError, match="axis -2 of size 2"):
        activation(jnp.ones((3, 1, 4)), ("gelu", "linear"))
    with pytest.raises(ValueError, match="must be one of"):
        activation(jnp.ones((3, 1, 4)), ("swish2",))
    with pytest.raises(NotImplementedError, match="act_params"):
        activation(jnp.ones((3, 1, 4)), ("gelu",), act_params={"limit": 7.0})
