"""MXFP8BlockScaling through the modules, emulated exactly on the CPU.

Each module's outputs and gradients are compared with the same math composed here from the independent
model of the format (``tests/mxfp8_spec.py``, float64): every GEMM operand quantize-dequantized along that
GEMM's K (x, W, dy in blocks of 32 along their rows for fprop / dgrad; W^T, x^T, dy^T along the tokens
for dgrad / wgrad), then a high-precision GEMM. Only the float32 accumulation order differs.
"""

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from tests.mxfp8_spec import spec_qdq
from tests.pytorch.quantization._emulated import (
    assert_grouped_linear_matches, assert_linear_compiles_as_eager, transformer_layer_sqnr,
)
from tests.pytorch._training import train_losses
from tests.pytorch.references import forward_backward
from tests.utils import randn, sqnr
from transformer_engine.common.recipe import Format, MXFP8BlockScaling
from transformer_engine.pytorch.quantization import (
    MXFP8BlockScalingRecipeState,
    MXFP8Quantizer,
    MXFP8Tensor,
    RecipeState,
    check_mxfp8_support,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MXFP8 = MXFP8BlockScaling()
# float32 GEMMs against the float64 model of the same products: a few float32 ulps of the sums
TOLS = dict(rtol=1e-5, atol=1e-5)


def qdq_rows(t: torch.Tensor, fp8_dtype=E4M3) -> torch.Tensor:
    """t [R, C] in blocks of 32 along its rows (the copy a GEMM reads when it contracts over C), float64."""
    return spec_qdq(t.detach().float(), fp8_dtype)


def qdq_cols(t: torch.Tensor, fp8_dtype=E4M3) -> torch.Tensor:
    """t [R, C] in blocks of 32 along its columns (contracting over R), float64, back in t's layout."""
    return spec_qdq(t.detach().float().t().contiguous(), fp8_dtype).t()


def linear_reference(x, w, b, dy, grad_dtype=E4M3):
    """(y, dx, dW, db) of y = x W^T + b with MXFP8 operands, in float64."""
    y = qdq_rows(x) @ qdq_rows(w).t() + (b.double() if b is not None else 0)
    dx = qdq_rows(dy, grad_dtype) @ qdq_cols(w)
    dw = qdq_cols(dy, grad_dtype).t() @ qdq_cols(x)
    return y, dx, dw, dy.double().sum(0)


# -- recipe state, availability, autocast -------------------------------------------------------------
@pytest.mark.parametrize("fp8_format, bwd_dtype", [(Format.E4M3, E4M3), (Format.HYBRID, E5M2)])
def test_recipe_state_hands_out_mxfp8_quantizers(fp8_format, bwd_dtype):
    recipe = MXFP8BlockScaling(fp8_format=fp8_format)
    fwd = RecipeState.create(recipe, mode="forward", num_gemms=2, device="cpu")
    bwd = RecipeState.create(recipe, mode="backward", num_gemms=2, device="cpu")
    assert isinstance(fwd, MXFP8BlockScalingRecipeState) and not fwd.has_amax_history
    fwd_q, bwd_q = fwd.make_quantizers(), bwd.make_quantizers()
    assert len(fwd_q) == 6 and len(bwd_q) == 4
    assert all(isinstance(q, MXFP8Quantizer) and q.is_fp8 and not q.gathers_quantized for q in fwd_q + bwd_q)
    assert {q.fp8_dtype for q in fwd_q} == {E4M3} and {q.fp8_dtype for q in bwd_q} == {bwd_dtype}


def test_mxfp8_is_available_emulated_with_the_reason():
    available, reason = te.is_mxfp8_available(return_reason=True)
    assert available is True and te.is_mxfp8_available() is True
    assert "emulated" in reason and "no CUDA device" in reason
    assert check_mxfp8_support() == (available, reason)


def test_autocast_and_quantized_model_init_accept_mxfp8():
    with te.autocast(recipe=MXFP8):
        pass
    with te.quantized_model_init(recipe=MXFP8):
        layer = te.Linear(32, 32)
    assert type(layer.weight).__name__ == "MXFP8Tensor"  # parameters: tests/pytorch/quantization/test_model_init.py


def test_mxfp8_tensor_container():
    x = randn(64, 96)
    t = MXFP8Quantizer(E4M3).quantize(x, columnwise=True)
    assert isinstance(t, MXFP8Tensor) and t.block == (1, 32) and t.shape == (64, 96)
    tensors, rebuild = t.to_saved()
    again = rebuild(*tensors)
    assert isinstance(again, MXFP8Tensor) and torch.equal(again.dequantize(torch.float32), t.dequantize(torch.float32))
    assert torch.equal(t.dequantize(torch.float64), qdq_rows(x))
    only_t = t.transpose_only()
    assert only_t.data is None and torch.equal(only_t.dequantize(torch.float64), qdq_cols(x))
    rowwise = MXFP8Quantizer(E4M3).quantize(x)
    with pytest.raises(RuntimeError, match="columnwise=True"):
        rowwise.transpose_only()
    w_t = MXFP8Quantizer(E4M3).quantize_transposed(x)
    assert w_t.data is None and torch.equal(w_t.data_t.view(torch.uint8), t.data_t.view(torch.uint8))


# -- modules against the composed emulation -----------------------------------------------------------
@pytest.mark.parametrize("fp8_format, grad_dtype", [(Format.E4M3, E4M3), (Format.HYBRID, E5M2)], ids=["e4m3", "hybrid"])
def test_linear_equals_the_composed_emulation(fp8_format, grad_dtype):
    layer = te.Linear(96, 64)
    rows_scale = torch.logspace(-2, 2, 64).reshape(2, 32, 1)  # rows of different magnitudes: the two copies of x differ
    x, dy = randn(2, 32, 96) * rows_scale, randn(2, 32, 64, scale=1e-2)
    with te.autocast(recipe=MXFP8BlockScaling(fp8_format=fp8_format)):
        out, dx, grads = forward_backward(layer, x, dy)
    y, dx_ref, dw_ref, db_ref = linear_reference(x.reshape(64, 96), layer.weight, layer.bias.detach(), dy.reshape(64, 64), grad_dtype)
    torch.testing.assert_close(out.reshape(64, 64).double(), y, **TOLS)
    torch.testing.assert_close(dx.reshape(64, 96).double(), dx_ref, **TOLS)
    torch.testing.assert_close(grads["weight"].double(), dw_ref, **TOLS)
    torch.testing.assert_close(grads["bias"].double(), db_ref, **TOLS)
    assert not torch.equal(qdq_rows(x.reshape(64, 96)), qdq_cols(x.reshape(64, 96)))  # the test tells the copies apart


def test_linear_bf16_and_cached_weights():
    layer = te.Linear(64, 96, params_dtype=torch.bfloat16)
    x, dy = randn(64, 64, dtype=torch.bfloat16), randn(64, 96, dtype=torch.bfloat16)
    with te.autocast(recipe=MXFP8):
        out, dx, grads = forward_backward(layer, x, dy, is_first_microbatch=True)  # W and W^T cast together, cached
    y, dx_ref, dw_ref, _ = linear_reference(x, layer.weight, layer.bias.detach(), dy)
    bf16 = dict(rtol=1.6e-2, atol=1e-2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), y, **bf16)
    torch.testing.assert_close(dx.double(), dx_ref, **bf16)
    torch.testing.assert_close(grads["weight"].double(), dw_ref, **bf16)


