"""te_flax.LayerNormMLP against a pure-Flax MLP with the same parameters, with and without FP8."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

from .._utils import assert_allclose, jit_init, randn, sqnr, unbox

_ACTS = {"gelu": lambda x: nn.gelu(x, approximate=True), "linear": lambda x: x, "silu": nn.silu}


class _RefMLP(nn.Module):
    activations: tuple
    intermediate: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
        h = nn.DenseGeneral((len(self.activations), self.intermediate), name="wi")(y)
        a = h[..., 0, :] * 0 + 1
        for i, name in enumerate(self.activations):
            a = a * _ACTS[name](h[..., i, :])
        return nn.Dense(x.shape[-1], name="wo")(a)


def _ref_params(p):
    return {"ln": {"scale": p["scale"], "bias": p["ln_bias"]},
            "wi": {"kernel": p["wi_kernel"], "bias": p["wi_bias"]},
            "wo": {"kernel": p["wo_kernel"], "bias": p["wo_bias"]}}


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["no_fp8", "current", "delayed"])
def test_layernorm_mlp_matches_flax(recipe):
    acts = ("gelu", "linear") if recipe is None else ("silu", "linear")
    x, dy = randn(1, (2, 16, 32)), randn(2, (2, 16, 32))
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        mlp = te_flax.LayerNormMLP(intermediate_dim=64, activations=acts, use_bias=True, return_layernorm_output=True)
        variables = jit_init(mlp, x, deterministic=True)
        params = unbox(variables)["params"]
        assert params["wi_kernel"].shape == (32, 2, 64) and params["wi_bias"].shape == (2, 64)
        params["wi_bias"], params["wo_bias"] = randn(3, (2, 64), scale=0.1), randn(4, (32,), scale=0.1)
        variables = {**variables, "params": params}
        if isinstance(recipe, DelayedScaling):
            assert sorted(variables["fp8_metas"]) == sorted(
                f"{q}_{g}_{v}" for q in ("x", "kernel", "grad") for g in "01" for v in ("scale", "amax_history"))

        @jax.jit
        def step(variables):
            (out, ln_out), vjp = jax.vjp(lambda v: mlp.apply(v, x, deterministic=True), variables)
            return out, ln_out, vjp((dy, jnp.zeros_like(ln_out)))[0]

        for _ in range(3 if recipe is not None else 1):
            out, ln_out, grads = step(variables)
            variables = te.update_collections({k: v for k, v in grads.items() if k != "params"}, variables)

    ref = _RefMLP(acts, 64)

    @jax.jit
    def reference(params):
        ref_out, ref_vjp = jax.vjp(lambda p: ref.apply({"params": p}, x), params)
        return ref_out, ref_vjp(dy)[0]

    ref_out, ref_grads = reference(_ref_params(params))
    got_grads = _ref_params(unbox(grads)["params"])
    if recipe is None:
        assert_allclose(out, ref_out, jnp.float32)
        for got, want in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(ref_grads)):
            assert_allclose(got, want, jnp.float32, normalize=True)
    else:
        assert_allclose(out, ref_out, jnp.float8_e4m3fn, normalize=True)
        assert_allclose(got_grads["wi"]["kernel"], ref_grads["wi"]["kernel"], jnp.float8_e5m2, normalize=True)
        assert_allclose(got_grads["wo"]["kernel"], ref_grads["wo"]["kernel"], jnp.float8_e5m2, normalize=True)
        assert sqnr(ref_out, out) > 20.0 and sqnr(ref_grads["wi"]["kernel"], got_grads["wi"]["kernel"]) > 15.0


def test_intermediate_dropout_needs_rng_and_drops():
    x = randn(1, (2, 4, 8))
    mlp = te_flax.LayerNormMLP(intermediate_dim=64, intermediate_dropout_rate=0.5)
    variables = jit_init(mlp, x, deterministic=True)
    apply = jax.jit(lambda v, key: mlp.apply(v, x, deterministic=False, rngs={"dropout": key}))
    kept, _ = jax.jit(lambda v: mlp.apply(v, x, deterministic=True))(variables)
    dropped, _ = apply(variables, jax.random.PRNGKey(1))
    assert not jnp.allclose(kept, dropped)
    with pytest.raises(Exception, match="dropout"):
        mlp.apply(variables, x, deterministic=False)
