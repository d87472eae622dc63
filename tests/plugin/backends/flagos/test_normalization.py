"""flagos LayerNorm / RMSNorm vs the reference backend: forward, FP8 forward, backward."""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, assert_close, assert_fp8_equal, assert_fp8_near
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import normalization as fn
from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.reference import normalization as ref

EPS = 1e-5
# (1, 1): one element; (3, 7), (2, 5, 31): odd rows, several rows per program;
# (37, 300): 8 rows per program, several persistent backward programs that loop;
# (6, 64): a power-of-two hidden size, no padded columns (the kernels' EVEN_H path)
SHAPES = [(1, 1), (3, 7), (2, 5, 31), (37, 300), (6, 64)]
DTYPE_GAMMA = [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)]


def _inputs(shape, dtype, device, weight_dtype=None):
    hidden = shape[-1]
    x = randn(*shape, dtype=dtype, scale=2.0, device=device) + 0.5
    weight = randn(hidden, dtype=weight_dtype or dtype, device=device)
    bias = randn(hidden, dtype=weight_dtype or dtype, device=device)
    return x, weight, bias


@pytest.mark.parametrize("dtype, zero_centered", DTYPE_GAMMA)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm(shape, dtype, zero_centered, device):
    x, weight, bias = _inputs(shape, dtype, device)
    y, mean, rstd, scale_inv, amax = fn.layernorm_fwd(x, weight, bias, EPS, zero_centered)
    y_ref, mean_ref, rstd_ref, _, _ = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered)
    assert scale_inv is None and amax is None
    assert_close(y, y_ref)
    assert_close(mean, mean_ref, reduction=True)
    assert_close(rstd, rstd_ref, reduction=True)
    dy = randn(*shape, dtype=dtype, device=device)
    grads = fn.layernorm_bwd(dy, x, mean_ref, rstd_ref, weight, zero_centered)
    for actual, expected in zip(grads, ref.layernorm_bwd(dy, x, mean_ref, rstd_ref, weight, zero_centered)):
        assert_close(actual, expected, reduction=True)


@pytest.mark.parametrize("dtype, zero_centered", DTYPE_GAMMA)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm(shape, dtype, zero_centered, device):
    x, weight, _ = _inputs(shape, dtype, device)
    y, rstd, scale_inv, amax = fn.rmsnorm_fwd(x, weight, EPS, zero_centered)
    y_ref, rstd_ref, _, _ = ref.rmsnorm_fwd(x, weight, EPS, zero_centered)
    assert scale_inv is None and amax is None
    assert_close(y, y_ref)
    assert_close(rstd, rstd_ref, reduction=True)
    dy = randn(*shape, dtype=dtype, device=device)
    grads = fn.rmsnorm_bwd(dy, x, rstd_ref, weight, zero_centered)
    for actual, expected in zip(grads, ref.rmsnorm_bwd(dy, x, rstd_ref, weight, zero_centered)):
        assert_close(actual, expected, reduction=True)


def test_layernorm_without_bias_mixed_weight_and_out_dtype(device):
    x, weight, _ = _inputs((5, 33), torch.bfloat16, device, weight_dtype=torch.float32)
    y, _, _, _, _ = fn.layernorm_fwd(x, weight, None, EPS, out_dtype=torch.float32)
    assert_close(y, ref.layernorm_fwd(x, weight, None, EPS, out_dtype=torch.float32)[0], reduction=True)
    dy = randn(5, 33, dtype=torch.bfloat16, device=device)
    _, mean, rstd, _, _ = ref.layernorm_fwd(x, weight, None, EPS)
    dx, dgamma, dbeta = fn.layernorm_bwd(dy, x, mean, rstd, weight)
    assert dgamma.dtype == dbeta.dtype == torch.float32
    for actual, expected in zip((dx, dgamma, dbeta), ref.layernorm_bwd(dy, x, mean, rstd, weight)):
        assert_close(actual, expected, reduction=True)


def test_strided_rows(device):
    wide = randn(6, 50, device=device)
    x, weight = wide[:, 5:45], randn(40, device=device)  # row stride 50
    dy = randn(6, 50, device=device)[:, :40]
    y, rstd, _, _ = fn.rmsnorm_fwd(x, weight, EPS)
    assert_close(y, ref.rmsnorm_fwd(x, weight, EPS)[0])
    for actual, expected in zip(fn.rmsnorm_bwd(dy, x, rstd, weight), ref.rmsnorm_bwd(dy, x, rstd, weight)):
        assert_close(actual, expected, reduction=True)


