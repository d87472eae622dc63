"""te_flax.LayerNorm against flax.linen.LayerNorm / RMSNorm with the same parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import transformer_engine.jax.flax as te_flax

from .._utils import assert_allclose, jit_init, randn, unbox


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_matches_flax(layernorm_type, zero_centered_gamma):
    x, dy = randn(1, (2, 6, 24), jnp.bfloat16, scale=3.0), randn(2, (2, 6, 24), jnp.bfloat16)
    te_ln = te_flax.LayerNorm(layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma)
    params = unbox(jit_init(te_ln, x))["params"]
    assert sorted(params) == (["ln_bias", "scale"] if layernorm_type == "layernorm" else ["scale"])
    assert float(params["scale"][0]) == (0.0 if zero_centered_gamma else 1.0)
    params = {k: v + randn(3 + i, v.shape, scale=0.1) for i, (k, v) in enumerate(sorted(params.items()))}
    ref_params = {"scale": params["scale"] + (1.0 if zero_centered_gamma else 0.0)}
    if layernorm_type == "layernorm":
        ref, ref_params["bias"] = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32), params["ln_bias"]
    else:
        ref = nn.RMSNorm(epsilon=1e-6, dtype=jnp.float32)

    @jax.jit
    def run(params, ref_params, x):
        te_out, te_vjp = jax.vjp(lambda p, x: te_ln.apply({"params": p}, x), params, x)
        ref_out, ref_vjp = jax.vjp(lambda p, x: ref.apply({"params": p}, x.astype(jnp.float32)), ref_params, x)
        return te_out, te_vjp(dy), ref_out, ref_vjp(dy.astype(jnp.float32))

    te_out, (te_dp, te_dx), ref_out, (ref_dp, ref_dx) = run(params, ref_params, x)
    assert te_out.dtype == jnp.bfloat16
    assert_allclose(te_out, ref_out, jnp.bfloat16)
    assert_allclose(te_dx, ref_dx, jnp.bfloat16)
    assert_allclose(te_dp["scale"], ref_dp["scale"], jnp.bfloat16, normalize=True)
