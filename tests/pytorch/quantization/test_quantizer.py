"""Quantizers: delayed (cast with the state's scale, amax recorded with max), current, calibration, fused produce."""

import pytest
import torch

from tests.utils import randn, sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.plugin import ops
from transformer_engine.pytorch.quantization import Float8Tensor
from transformer_engine.pytorch.quantization.quantizer import IDENTITY
from transformer_engine.pytorch.quantization.recipe_state import RecipeState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _delayed_state(mode="forward", history=4):
    return RecipeState.create(DelayedScaling(amax_history_len=history), mode=mode, num_gemms=1, device="cpu")


def test_delayed_quantizer_uses_state_scale_and_records_max_amax():
    state = _delayed_state()
    state.scale[0] = 8.0
    quantizer = state.make_quantizers()[0]
    x1, x2 = randn(5, 7), randn(5, 7, scale=3.0)
    out = quantizer.quantize(x1)
    q_ref, scale_inv_ref, _ = ops.quantize(x1, torch.tensor(8.0), E4M3)
    assert isinstance(out, Float8Tensor) and out.fp8_dtype == E4M3
    assert torch.equal(out.data.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(out.scale_inv, scale_inv_ref)
    quantizer.quantize(x2)
    assert state.amax_history[0, 0] == max(x1.abs().max(), x2.abs().max())
    assert torch.all(state.amax_history[1:] == 0) and torch.all(state.amax_history[0, 1:] == 0)


def test_backward_state_uses_e5m2_under_hybrid_and_e4m3_under_e4m3():
    assert _delayed_state("backward").make_quantizers()[0].fp8_dtype == E5M2
    r = DelayedScaling(fp8_format=Format.E4M3)
    assert RecipeState.create(r, mode="backward", num_gemms=1, device="cpu").fp8_dtype == E4M3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scaling_quantizer(dtype):
    x = randn(16, 33, scale=5.0, dtype=dtype)
    quantizer = RecipeState.create(Float8CurrentScaling(), mode="forward", num_gemms=1, device="cpu").make_quantizers()[0]
    out = quantizer.quantize(x)
    scale = 448.0 / x.float().abs().max()
    assert torch.allclose(out.scale_inv, 1.0 / scale)
    assert out.data.float().abs().max() == 448.0  # the largest element lands on fp8_max
    assert sqnr(x.float(), out.dequantize(torch.float32)) >= 25.0


def test_current_scaling_casts_max_into_the_amax_of_their_scale(monkeypatch):
    # each cast gets the amax its scale came from as amax_out (no zeroed amax buffer of its own), and
    # leaves it unchanged: it already holds max|x|
    seen = []
    for name in ("quantize", "cast_transpose", "cast_transpose_dbias"):
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *args, _op=op, amax_out, **kw: seen.append(amax_out) or _op(*args, amax_out=amax_out, **kw))
    x = randn(16, 32, scale=5.0, dtype=torch.bfloat16)
    quantizer = RecipeState.create(Float8CurrentScaling(), mode="backward", num_gemms=1, device="cpu").make_quantizers()[0]
    quantizer.quantize(x)
    quantizer.quantize(x, columnwise=True)
    quantizer.quantize_with_dbias(x)
    quantizer.quantize_weight(x)
    assert len(seen) == 4 and all(a is not None and a.item() == x.float().abs().max().item() for a in seen)


def test_observer_records_and_returns_input():
    state = _delayed_state()
    observer = state.make_observers()[1]
    x = randn(4, 4)
    assert observer.quantize(x) is x
    assert state.amax_history[0, 1] == x.abs().max()
    assert IDENTITY.quantize(x) is x


