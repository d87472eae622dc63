"""layernorm_mlp: norm, GEMM, (gated) activation, GEMM, against float64, with and without FP8."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.jax.layernorm_mlp import layernorm_mlp
from transformer_engine.jax.quantize import QuantizerFactory, noop_quantizer_set

from ._utils import assert_allclose, randn, sqnr


def _np_reference(x, gamma, w1, b1, w2, b2):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(gamma, np.float64)  # rmsnorm
    h = np.einsum("tk,kan->tan", y, np.asarray(w1, np.float64)) + np.asarray(b1, np.float64)
    gelu = 0.5 * h[:, 0] * (1 + np.tanh(math.sqrt(2 / math.pi) * (h[:, 0] + 0.044715 * h[:, 0] ** 3)))
    return (gelu * h[:, 1]) @ np.asarray(w2, np.float64) + np.asarray(b2, np.float64)


@pytest.mark.parametrize("fp8", [False, True])
def test_layernorm_mlp_geglu(fp8):
    hidden, inter = 32, 64
    x, gamma = randn(1, (48, hidden)), randn(2, (hidden,), scale=0.1) + 1.0
    w1, b1 = randn(3, (hidden, 2, inter), scale=hidden**-0.5), randn(4, (2, inter), scale=0.1)
    w2, b2 = randn(5, (inter, hidden), scale=inter**-0.5), randn(6, (hidden,), scale=0.1)
    recipe = DelayedScaling(amax_history_len=2)
    sets = tuple(QuantizerFactory.create_set(recipe, QuantizerFactory.create_meta_set(recipe)) for _ in range(2))
    sets = sets if fp8 else (noop_quantizer_set, noop_quantizer_set)

    @jax.jit
    def run(x, sets):
        def f(x, sets):
            return layernorm_mlp(x, gamma, None, (w1, w2), (b1, b2), "rmsnorm",
                                 activation_type=("gelu", "linear"), quantizer_sets=sets)
        y, vjp = jax.vjp(f, x, sets)
        return y, vjp(jnp.ones_like(y))[1]

    for _ in range(3 if fp8 else 1):  # warm up the delayed scales
        y, sets = run(x, sets)
    y_ref = _np_reference(x, gamma, w1, b1, w2, b2)
    if fp8:
        assert_allclose(y, y_ref, jnp.float8_e4m3fn, normalize=True)
        assert sqnr(y_ref, y) > 20.0
        assert float(sets[1].x.meta.scale[0]) != 1.0  # the second GEMM's state moved too
    else:
        assert_allclose(y, y_ref, jnp.float32)


def test_layernorm_mlp_errors():
    x, w1, w2 = jnp.ones((2, 4)), jnp.ones((4, 1, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match="kernels must hold 2"):
        layernorm_mlp(x, jnp.ones(4), jnp.zeros(4), (w1,), (None, None), "layernorm")
    with pytest.raises(NotImplementedError, match="activation_params"):
        layernorm_mlp(x, jnp.ones(4), jnp.zeros(4), (w1, w2), (None, None), "layernorm", activation_params={})
