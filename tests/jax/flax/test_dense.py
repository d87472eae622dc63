"""te_flax.DenseGeneral and LayerNormDenseGeneral against pure Flax, the quick example, FP8 state flow."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common import recipe

from .._utils import assert_allclose, jit_init, randn, sqnr, unbox


def test_seed_quick_example_runs_as_written():
    """The README JAX example (sizes 32x128x1024 cut to 4x16x64 for CPU time), inside te.autocast."""
    BATCH, SEQLEN, HIDDEN = 4, 16, 64
    rng = jax.random.PRNGKey(0)
    init_rng, data_rng = jax.random.split(rng)
    inp = jax.random.normal(data_rng, [BATCH, SEQLEN, HIDDEN], jnp.float32)
    fp8_recipe = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID)
    with te.autocast(enabled=True, recipe=fp8_recipe):
        model = te_flax.DenseGeneral(features=HIDDEN)

        def loss_fn(params, other_vars, inp):
            out = model.apply({"params": params, **other_vars}, inp)
            return jnp.mean(out)

        variables = model.init(init_rng, inp)
        other_variables, params = flax.core.pop(variables, "params")
        fwd_bwd_fn = jax.value_and_grad(loss_fn, argnums=(0, 1))
        for _ in range(10):
            loss, (param_grads, other_grads) = fwd_bwd_fn(params, other_variables, inp)
    assert sorted(other_grads["fp8_metas"]) == sorted(
        f"{q}_{v}" for q in ("x", "kernel", "grad") for v in ("scale", "amax_history"))
    assert other_grads["fp8_metas"]["x_amax_history"].shape == (1024,)
    np.testing.assert_allclose(float(other_grads["fp8_metas"]["x_scale"][0]), 448.0 / float(jnp.max(jnp.abs(inp))),
                               rtol=1e-6)
    assert np.isfinite(float(loss)) and param_grads["kernel"].shape == (HIDDEN, HIDDEN)


def test_ten_jitted_steps_update_fp8_metas_as_specified():
    """10 SGD steps under jax.jit: each step's fp8_metas == the delayed-scaling formula of its inputs."""
    history_len, hidden = 4, 32
    xs = [randn(10 + t, (8, hidden), scale=1.0 + t) for t in range(10)]
    fp8_recipe = recipe.DelayedScaling(amax_history_len=history_len)
    with te.autocast(enabled=True, recipe=fp8_recipe):
        model = te_flax.DenseGeneral(features=hidden, use_bias=False)
        variables = jit_init(model, xs[0])
        optimizer = optax.sgd(0.01)
        opt_state = optimizer.init(variables["params"])

        @jax.jit
        def train_step(variables, opt_state, x):
            loss, grads = jax.value_and_grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(variables)
            updates, opt_state = optimizer.update(grads["params"], opt_state)
            params = optax.apply_updates(variables["params"], updates)
            return te.update_collections({"params": params}, grads), opt_state, loss

        histories = {q: np.zeros(history_len) for q in ("x", "kernel")}
        for x in xs:
            kernel = np.asarray(variables["params"]["kernel"])
            variables, opt_state, loss = train_step(variables, opt_state, x)
            metas = variables["fp8_metas"]
            for q, tensor in (("x", x), ("kernel", kernel)):
                h = histories[q]
                h[0] = np.abs(np.asarray(tensor)).max()
                np.testing.assert_allclose(float(metas[f"{q}_scale"][0]), 448.0 / h.max(), rtol=1e-5)
                h[:] = np.roll(h, -1)
                h[0] = 0.0
                np.testing.assert_allclose(np.asarray(metas[f"{q}_amax_history"]), h, rtol=1e-6)
            assert float(metas["grad_scale"][0]) > 1.0  # e5m2 scale of small gradients
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_general_matches_flax(dtype):
    x, dy = randn(1, (2, 5, 3, 8), dtype), randn(2, (2, 5, 4, 6), dtype)
    layer = te_flax.DenseGeneral(features=(4, 6), axis=(-2, -1), kernel_axes=("a", "b", "c", "d"))
    ref = nn.DenseGeneral(features=(4, 6), axis=(-2, -1), dtype=dtype)
    params = unbox(jit_init(layer, x))["params"]
    assert params["kernel"].shape == (3, 8, 4, 6) and params["bias"].shape == (4, 6)  # use_bias defaults True
    params["bias"] = randn(3, (4, 6))

    @jax.jit
    def run(params, x):
        te_out, te_vjp = jax.vjp(lambda p, x: layer.apply({"params": p}, x), params, x)
        ref_out, ref_vjp = jax.vjp(lambda p, x: ref.apply({"params": p}, x), params, x)
        return te_out, te_vjp(dy), ref_out, ref_vjp(dy)

    te_out, te_grads, ref_out, ref_grads = run(params, x)
    assert te_out.dtype == dtype
    for got, want in zip(jax.tree_util.tree_leaves((te_out, te_grads)), jax.tree_util.tree_leaves((ref_out, ref_grads))):
        assert_allclose(got, want, dtype, normalize=True)


class _RefLayerNormDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
        return nn.Dense(self.features, use_bias=False, name="dense")(y), y


@pytest.mark.parametrize("fp8", [False, True])
def test_layernorm_dense_general_matches_flax(fp8):
    x, dy = randn(1, (4, 8, 32)), randn(2, (4, 8, 16))
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    with te.autocast(enabled=fp8, recipe=fp8_recipe):
        layer = te_flax.LayerNormDenseGeneral(features=16, return_layernorm_output=True, depth_scaling=2.0)
        variables = jit_init(layer, x)
        assert ("fp8_metas" in variables) == fp8

        @jax.jit
        def step(variables):
            (out, ln_out), vjp = jax.vjp(lambda v: layer.apply(v, x), variables)
            return out, ln_out, vjp((dy, jnp.zeros_like(ln_out)))[0]

        for _ in range(3 if fp8 else 1):  # FP8: warm up the delayed scales, feeding back fp8_metas
            out, ln_out, grads = step(variables)
            variables = te.update_collections({k: v for k, v in grads.items() if k != "params"}, variables)
    params = unbox(variables)["params"]
    ref_params = {"ln": {"scale": params["scale"], "bias": params["ln_bias"]}, "dense": {"kernel": params["kernel"]}}
    ref_out, ref_ln = jax.jit(_RefLayerNormDense(16).apply)({"params": ref_params}, x)
    ref_dk = np.einsum("bsk,bsn->kn", np.asarray(ref_ln, np.float64), np.asarray(dy, np.float64)) / 2.0
    assert_allclose(ln_out, ref_ln, jnp.float32)
    if fp8:
        assert_allclose(out, ref_out / 2.0, jnp.float8_e4m3fn, normalize=True)
        assert_allclose(unbox(grads)["params"]["kernel"], ref_dk, jnp.float8_e5m2, normalize=True)
        assert sqnr(ref_out / 2.0, out) > 25.0
    else:
        assert_allclose(out, ref_out / 2.0, jnp.float32)
        assert_allclose(unbox(grads)["params"]["kernel"], ref_dk, jnp.float32, normalize=True)


def test_dense_module_errors():
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="1 logical axes"):
        te_flax.DenseGeneral(features=3, kernel_axes=("embed",)).init(jax.random.PRNGKey(0), jnp.ones((2, 3, 4)))
    with pytest.raises(NotImplementedError, match="LoRA"):
        te_flax.DenseGeneral(features=3, enable_low_rank_adaptation=True).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="axis must be -1"):
        te_flax.LayerNormDenseGeneral(features=3, axis=0).init(jax.random.PRNGKey(0), x)
