"""The FP8 scaling pipeline, checked step by step against float64 NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from transformer_engine.jax import quantize as q

from ._utils import randn, sqnr

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _np_delayed_step(x, scale, history, margin=0, algo="max", fp8_max=448.0):
    """One delayed-scaling step in float64: returns (dequantized x, new scale, new history)."""
    x = np.asarray(x, np.float64)
    q_x = np.clip(x * scale, -fp8_max, fp8_max).astype(np.float32).astype(jnp.float8_e4m3fn)
    dq = np.asarray(q_x, np.float64) / scale
    history = history.copy()
    history[0] = np.abs(x).max()
    a = history[0] if algo == "most_recent" else history.max()
    new_scale = fp8_max / a / 2.0**margin if (a > 0 and np.isfinite(a)) else scale
    history = np.roll(history, -1)
    history[0] = 0.0
    return dq, new_scale, history


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1)])
def test_delayed_scaling_steps_match_formula(algo, margin):
    recipe = DelayedScaling(amax_history_len=3, margin=margin, amax_compute_algo=algo, fp8_format=Format.E4M3)
    quantizer = q.QuantizerFactory.create_set(recipe, q.QuantizerFactory.create_meta_set(recipe)).x
    scale, history = 1.0, np.zeros(3)

    @jax.jit
    def quantize(qz, x):
        (tensor,), new_qz = qz.quantize(x, (0,))
        return tensor.dequantize(jnp.float32), new_qz

    for step, amplitude in enumerate([3.0, 0.5, 7.0, 0.25, 0.25]):  # amax rises and falls
        x = randn(step, (5, 33), scale=amplitude)
        dequantized, quantizer = quantize(quantizer, x)
        dq, scale, history = _np_delayed_step(x, scale, history, margin, algo)
        np.testing.assert_allclose(np.asarray(dequantized), dq, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(quantizer.meta.scale[0]), scale, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(quantizer.meta.amax_history), history, rtol=1e-6)


def test_delayed_scale_kept_for_zero_or_nonfinite_amax():
    config = q.get_quantize_config_with_recipe(DelayedScaling())
    histories = jnp.array([[0.0, 0, 0, 0], [jnp.inf, 0, 0, 0], [jnp.nan, 0, 0, 0], [2.0, 0, 0, 0]])
    scales = jax.jit(jax.vmap(lambda h: q.scale_from_amax_history(h, jnp.array([3.0]), E4M3, config)))(histories)
    np.testing.assert_allclose(np.asarray(scales[:, 0]), [3.0, 3.0, 3.0, 224.0])


def test_saturating_cast_never_produces_nan_or_inf():
    x = jnp.array([500.0, -1e6, 1e6, 3.0])
    cast = jax.jit(lambda x: [q.cast_to_fp8(x, jnp.ones(1), t).astype(jnp.float32) for t in (E4M3, E5M2)])
    e4, e5 = (np.asarray(c) for c in cast(x))
    np.testing.assert_array_equal(e4, [448.0, -448.0, 448.0, 3.0])
    np.testing.assert_array_equal(e5, [512.0, -57344.0, 57344.0, 3.0])


@pytest.mark.parametrize("power_2", [False, True])
def test_current_scale_formula(power_2):
    eps = q.QuantizeConfig(q.ScalingMode.CURRENT_TENSOR_SCALING, power_2_scale=power_2, amax_epsilon=1e-3)
    plain = q.QuantizeConfig(q.ScalingMode.CURRENT_TENSOR_SCALING, power_2_scale=power_2)
    amax = jnp.array([3.0, 1e-5, 0.0, jnp.inf])
    got = jax.jit(lambda a: (q.current_scale(a, E4M3, eps), q.current_scale(a, E4M3, plain)))(amax)
    expected = np.array([[448.0 / 3.0, 448e3, 448e3, 1.0], [448.0 / 3.0, 448e5, 1.0, 1.0]])
    if power_2:
        expected = 2.0 ** np.floor(np.log2(expected))
    np.testing.assert_allclose(np.stack([np.asarray(g) for g in got]), expected, rtol=1e-6)


def test_mxfp8_blocks_have_power_of_two_scales_and_no_overflow():
    x = randn(7, (3, 96), scale=5.0).at[1, 32:64].set(0.0)  # one empty block
    quantizer = q.QuantizerFactory.create_set(MXFP8BlockScaling()).x

    @jax.jit
    def quantize(x):
        (tensor,), _ = quantizer.quantize(x, (1,))
        return tensor.scale_inv, tensor.dequantize(jnp.float32)

    scale_inv, dequantized = quantize(x)
    blocks = np.abs(np.asarray(x, np.float64)).reshape(3, 3, 32).max(-1)
    expected = np.where(blocks > 0, 2.0 ** np.ceil(np.log2(np.where(blocks > 0, blocks, 1) / 448.0)), 1.0)
    np.testing.assert_array_equal(np.asarray(scale_inv), expected)
    assert sqnr(x, dequantized) > 25.0  # e4m3 per-element error ~ 2^-4
    with pytest.raises(ValueError, match="divisible by 32"):
        q.QuantizerFactory.create_set(MXFP8BlockScaling()).x.quantize(randn(0, (4, 33)), (1,))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2), Float8CurrentScaling(), MXFP8BlockScaling()])
def test_scaled_dot_general_matches_dequantized_dot(recipe):
    """Fast path (FP8 dot, then scale) == emulated path (dequantize, float64 dot), and ~ the f64 product."""
    qs = q.QuantizerFactory.create_set(recipe, q.QuantizerFactory.create_meta_set(recipe))
    a, b = randn(1, (7, 64)), randn(2, (64, 5))

    @jax.jit
    def run(a, b):
        (ta,), _ = qs.x.quantize(a, (1,))
        (tb,), _ = qs.kernel.quantize(b, (0,))
        out = q.scaled_dot_general(ta, tb, (((1,), (0,)), ((), ())), jnp.float32)
        return out, ta.dequantize(jnp.float32), tb.dequantize(jnp.float32)

    out, da, db = run(a, b)
    got = np.asarray(out, np.float64)
    emulated = np.asarray(da, np.float64) @ np.asarray(db, np.float64)
    np.testing.assert_allclose(got, emulated, rtol=1e-5, atol=1e-5)
    assert sqnr(np.asarray(a, np.float64) @ np.asarray(b, np.float64), got) > 20.0


def test_factory_dtypes_and_errors():
    hybrid = q.QuantizerFactory.create_set(Float8CurrentScaling())
    assert (hybrid.x.q_dtype, hybrid.kernel.q_dtype, hybrid.dgrad.q_dtype) == (E4M3, E4M3, E5M2)
    e4m3 = q.QuantizerFactory.create_set(Float8CurrentScaling(fp8_format=Format.E4M3))
    assert e4m3.dgrad.q_dtype == E4M3
    assert q.QuantizerFactory.create_set() is q.noop_quantizer_set  # no autocast active
    with pytest.raises(ValueError, match="meta_set"):
        q.QuantizerFactory.create_set(DelayedScaling())
    assert q.QuantizerFactory.create_meta_set(Float8CurrentScaling()) is None
    meta = q.QuantizerFactory.create_meta_set(DelayedScaling(amax_history_len=5))
    assert meta.grad.amax_history.shape == (5,) and float(meta.x.scale[0]) == 1.0
