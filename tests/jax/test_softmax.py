"""softmax: scaled, masked and causal variants against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.softmax import SoftmaxFusionType, softmax

from ._utils import assert_allclose, randn


def _np_softmax(x, scale, mask):
    z = np.asarray(x, np.float64) * scale
    z = np.where(mask, -1e300, z) if mask is not None else z
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_variants(dtype):
    b, h, sq, sk = 2, 3, 7, 7
    x = randn(1, (b, h, sq, sk), dtype, scale=3.0)
    mask = jnp.asarray(np.random.default_rng(0).random((b, 1, sq, sk)) < 0.3).at[:, :, :, 0].set(False)
    causal = np.triu(np.ones((sq, sk), bool), 1)

    @jax.jit
    def run(x, mask):
        return (softmax(x, None, 0.5, SoftmaxFusionType.SCALED),
                softmax(x, mask, 0.5, SoftmaxFusionType.SCALED_MASKED),
                softmax(x, None, 0.5, SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED))

    scaled, masked, upper = run(x, mask)
    assert scaled.dtype == dtype
    assert_allclose(scaled, _np_softmax(x, 0.5, None), dtype)
    assert_allclose(masked, _np_softmax(x, 0.5, np.asarray(mask)), dtype)
    assert_allclose(upper, _np_softmax(x, 0.5, causal), dtype)


def test_softmax_mask_errors():
    with pytest.raises(ValueError, match="SCALED_MASKED needs a mask"):
        softmax(jnp.ones((1, 2)), None, 1.0, SoftmaxFusionType.SCALED_MASKED)
    with pytest.raises(ValueError, match="take none"):
        softmax(jnp.ones((1, 2)), jnp.ones((1, 2)), 1.0, SoftmaxFusionType.SCALED)
