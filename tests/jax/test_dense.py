"""dense: plain and FP8 GEMMs (fprop, dgrad, wgrad) against float64 / high-precision references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from transformer_engine.jax.dense import dense
from transformer_engine.jax.quantize import QuantizerFactory

from ._utils import assert_allclose, randn, sqnr

# x (b, s, K) contracted with a kernel (K, 3, N) on one axis, and x (b, K1, K2) on two axes.
CASES = {
    "one_axis": ((3, 32, 64), (64, 3, 32), ((2,), (0,)), "bsk,kfn->bsfn"),
    "two_axes": ((32, 4, 16), (4, 16, 32), ((1, 2), (0, 1)), "bij,ijn->bn"),
}


def _reference(case, x, w, dy):
    """(y, dx, dw) of the float64 einsum."""
    spec = CASES[case][3]
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    y = np.einsum(spec, x64, w64)
    dx = np.einsum(f"{out},{ws}->{xs}", dy64, w64)
    dw = np.einsum(f"{xs},{out}->{ws}", x64, dy64)
    return y, dx, dw


def _inputs(case, dtype=jnp.float32):
    x_shape, w_shape, _, _ = CASES[case]
    fan_in = int(np.prod([x_shape[a] for a in CASES[case][2][0]]))
    x, w = randn(1, x_shape, dtype), randn(2, w_shape, dtype, scale=fan_in**-0.5)
    y_shape = jax.eval_shape(lambda: jnp.einsum(CASES[case][3], x, w)).shape
    return x, w, randn(3, y_shape, dtype)


def _fwd_bwd(case, quantizer_set=None):
    dims = CASES[case][2]

    def run(x, w, dy, qs):
        qs = quantizer_set if qs is None else qs
        y, vjp = jax.vjp(lambda x, w, qs: dense(x, w, contracting_dims=dims, quantizer_set=qs), x, w, qs)
        dx, dw, new_qs = vjp(dy)
        return y, dx, dw, new_qs

    return jax.jit(run)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_without_fp8_matches_float64(case, dtype):
    from transformer_engine.jax.quantize import noop_quantizer_set

    x, w, dy = _inputs(case, dtype)
    y, dx, dw, _ = _fwd_bwd(case)(x, w, dy, noop_quantizer_set)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    for got, want in zip((y, dx, dw), _reference(case, x, w, dy)):
        assert_allclose(got, want, dtype)


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), MXFP8BlockScaling()], ids=lambda r: type(r).__name__
)
def test_dense_fp8_after_warmup(recipe):
    """FP8 output within e4m3 and grads within e5m2 tolerances (after 3 delayed-scaling steps)."""
    case = "one_axis"
    x, w, dy = _inputs(case)
    metas = QuantizerFactory.create_meta_set(recipe)
    qs = QuantizerFactory.create_set(recipe, metas)
    step = _fwd_bwd(case)
    for _ in range(3):  # delayed scaling: the scales of step t come from step t-1
        y, dx, dw, qs = step(x, w, dy, qs)
    y_ref, dx_ref, dw_ref = _reference(case, x, w, dy)
    assert_allclose(y, y_ref, jnp.float8_e4m3fn, normalize=True)
    grad_dtype = jnp.float8_e4m3fn if isinstance(recipe, MXFP8BlockScaling) else jnp.float8_e5m2
    assert_allclose(dx, dx_ref, grad_dtype, normalize=True)
    assert_allclose(dw, dw_ref, grad_dtype, normalize=True)
    # Stronger, aggregate bound: e4m3 gives ~30 dB on a 64-term dot, e5m2 gradients ~24 dB.
    assert sqnr(y_ref, y) > 25.0 and sqnr(dx_ref, dx) > 18.0 and sqnr(dw_ref, dw) > 18.0


def test_dense_fp8_state_is_returned_as_cotangent():
    """The quantizer-set cotangent is the next delayed-scaling state of x, kernel and grad."""
    recipe = DelayedScaling(amax_history_len=2)
    x, w, dy = _inputs("two_axes")
    qs = QuantizerFactory.create_set(recipe, QuantizerFactory.create_meta_set(recipe))
    _, _, _, new = _fwd_bwd("two_axes")(x, w, dy, qs)
    for quantizer, tensor in ((new.x, x), (new.kernel, w), (new.dgrad, dy)):
        amax = float(jnp.max(jnp.abs(tensor)))
        fp8_max = float(jnp.finfo(quantizer.q_dtype).max)
        np.testing.assert_allclose(np.asarray(quantizer.meta.amax_history), [0.0, amax], rtol=1e-6)
        np.testing.assert_allclose(float(quantizer.meta.scale[0]), fp8_max / amax, rtol=1e-6)


def test_dense_bias_and_errors():
    x, w = randn(1, (2, 3)), randn(2, (3, 4))
    b = randn(3, (4,))
    np.testing.assert_allclose(np.asarray(dense(x, w, b)), np.asarray(x) @ np.asarray(w) + np.asarray(b), rtol=1e-5)
    with pytest.raises(ValueError, match=r"do not match"):
        dense(x, randn(2, (5, 4)))
    with pytest.raises(ValueError, match="bias shape"):
        dense(x, w, randn(3, (3,)))
    with pytest.raises(TypeError, match="floating-point"):
        dense(jnp.ones((2, 3), jnp.int32), w)
    with pytest.raises(ValueError, match="contracting_dims"):
        dense(x, w, contracting_dims=1)
