"""layernorm_dense: norm then GEMM, against float64, with and without FP8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.jax.layernorm_dense import layernorm_dense
from transformer_engine.jax.quantize import QuantizerFactory, noop_quantizer_set

from ._utils import assert_allclose, randn, sqnr


def _np_ln(x, gamma, beta, eps=1e-6):
    x = np.asarray(x, np.float64)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


@pytest.mark.parametrize("fp8", [False, True])
def test_layernorm_dense(fp8):
    x, kernel = randn(1, (2, 16, 64)), randn(2, (64, 3, 24), scale=0.125)
    gamma, beta, bias = randn(3, (64,), scale=0.1) + 1.0, randn(4, (64,), scale=0.1), randn(5, (3, 24))
    dy = randn(6, (2, 16, 3, 24))
    qs = QuantizerFactory.create_set(Float8CurrentScaling()) if fp8 else noop_quantizer_set

    @jax.jit
    def run(x, kernel):
        f = lambda x, k: layernorm_dense(x, k, gamma, beta, bias, quantizer_set=qs)  # noqa: E731
        y, vjp = jax.vjp(f, x, kernel)
        return y, vjp(dy)[1]

    y, dk = run(x, kernel)
    ln = _np_ln(x, np.asarray(gamma, np.float64), np.asarray(beta, np.float64))
    y_ref = np.einsum("bsk,kfn->bsfn", ln, np.asarray(kernel, np.float64)) + np.asarray(bias, np.float64)
    dk_ref = np.einsum("bsk,bsfn->kfn", ln, np.asarray(dy, np.float64))
    if fp8:
        assert_allclose(y, y_ref, jnp.float8_e4m3fn, normalize=True)
        assert_allclose(dk, dk_ref, jnp.float8_e5m2, normalize=True)
        assert sqnr(y_ref, y) > 25.0 and sqnr(dk_ref, dk) > 18.0
    else:
        assert_allclose(y, y_ref, jnp.float32)
        assert_allclose(dk, dk_ref, jnp.float32)