def test_fused_produce_equals_separate_quantize():
    x, gamma, beta = randn(8, 32), randn(32), randn(32)
    state = _delayed_state()
    state.scale[0] = 4.0
    quantizer = state.make_quantizers()[0]

    def run(scale, fp8_dtype, amax_out):
        y, mean, rstd, scale_inv, amax = ops.layernorm_fwd(x, gamma, beta, 1e-5, zero_centered_gamma=False, fp8_scale=scale,
                                                           fp8_dtype=fp8_dtype, out_dtype=torch.float32, amax_out=amax_out)
        return y, scale_inv, amax, (mean, rstd)

    fused, stats = quantizer.produce(run)
    y_hp, _ = IDENTITY.produce(run)
    separate = ops.quantize(y_hp, torch.tensor(4.0), E4M3)[0]
    assert len(stats) == 2
    # the fused cast quantizes the float32 norm output directly, like the separate cast of a float32 y
    assert torch.equal(fused.data.view(torch.uint8), separate.view(torch.uint8))
    assert torch.isclose(state.amax_history[0, 0], y_hp.abs().max())


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("shape", [(5, 7), (16, 48)])
def test_columnwise_quantize_writes_the_transpose_of_the_same_values(recipe, shape):
    state = RecipeState.create(recipe, mode="forward", num_gemms=1, device="cpu")
    if hasattr(state, "scale"):
        state.scale[0] = 4.0
    quantizer = state.make_quantizers()[0]
    x = randn(*shape, scale=2.0)
    rowwise = quantizer.quantize(x)
    both = quantizer.quantize(x, columnwise=True)
    assert rowwise.data_t is None
    assert torch.equal(both.data.view(torch.uint8), rowwise.data.view(torch.uint8))
    assert torch.equal(both.data_t.view(torch.uint8), rowwise.data.t().contiguous().view(torch.uint8))
    assert torch.equal(both.scale_inv, rowwise.scale_inv)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), None], ids=["delayed", "current", "identity"])
def test_quantize_with_dbias_is_the_columnwise_cast_plus_the_column_sums(recipe):
    x = randn(24, 40, scale=2.0, dtype=torch.bfloat16)
    if recipe is None:
        quantizer, other = IDENTITY, IDENTITY
    else:
        state = RecipeState.create(recipe, mode="backward", num_gemms=1, device="cpu")
        quantizer, other = state.make_quantizers()[0], RecipeState.create(recipe, mode="backward", num_gemms=1,
                                                                          device="cpu").make_quantizers()[0]
    operand, dbias = quantizer.quantize_with_dbias(x)
    expected = other.quantize(x, columnwise=True)
    torch.testing.assert_close(dbias, x.float().sum(dim=0), rtol=1e-5, atol=1e-5)
    assert dbias.dtype == torch.float32
    if recipe is None:
        assert operand is x
        return
    assert torch.equal(operand.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(operand.data_t.view(torch.uint8), expected.data_t.view(torch.uint8))
    if hasattr(quantizer, "state"):  # delayed scaling records the amax like quantize does
        assert torch.equal(quantizer.state.amax_history[0], other.state.amax_history[0])


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_deferred_weight_transpose_keeps_the_forward_scale_and_records_nothing(recipe):
    state = RecipeState.create(recipe, mode="forward", num_gemms=1, device="cpu")
    if hasattr(state, "scale"):
        state.scale[0] = 4.0
    quantizer = state.make_quantizers()[0]
    w = randn(16, 48, scale=2.0)
    operand = quantizer.quantize_weight(w)
    saved = operand.deferred_t.snapshot()  # as forward saves it for backward
    recorded = state.amax_history.clone() if hasattr(state, "amax_history") else None
    if hasattr(state, "scale"):
        state.scale[0] = 0.5  # the update after forward rewrites the scale in place
    w_t = saved.materialize()
    assert w_t.data is None and torch.equal(w_t.scale_inv, operand.scale_inv)
    assert torch.equal(w_t.data_t.view(torch.uint8), operand.data.t().contiguous().view(torch.uint8))
    if recorded is not None:
        assert torch.equal(state.amax_history, recorded)  # the cast in backward recorded no amax