def test_layernorm_linear_equals_the_composed_emulation():
    layer = te.LayerNormLinear(64, 96, return_layernorm_output=True)
    x, dy = randn(64, 64), randn(64, 96, scale=1e-2)
    x_in = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=MXFP8):
        out, ln_out = layer(x_in)
    out.backward(dy)
    w = layer.weight
    torch.testing.assert_close(out.double(), qdq_rows(ln_out) @ qdq_rows(w).t() + layer.bias.double(), **TOLS)
    torch.testing.assert_close(layer.weight.grad.double(), qdq_cols(dy).t() @ qdq_cols(ln_out), **TOLS)
    d_ln = (qdq_rows(dy) @ qdq_cols(w)).float()
    x_ref = x.clone().requires_grad_(requires_grad=True)
    ln_ref = F.layer_norm(x_ref, (64,), layer.layer_norm_weight.detach(), layer.layer_norm_bias.detach(), layer.eps)
    torch.testing.assert_close(ln_out, ln_ref, rtol=1e-5, atol=1e-5)
    ln_ref.backward(d_ln)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-4, atol=1e-5)


def test_layernorm_mlp_equals_the_composed_emulation():
    layer = te.LayerNormMLP(64, 128, return_layernorm_output=True)
    x = randn(64, 64)
    with te.autocast(recipe=MXFP8):
        out, ln_out = layer(x)
    h = qdq_rows(ln_out) @ qdq_rows(layer.fc1_weight).t() + layer.fc1_bias.double()
    act = F.gelu(h, approximate="tanh")
    expected = qdq_rows(act) @ qdq_rows(layer.fc2_weight).t() + layer.fc2_bias.double()
    # the activation is computed in float32 by the module: an element on a rounding boundary of E4M3 may
    # land on the neighbouring code, so most outputs agree to float32 precision and all to a few E4M3 steps
    close = torch.isclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert close.float().mean() > 0.95
    assert sqnr(expected, out) > 40


def test_grouped_linear_equals_the_composed_emulation():
    assert_grouped_linear_matches(MXFP8, linear_reference, TOLS)


def test_alignment_errors_are_clear():
    with pytest.raises(ValueError, match=r"last dim \(48\) must be divisible by 32"):
        with te.autocast(recipe=MXFP8):
            te.Linear(48, 32)(randn(32, 48))
    layer = te.Linear(64, 32)
    with pytest.raises(ValueError, match=r"first dim \(16\) must be divisible by 32"):
        with te.autocast(recipe=MXFP8):
            layer(randn(16, 64))  # wgrad needs x in blocks of 32 tokens
    with torch.no_grad(), te.autocast(recipe=MXFP8):
        assert layer(randn(16, 64)).shape == (16, 32)  # inference reads the row-wise copies only


# -- training, the full layer, torch.compile ----------------------------------------------------------
def test_training_lowers_the_loss_and_tracks_bf16():
    bf16, mxfp8 = train_losses(None), train_losses(MXFP8)
    assert mxfp8[-1] < 0.5 * mxfp8[0]
    for step, (a, b) in enumerate(zip(bf16, mxfp8)):
        assert abs(a - b) <= 0.05 * a + 1e-3, f"step {step}: bf16 {a:.4f} vs mxfp8 {b:.4f}"


def test_transformer_layer_runs_forward_and_backward():
    out_sqnr, dx_sqnr = transformer_layer_sqnr(MXFP8)
    assert out_sqnr > 20 and dx_sqnr > 15


def test_linear_compiles_without_graph_breaks_and_equals_eager():
    assert_linear_compiles_as_eager(MXFP8)
