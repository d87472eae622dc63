"""NVFP4BlockScaling through the modules, emulated exactly on the CPU.

The op itself is tested bit for bit against an independent model of the format
(tests/plugin/backends/reference/test_nvfp4.py); here each module's outputs and gradients are compared with
the same math composed from the op: every GEMM operand quantize-dequantized along that GEMM's K (x, W, dy
in blocks of 16 along their rows for fprop / dgrad; W^T, and x^T and dy^T after the random Hadamard
transform, along the tokens for dgrad / wgrad), weights in 16 x 16 tiles, then a float64 GEMM. Only the
float32 accumulation order differs. Stochastic rounding is switched off where results are compared value
by value, and tested for what it promises (repeatable under ``torch.manual_seed``, unbiased) on its own.
"""

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from tests.pytorch.quantization._emulated import (
    assert_grouped_linear_matches, assert_linear_compiles_as_eager, transformer_layer_sqnr,
)
from tests.pytorch._training import train_losses
from tests.pytorch.references import forward_backward
from tests.utils import randn, sqnr
from transformer_engine.common.recipe import NVFP4BlockScaling
from transformer_engine.plugin import ops
from transformer_engine.pytorch.quantization import RecipeState, check_nvfp4_support
from transformer_engine.pytorch.quantization.nvfp4_tensor import NVFP4Tensor
from transformer_engine.pytorch.quantization.quantizer import NVFP4Quantizer
from transformer_engine.pytorch.quantization.recipe_state import NVFP4BlockScalingRecipeState

NVFP4 = NVFP4BlockScaling()
NO_SR = NVFP4BlockScaling(disable_stochastic_rounding=True)
# float32 GEMMs against float64 products of the same dequantized operands: a few float32 ulps of the sums
TOLS = dict(rtol=1e-5, atol=1e-5)


def qdq(t: torch.Tensor, *, columnwise: bool = False, block_2d: bool = False, rht: bool = False) -> torch.Tensor:
    """The dequantized copy a GEMM reads, float64: t [R, C] in blocks of 16 along its rows, or with
    ``columnwise`` t^T [C, R] in blocks of 16 along its rows (after the RHT with ``rht``)."""
    data, scale, amax, data_t, scale_t, amax_t = ops.quantize_nvfp4(
        t.detach(), rowwise=not columnwise, columnwise=columnwise, block_2d=block_2d, rht=rht, stochastic_rounding=False, seed=None
    )
    if columnwise:
        return ops.dequantize_nvfp4(data_t, scale_t, amax_t, torch.float64)
    return ops.dequantize_nvfp4(data, scale, amax, torch.float64)


def linear_reference(x, w, b, dy, rht=True):
    """(y, dx, dW, db) of y = x W^T + b with NVFP4 operands (no stochastic rounding), in float64."""
    y = qdq(x) @ qdq(w, block_2d=True).t() + (b.double() if b is not None else 0)
    dx = qdq(dy) @ qdq(w, columnwise=True, block_2d=True).t()
    dw = qdq(dy, columnwise=True, rht=rht) @ qdq(x, columnwise=True, rht=rht).t()
    return y, dx, dw, dy.double().sum(0)


# -- recipe state, availability, autocast -------------------------------------------------------------
def test_recipe_state_hands_out_quantizers_by_role():
    fwd = RecipeState.create(NVFP4, mode="forward", num_gemms=2, device="cpu")
    bwd = RecipeState.create(NVFP4, mode="backward", num_gemms=2, device="cpu")
    assert isinstance(fwd, NVFP4BlockScalingRecipeState) and not fwd.has_amax_history
    fwd_q, bwd_q = fwd.make_quantizers(), bwd.make_quantizers()
    assert len(fwd_q) == 6 and len(bwd_q) == 4
    assert all(isinstance(q, NVFP4Quantizer) and q.is_fp8 and not q.gathers_quantized for q in fwd_q + bwd_q)
    settings = [(q.rht, q.block_2d, q.stochastic_rounding) for q in fwd_q[:3] + bwd_q[:2]]
    # TE's defaults: inputs RHT (column-wise copy), weights 16 x 16 tiles, gradients RHT + stochastic rounding
    assert settings == [(True, False, False), (False, True, False), (True, False, False), (True, False, True), (True, False, True)]
    plain = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    quantizers = RecipeState.create(plain, mode="forward", num_gemms=1, device="cpu").make_quantizers()
    quantizers += RecipeState.create(plain, mode="backward", num_gemms=1, device="cpu").make_quantizers()
    assert {(q.rht, q.block_2d, q.stochastic_rounding) for q in quantizers} == {(False, False, False)}


