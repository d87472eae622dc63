"""te.LayerNorm and te.RMSNorm against float32 torch references (TE's test_layernorm/rmsnorm_accuracy)."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import TorchNorm, forward_backward
from tests.utils import dtype_tols, randn

# TE's tolerances: output atol per dtype; grads atol fp32 1e-4 (RMSNorm 2e-3), rtol from the dtype table.
OUT_ATOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GRAD_ATOL = {"LayerNorm": 1e-4, "RMSNorm": 2e-3}
MODULES = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-1, 1e-3, 1e-5, 1e-7])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_accuracy(kind, dtype, eps, zero_centered_gamma):
    hidden = 67
    norm = MODULES[kind](hidden, eps=eps, zero_centered_gamma=zero_centered_gamma, dtype=dtype)
    ref = TorchNorm(kind, hidden, eps, zero_centered_gamma, dtype)
    with torch.no_grad():  # non-trivial parameters
        norm.weight.copy_(randn(hidden, scale=0.5, dtype=dtype))
        ref.weight.copy_(norm.weight)
        if kind == "LayerNorm":
            norm.bias.copy_(randn(hidden, dtype=dtype))
            ref.bias.copy_(norm.bias)
    x, dy = randn(3, 5, hidden, scale=2.0, dtype=dtype) + 1.0, randn(3, 5, hidden, dtype=dtype)
    out, dx, grads = forward_backward(norm, x, dy)
    ref_out, ref_dx, ref_grads = forward_backward(ref, x, dy)
    rtol = dtype_tols(dtype)["rtol"]
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=OUT_ATOL[dtype])
    gtol = dict(rtol=max(rtol, 1e-5), atol=GRAD_ATOL[kind] if dtype == torch.float32 else 5e-2)
    torch.testing.assert_close(dx, ref_dx, **gtol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **gtol)


def test_parameters_and_init():
    ln, rms = te.LayerNorm(8), te.RMSNorm(8, zero_centered_gamma=True)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"] and rms.bias is None
    assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0) and torch.all(rms.weight == 0)
    assert "_extra_state" in ln.state_dict() and ln.state_dict()["_extra_state"].numel() == 0


def test_multi_dim_normalized_shape():
    ln = te.LayerNorm((4, 6))
    x = randn(3, 4, 6)
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (4, 6)), rtol=1e-5, atol=1e-5)
    # a 2-D input that is one normalized row: [4, 6] is not [rows, hidden] here
    x2 = randn(4, 6).requires_grad_()
    x2_ref = x2.detach().clone().requires_grad_()
    dy = randn(4, 6)
    ln(x2).backward(dy)
    torch.nn.functional.layer_norm(x2_ref, (4, 6), ln.weight.detach(), ln.bias.detach()).backward(dy)
    torch.testing.assert_close(x2.grad, x2_ref.grad, rtol=1e-5, atol=1e-5)
    assert ln.weight.grad.shape == (4, 6)
    with pytest.raises(ValueError, match=r"last dims \(4, 6\)"):
        ln(randn(3, 6, 4))


def test_mixed_dtypes_and_torch_autocast():
    ln = te.LayerNorm(16)
    x = randn(4, 16, dtype=torch.bfloat16, scale=3.0)
    out = ln(x)  # norms take the input's dtype (weights cast to it)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert ln.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ln(randn(4, 16)).dtype == torch.bfloat16


def test_deprecated_aliases_and_bad_arguments():
    with pytest.warns(DeprecationWarning, match="hidden_size"):
        assert te.LayerNorm(hidden_size=8).normalized_shape == (8,)
    with pytest.warns(DeprecationWarning, match="params_dtype"):
        assert te.RMSNorm(8, params_dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    nn_style = te.LayerNorm(8, 1e-6, elementwise_affine=True, bias=True)  # torch.nn.LayerNorm's call, swapped
    assert nn_style.eps == 1e-6
    with pytest.raises(NotImplementedError, match="elementwise_affine=False"):
        te.LayerNorm(8, elementwise_affine=False)
    with pytest.raises(TypeError, match="momentum"):
        te.LayerNorm(8, momentum=0.1)
    with pytest.raises(ValueError, match="eps"):
        te.LayerNorm(8, eps=-1.0)
    with pytest.raises(TypeError, match="normalized_shape is required"):
        te.LayerNorm()


def test_meta_device():
    ln = te.LayerNorm(8, device="meta")
    assert ln.weight.device.type == "meta"
    ln.reset_parameters()
    assert ln.weight.device.type == "cpu" and torch.all(ln.weight == 1)
