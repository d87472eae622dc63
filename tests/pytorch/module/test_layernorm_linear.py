"""te.LayerNormLinear against norm + torch.nn.Linear, FP8 by SQNR, its return conventions and errors."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import TorchLayerNormLinear, copy_params, forward_backward, grads_by_te_name
from tests.utils import randn, sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

# TE's test_layernorm_linear_accuracy tolerances.
OUT_TOLS = {torch.float32: dict(rtol=1e-3, atol=2.5e-4), torch.bfloat16: dict(rtol=4e-2, atol=2e-2)}
GRAD_TOLS = {torch.float32: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=4e-2, atol=5e-2)}


def _pair(kind, dtype, zcg=False, bias=True, out_features=20, **kwargs):
    layer = te.LayerNormLinear(48, out_features, eps=1e-5, normalization=kind, zero_centered_gamma=zcg, bias=bias,
                               params_dtype=dtype, **kwargs)
    with torch.no_grad():
        layer.layer_norm_weight.copy_(randn(48, scale=0.3, dtype=dtype) + (0.0 if zcg else 1.0))
    ref = TorchLayerNormLinear(kind, 48, out_features, 1e-5, zcg, bias, dtype)
    copy_params(layer, ref, "linear.")
    return layer, ref


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zcg", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_linear_accuracy(kind, dtype, zcg, bias):
    layer, ref = _pair(kind, dtype, zcg, bias)
    x, dy = randn(3, 5, 48, dtype=dtype), randn(3, 5, 20, dtype=dtype)
    out, dx, grads = forward_backward(layer, x, dy)
    ref_out, ref_dx, _ = forward_backward(ref, x, dy)
    torch.testing.assert_close(out, ref_out, **OUT_TOLS[dtype])
    torch.testing.assert_close(dx, ref_dx, **GRAD_TOLS[dtype])
    ref_grads = grads_by_te_name(ref, layer, "linear.")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOLS[dtype], msg=name)


def test_return_bias_and_layernorm_output():
    layer, ref = _pair("LayerNorm", torch.float32, return_bias=True, return_layernorm_output=True)
    x = randn(8, 48).requires_grad_()
    out, bias, ln_out = layer(x)
    torch.testing.assert_close(out + bias, ref(x), **OUT_TOLS[torch.float32])
    torch.testing.assert_close(ln_out, ref.norm(x), rtol=1e-5, atol=1e-5)
    g_out, g_ln = randn(8, 20), randn(8, 48)
    (out * g_out).sum().add_((ln_out * g_ln).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    ln_ref = ref.norm(x_ref)
    ((ref.linear(ln_ref) - ref.linear.bias) * g_out).sum().add_((ln_ref * g_ln).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **GRAD_TOLS[torch.float32])
    assert layer.bias.grad is None  # the returned bias was not used in the loss


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
@pytest.mark.parametrize("return_ln", [False, True])
def test_layernorm_linear_fp8_sqnr(recipe, return_ln):
    layer, ref = _pair("RMSNorm", torch.float32, out_features=32, return_layernorm_output=return_ln)
    x, dy = randn(32, 48), randn(32, 32)
    with te.autocast(recipe=recipe):
        forward_backward(layer, x, dy)
        layer.zero_grad()
        out, dx, grads = forward_backward(layer, x, dy)
    ref_out, ref_dx, _ = forward_backward(ref, x, dy)
    ref_grads = grads_by_te_name(ref, layer, "linear.")
    assert sqnr(ref_out, out) >= 25.0 and sqnr(ref_dx, dx) >= 20.0
    assert sqnr(ref_grads["weight"], grads["weight"]) >= 20.0 and sqnr(ref_grads["layer_norm_weight"], grads["layer_norm_weight"]) >= 20.0


def test_parameters_and_errors():
    layer = te.LayerNormLinear(32, 24, parameters_split=("query", "key", "value"), normalization="RMSNorm")
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["layer_norm_weight", "query_weight", "query_bias", "key_weight", "key_bias", "value_weight", "value_bias"]
    assert layer.layer_norm_bias is None
    layer(randn(4, 32))
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        te.LayerNormLinear(32, 24, normalization="BatchNorm")
    with pytest.raises(ValueError, match="in_features=32"):
        layer(randn(4, 30))