def test_nvfp4_is_available_emulated_with_the_reason():
    available, reason = te.is_nvfp4_available(return_reason=True)
    assert available is True and te.is_nvfp4_available() is True
    assert "emulated" in reason and "no CUDA device" in reason
    assert check_nvfp4_support() == (available, reason)


def test_nvfp4_tensor_container():
    x = randn(32, 48)
    t = NVFP4Quantizer(rht=True).quantize(x, columnwise=True)
    assert isinstance(t, NVFP4Tensor) and t.block == (1, 16) and t.shape == (32, 48) and t.rht_t
    assert t.data.shape == (32, 24) and t.data_t.shape == (48, 16) and t.scale_inv.shape == (32, 3)
    tensors, rebuild = t.to_saved()
    again = rebuild(*tensors)
    assert isinstance(again, NVFP4Tensor) and again.rht_t and torch.equal(again.dequantize(torch.float32), t.dequantize(torch.float32))
    assert torch.equal(t.dequantize(torch.float64), qdq(x))
    only_t = t.transpose_only()
    assert only_t.data is None and only_t.shape == (32, 48)
    with pytest.raises(RuntimeError, match="Hadamard-transformed"):
        only_t.dequantize(torch.float32)  # it holds RHT(x^T), not x^T
    plain_t = NVFP4Quantizer().quantize_transposed(x)
    assert plain_t.data is None and torch.equal(plain_t.dequantize(torch.float64), qdq(x, columnwise=True).t())
    with pytest.raises(RuntimeError, match="columnwise=True"):
        NVFP4Quantizer().quantize(x).transpose_only()
    with pytest.raises(ValueError, match="2-D"):
        NVFP4Quantizer().quantize(randn(2, 16, 16))


# -- modules against the composed emulation -----------------------------------------------------------
@pytest.mark.parametrize("rht", [True, False], ids=["rht", "no-rht"])
def test_linear_equals_the_composed_emulation(rht):
    layer = te.Linear(96, 64)
    rows_scale = torch.logspace(-2, 2, 64).reshape(2, 32, 1)  # rows of different magnitudes: the copies of x differ
    x, dy = randn(2, 32, 96) * rows_scale, randn(2, 32, 64, scale=1e-2)
    with te.autocast(recipe=NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=not rht)):
        out, dx, grads = forward_backward(layer, x, dy)
    y, dx_ref, dw_ref, db_ref = linear_reference(x.reshape(64, 96), layer.weight, layer.bias.detach(), dy.reshape(64, 64), rht=rht)
    torch.testing.assert_close(out.reshape(64, 64).double(), y, **TOLS)
    torch.testing.assert_close(dx.reshape(64, 96).double(), dx_ref, **TOLS)
    torch.testing.assert_close(grads["weight"].double(), dw_ref, **TOLS)
    torch.testing.assert_close(grads["bias"].double(), db_ref, **TOLS)
    assert not torch.equal(qdq(dy.reshape(64, 64), columnwise=True, rht=True), qdq(dy.reshape(64, 64), columnwise=True))