@pytest.mark.parametrize("hidden", [67, 64])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fp8_output(kind, fp8_dtype, hidden, device):
    x, weight, bias = _inputs((9, hidden), torch.float32, device)
    scale = torch.tensor([3.0], device=device)
    norm_args = (x, weight, bias, EPS) if kind == "layernorm" else (x, weight, EPS)
    fused = getattr(fn, f"{kind}_fwd")(*norm_args, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=fp8_dtype)
    expected = getattr(ref, f"{kind}_fwd")(*norm_args, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=fp8_dtype)
    q, scale_inv, amax = fused[0], fused[-2], fused[-1]
    # tier 1: the fused cast against our own unfused float32 output quantized: the same kernel math,
    # bit for bit in the interpreter; compiled, the two specializations contract multiply-adds
    # differently, so y (and the amax) may move by an ulp (seen on the H200: amax one ulp apart)
    y_f32 = getattr(fn, f"{kind}_fwd")(*norm_args, zero_centered_gamma=False)[0]
    q_unfused, scale_inv_unfused, amax_unfused = fq.quantize(y_f32, scale, fp8_dtype)
    assert torch.equal(scale_inv.cpu(), scale_inv_unfused.cpu())
    if device == "cpu":
        assert_fp8_equal(q, q_unfused)
        assert torch.equal(amax.cpu(), amax_unfused.cpu())
    else:
        assert_fp8_near(q, q_unfused)
        torch.testing.assert_close(amax.cpu(), amax_unfused.cpu(), rtol=2**-23, atol=0.0)  # one float32 ulp
    # tier 2: against the reference (its float32 y may differ by an ulp)
    assert_fp8_near(q, expected[0])
    assert torch.equal(scale_inv.cpu(), expected[-2].cpu())
    torch.testing.assert_close(amax.cpu(), expected[-1].cpu(), rtol=4e-6, atol=0.0)


def test_errors_and_supports(device):
    x, weight, bias = _inputs((2, 8), torch.float32, device)
    with pytest.raises(ValueError, match="weight"):
        fn.layernorm_fwd(x, weight[:4], bias, EPS)
    with pytest.raises(ValueError, match="fp8_scale"):
        fn.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rows"):
        fn.rmsnorm_bwd(x, x, torch.ones(3, device=device), weight)
    wide = torch.empty(1, 40000, device=device)
    verdict = fn.SUPPORTS["layernorm_fwd"](wide, torch.empty(40000, device=device), None, EPS)
    assert not verdict and "40000" in verdict.reason
    assert fn.SUPPORTS["rmsnorm_bwd"](x, x, torch.ones(2, device=device), weight)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120 + 7])
def test_large_gpu(hidden):
    x, weight, bias = _inputs((4099, hidden), torch.bfloat16, "cuda")
    dy = randn(4099, hidden, dtype=torch.bfloat16, device="cuda")
    y, mean, rstd, _, _ = fn.layernorm_fwd(x, weight, bias, EPS)
    y_ref, mean_ref, rstd_ref, _, _ = ref.layernorm_fwd(x, weight, bias, EPS)
    assert_close(y, y_ref)
    for actual, expected in zip(fn.layernorm_bwd(dy, x, mean, rstd, weight), ref.layernorm_bwd(dy, x, mean_ref, rstd_ref, weight)):
        torch.testing.assert_close(actual.double(), expected.double(), rtol=2e-2, atol=2e-2)  # bf16 sums of 4099 rows
    q, _, _, amax = fn.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=False, fp8_scale=torch.tensor([2.0], device="cuda"),
                                   fp8_dtype=torch.float8_e4m3fn)
    q_ref, _, _, amax_ref = ref.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=False, fp8_scale=torch.tensor([2.0], device="cuda"),
                                            fp8_dtype=torch.float8_e4m3fn)
    assert_fp8_near(q, q_ref)
    torch.testing.assert_close(amax, amax_ref, rtol=4e-6, atol=0.0)
