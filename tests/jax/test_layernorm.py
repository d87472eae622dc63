"""layernorm / rmsnorm against the float64 formulas, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.layernorm import canonicalize_norm_type, layernorm

from ._utils import assert_allclose, randn


def _np_norm(x, gamma, beta, norm_type, zero_centered, eps):
    x, gamma = np.asarray(x, np.float64), np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0)
    if norm_type == "rmsnorm":
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * gamma
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + np.asarray(beta, np.float64)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_forward_and_grads(norm_type, zero_centered, dtype):
    hidden = 37  # odd width
    x = randn(1, (3, 5, hidden), dtype, scale=2.0) + 0.5
    gamma = randn(2, (hidden,), dtype, scale=0.1) + (0.0 if zero_centered else 1.0)
    beta = randn(3, (hidden,), dtype, scale=0.1) if norm_type == "layernorm" else None
    dy = randn(4, x.shape, dtype)

    @jax.jit
    def run(x, gamma, beta):
        f = lambda x, g, b: layernorm(x, g, b, norm_type, zero_centered, 1e-5)  # noqa: E731
        y, vjp = jax.vjp(f, x, gamma, beta)
        return y, vjp(dy)

    y, grads = run(x, gamma, beta)
    assert y.dtype == dtype
    assert_allclose(y, _np_norm(x, gamma, beta, norm_type, zero_centered, 1e-5), dtype)
    # Gradients of the float64 formula by central differences along a random direction.
    direction = np.asarray(randn(5, x.shape), np.float64)
    h = 1e-4
    plus = _np_norm(np.asarray(x, np.float64) + h * direction, gamma, beta, norm_type, zero_centered, 1e-5)
    minus = _np_norm(np.asarray(x, np.float64) - h * direction, gamma, beta, norm_type, zero_centered, 1e-5)
    expected = np.sum((plus - minus) / (2 * h) * np.asarray(dy, np.float64))
    got = np.sum(np.asarray(grads[0], np.float64) * direction)
    np.testing.assert_allclose(got, expected, rtol=3e-2 if dtype == jnp.bfloat16 else 1e-4)


def test_norm_type_names_and_errors():
    assert canonicalize_norm_type("RMS_Norm") == "rmsnorm" and canonicalize_norm_type("Layer-Norm") == "layernorm"
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="norm_type"):
        layernorm(x, jnp.ones(4), None, "batchnorm")
    with pytest.raises(ValueError, match="gamma shape"):
        layernorm(x, jnp.ones(3), jnp.zeros(4), "layernorm")
    with pytest.raises(ValueError, match="no beta"):
        layernorm(x, jnp.ones(4), jnp.zeros(4), "rmsnorm")
    with pytest.raises(NotImplementedError, match="layernorm_dense"):
        layernorm(x, jnp.ones(4), jnp.zeros(4), "layernorm", quantizer=object())