def test_stochastic_rounding_repeats_under_manual_seed_and_is_unbiased():
    layer = te.Linear(64, 32, bias=False)
    x, dy = randn(64, 64), randn(64, 32)

    def grads(seed):
        torch.manual_seed(seed)
        with te.autocast(recipe=NVFP4):
            _, dx, g = forward_backward(layer, x, dy)
        layer.zero_grad()
        return dx, g["weight"]

    first, again, other = grads(1), grads(1), grads(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    # the mean of many stochastically rounded dgrads approaches the dgrad of unrounded dy (nearest rounding
    # has a bias that averaging cannot remove)
    exact = dy.double() @ qdq(layer.weight, columnwise=True, block_2d=True).t()
    mean = torch.stack([grads(seed)[0].double() for seed in range(64)]).mean(0)
    nearest = qdq(dy) @ qdq(layer.weight, columnwise=True, block_2d=True).t()
    assert (mean - exact).norm() < 0.5 * (nearest - exact).norm()


def test_layernorm_linear_equals_the_composed_emulation():
    layer = te.LayerNormLinear(64, 96, return_layernorm_output=True)
    x, dy = randn(64, 64), randn(64, 96, scale=1e-2)
    x_in = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=NO_SR):
        out, ln_out = layer(x_in)
    out.backward(dy)
    w = layer.weight
    torch.testing.assert_close(out.double(), qdq(ln_out) @ qdq(w, block_2d=True).t() + layer.bias.double(), **TOLS)
    wgrad = qdq(dy, columnwise=True, rht=True) @ qdq(ln_out, columnwise=True, rht=True).t()
    torch.testing.assert_close(layer.weight.grad.double(), wgrad, **TOLS)
    d_ln = (qdq(dy) @ qdq(w, columnwise=True, block_2d=True).t()).float()
    x_ref = x.clone().requires_grad_(requires_grad=True)
    ln_ref = F.layer_norm(x_ref, (64,), layer.layer_norm_weight.detach(), layer.layer_norm_bias.detach(), layer.eps)
    torch.testing.assert_close(ln_out, ln_ref, rtol=1e-5, atol=1e-5)
    ln_ref.backward(d_ln)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-4, atol=1e-5)


def test_layernorm_mlp_equals_the_composed_emulation():
    layer = te.LayerNormMLP(64, 128, return_layernorm_output=True)
    x = randn(64, 64)
    with te.autocast(recipe=NO_SR):
        out, ln_out = layer(x)
    h = qdq(ln_out) @ qdq(layer.fc1_weight, block_2d=True).t() + layer.fc1_bias.double()
    act = F.gelu(h.float(), approximate="tanh")
    expected = qdq(act) @ qdq(layer.fc2_weight, block_2d=True).t() + layer.fc2_bias.double()
    # the module computes the activation in float32: an element on an E2M1 rounding boundary may land on the
    # neighbouring code, so most outputs agree to float32 precision and all to the format's precision
    close = torch.isclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert close.float().mean() > 0.9
    assert sqnr(expected, out) > 25


def test_grouped_linear_equals_the_composed_emulation():
    assert_grouped_linear_matches(NO_SR, linear_reference, TOLS)


def test_alignment_errors_are_clear():
    with pytest.raises(ValueError, match=r"48"):
        with te.autocast(recipe=NVFP4):
            te.Linear(40, 32)(randn(48, 40))  # 40 features: not a whole number of blocks of 16
    layer = te.Linear(64, 32)
    with pytest.raises(ValueError, match=r"\b8\b"):
        with te.autocast(recipe=NVFP4):
            layer(randn(8, 64))  # wgrad needs x in blocks of 16 tokens
    with torch.no_grad(), te.autocast(recipe=NVFP4):
        assert layer(randn(8, 64)).shape == (8, 32)  # inference reads the row-wise copies only


# -- training, the full layer, torch.compile ----------------------------------------------------------
def test_training_lowers_the_loss_and_tracks_bf16():
    bf16, nvfp4 = train_losses(None), train_losses(NVFP4)
    assert nvfp4[-1] < 0.5 * nvfp4[0]
    for step, (a, b) in enumerate(zip(bf16, nvfp4)):
        assert abs(a - b) <= 0.15 * a + 1e-3, f"step {step}: bf16 {a:.4f} vs nvfp4 {b:.4f}"


def test_transformer_layer_runs_forward_and_backward():
    out_sqnr, dx_sqnr = transformer_layer_sqnr(NVFP4)
    assert out_sqnr > 10 and dx_sqnr > 5


@pytest.mark.parametrize("recipe", [NO_SR, NVFP4], ids=["nearest", "stochastic"])
def test_linear_compiles_without_graph_breaks_and_equals_eager(recipe):
    assert_linear_compiles_as_eager(recipe)
