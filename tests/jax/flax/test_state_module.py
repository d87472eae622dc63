"""wrap_function_in_te_state_module, make_dot_general_cls, make_grouped_dense_cls; LayerNormMLP(enable_layernorm=False)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

from .._utils import assert_allclose, randn, sqnr, unbox


def _dense_pair(recipe):
    """(nn.Dense with TE's dot_general under ``recipe``, the plain nn.Dense) of one shape."""
    return nn.Dense(64, dot_general=te_flax.make_dot_general_cls(recipe)()), nn.Dense(64)


def test_dot_general_without_a_recipe_is_the_plain_dense():
    te_dense, plain = _dense_pair(None)
    x = randn(0, (4, 16, 32))
    variables = te_dense.init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params"}  # no FP8 state
    assert_allclose(te_dense.apply(variables, x), plain.apply(variables, x), dtype=jnp.float32)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), MXFP8BlockScaling()], ids=["current", "mxfp8"])
def test_dot_general_with_a_stateless_recipe_quantizes_whatever_autocast_is_active(recipe):
    """The wrapper's recipe, not the (disabled) autocast, decides: the output is the FP8 GEMM's (close to the plain
    product by FP8's precision, not equal to it), and no state is kept."""
    te_dense, plain = _dense_pair(recipe)
    x = randn(1, (4, 32, 64))
    variables = te_dense.init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params"}
    out, expected = te_dense.apply(variables, x), plain.apply(variables, x)
    assert 25 < sqnr(expected, out) < 80


def test_dot_general_with_delayed_scaling_keeps_its_state_for_overwrite_with_gradient():
    """DelayedScaling: the wrapper owns {x,kernel,grad}_scale / _amax_history in "_overwrite_with_gradient"; their
    gradient is the next state (the history rolled with this step's amax at its end)."""
    te_dense, plain = _dense_pair(DelayedScaling(amax_history_len=4))
    x, dy = randn(2, (4, 16, 32)), randn(3, (4, 16, 64))
    variables = te_dense.init(jax.random.PRNGKey(0), x)
    state = variables["_overwrite_with_gradient"]["dot_general"]
    assert sorted(state) == sorted(f"{q}_{v}" for q in ("x", "kernel", "grad") for v in ("scale", "amax_history"))
    _, vjp = jax.vjp(lambda v: te_dense.apply(v, x), variables)
    grads = vjp(dy)[0]
    new_state = grads["_overwrite_with_gradient"]["dot_general"]
    assert float(new_state["x_amax_history"][-1]) == pytest.approx(float(jnp.abs(x).max()))
    assert float(new_state["grad_amax_history"][-1]) == pytest.approx(float(jnp.abs(dy).max()))
    out = te_dense.apply({**variables, "_overwrite_with_gradient": grads["_overwrite_with_gradient"]}, x)
    assert sqnr(plain.apply(variables, x), out) > 25


def test_dot_general_refuses_batch_dimensions():
    dot = te_flax.make_dot_general_cls(None)()
    x, kernel = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    with pytest.raises(ValueError, match="batch dimensions"):
        dot.init(jax.random.PRNGKey(0), x, kernel, (((2,), (1,)), ((0,), (0,))))


def test_wrapped_function_gets_a_quantizer_set_per_postfix():
    calls = []

    def two_gemms(generate_quantizer_set, x, w1, w2):
        first, second = generate_quantizer_set("_0"), generate_quantizer_set("_1")
        calls.append((first, second))
        return te.dense.dense(te.dense.dense(x, w1, quantizer_set=first), w2, quantizer_set=second)

    module = te_flax.wrap_function_in_te_state_module(two_gemms, DelayedScaling(amax_history_len=2))()
    assert type(module).__name__ == "TEWrapper_two_gemms"
    x, w1, w2 = randn(4, (16, 32)), randn(5, (32, 64), scale=0.1), randn(6, (64, 16), scale=0.1)
    variables = module.init(jax.random.PRNGKey(0), x, w1, w2)
    assert {"x_0_scale", "x_1_scale", "grad_1_amax_history"} <= set(variables["_overwrite_with_gradient"])
    assert sqnr(x @ w1 @ w2, module.apply(variables, x, w1, w2)) > 20
    with pytest.raises(NotImplementedError, match="n_groups"):
        te_flax.wrap_function_in_te_state_module(lambda g, x: g(n_groups=2), DelayedScaling())().init(jax.random.PRNGKey(0), x)


def test_grouped_dense_multiplies_each_group_of_rows_by_its_kernel():
    grouped = te_flax.make_grouped_dense_cls(None)
    x, kernel = randn(7, (12, 16)), randn(8, (3, 16, 8))
    sizes = jnp.array([5, 0, 4])  # 9 of 12 rows: the last 3 give 0
    variables = grouped.init(jax.random.PRNGKey(0), x, kernel, sizes)
    out = grouped.apply(variables, x, kernel, sizes)
    expected = jnp.concatenate([x[:5] @ kernel[0], x[5:9] @ kernel[2], jnp.zeros((3, 8))])
    assert_allclose(out, expected, dtype=jnp.float32)
    dx = jax.grad(lambda x: grouped.apply(variables, x, kernel, sizes).sum())(x)
    assert_allclose(dx[:5], jnp.broadcast_to(kernel[0].sum(1), (5, 16)), dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="quantized grouped GEMMs"):
        te_flax.make_grouped_dense_cls(MXFP8BlockScaling())


def test_layernorm_mlp_without_the_norm_reads_the_input_itself():
    x = randn(9, (2, 8, 32))
    with_norm = te_flax.LayerNormMLP(intermediate_dim=64, return_layernorm_output=True)
    without = te_flax.LayerNormMLP(intermediate_dim=64, enable_layernorm=False, return_layernorm_output=True)
    variables = without.init(jax.random.PRNGKey(0), x, deterministic=True)
    params = unbox(variables)["params"]
    assert "scale" not in params and "ln_bias" not in params
    out, ln_out = without.apply(variables, x, deterministic=True)
    assert_allclose(ln_out, x, dtype=jnp.float32)
    ones = {"scale": jnp.ones((32,)), "ln_bias": jnp.zeros((32,))}
    expected_on_normed = with_norm.apply({"params": {**params, **ones}}, x, deterministic=True)[0]
    assert not jnp.allclose(out, expected_on_normed)  # the norm is really skipped
    h = nn.gelu(jnp.einsum("bsd,dkf->bskf", x, params["wi_kernel"])[..., 0, :], approximate=True)
    assert_allclose(out, h @ params["wo_kernel"], dtype=jnp.float32)
