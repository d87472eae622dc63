"""flagos activations (24 ops) and the fused activation + FP8 cast vs the reference backend."""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_close, assert_fp8_equal, assert_fp8_near
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import activation as fa
from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.reference import activation as ref

PLAIN = ("gelu", "qgelu", "relu", "srelu", "silu")
GATED = ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")


def _backward_name(op: str) -> str:
    return "clamped_dswiglu" if op == "clamped_swiglu" else "d" + op


def _check_op(op, x, *extra):
    """Forward and backward of ``op`` on x against the reference."""
    y = getattr(fa, op)(x, *extra)
    assert_close(y, getattr(ref, op)(x, *extra))
    dy = randn(*y.shape, dtype=x.dtype, device=x.device)
    name = _backward_name(op)
    assert_close(getattr(fa, name)(dy, x, *extra), getattr(ref, name)(dy, x, *extra))


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("op", PLAIN + GATED)
def test_forward_backward(op, dtype, device):
    # 3 x 5 rows of 2 * 19 features: odd sizes, values beyond clamped_swiglu's limit of 7
    _check_op(op, randn(3, 5, 38, dtype=dtype, scale=4.0, device=device))


@pytest.mark.parametrize("op, shape", [("silu", (1,)), ("silu", (4099,)), ("swiglu", (3, 2200)), ("swiglu", (2, 8200))])
def test_multi_tile_shapes(op, shape, device):
    # (4099,): a plain op over two 4096-element tiles; (3, 2200): 2 rows per tile;
    # (2, 8200): gated rows of 4100 outputs, wider than one tile
    _check_op(op, randn(*shape, device=device))


def test_clamped_swiglu_parameters_and_strided_input(device):
    wide = randn(4, 60, scale=3.0, device=device)
    x = wide[:, 4:54]  # row stride 60, 2 * 25 features
    _check_op("clamped_swiglu", x, 2.5, 0.8)
    _check_op("geglu", x)


@pytest.mark.parametrize("op", PLAIN + GATED)
def test_activation_quantize(op, device):
    x = randn(5, 46, scale=3.0, device=device)
    scale = torch.tensor([7.0], device=device)
    q, scale_inv, amax = fa.activation_quantize(x, op, scale, torch.float8_e4m3fn)
    # tier 1: the fused kernel equals our unfused float32 activation, quantized
    q_unfused, scale_inv_unfused, amax_unfused = fq.quantize(getattr(fa, op)(x), scale, torch.float8_e4m3fn)
    assert_fp8_equal(q, q_unfused)
    assert torch.equal(amax.cpu(), amax_unfused.cpu()) and torch.equal(scale_inv.cpu(), scale_inv_unfused.cpu())
    # tier 2: the reference (its float32 activation may differ by an ulp)
    q_ref, scale_inv_ref, amax_ref = ref.activation_quantize(x, op, scale, torch.float8_e4m3fn)
    assert_fp8_near(q, q_ref)
    assert torch.equal(scale_inv.cpu(), scale_inv_ref.cpu())
    torch.testing.assert_close(amax.cpu(), amax_ref.cpu(), rtol=4e-6, atol=0.0)


def test_activation_quantize_bf16_e5m2_clamped(device):
    x = randn(7, 34, dtype=torch.bfloat16, scale=5.0, device=device)
    scale = torch.tensor([300.0], device=device)
    q, _, amax = fa.activation_quantize(x, "clamped_swiglu", scale, torch.float8_e5m2, 3.0, 1.5)
    q_ref, _, amax_ref = ref.activation_quantize(x, "clamped_swiglu", scale, torch.float8_e5m2, 3.0, 1.5)
    assert_fp8_near(q, q_ref)
    torch.testing.assert_close(amax.cpu(), amax_ref.cpu(), rtol=4e-6, atol=0.0)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("op", PLAIN + GATED)
def test_dactivation_in_place(op, dtype, device):
    """dactivation_ writes the backward op's result over x, equal to the new-tensor op (flagos and reference)."""
    x = randn(3, 5, 38, dtype=dtype, scale=4.0, device=device)
    dy = randn(*getattr(ref, op)(x).shape, dtype=dtype, device=device)
    flagos, reference = x.clone(), x.clone()
    assert fa.dactivation_(dy, flagos, op) is flagos and ref.dactivation_(dy, reference, op) is reference
    assert torch.equal(flagos, getattr(fa, _backward_name(op))(dy, x))  # the same kernel, writing over x
    assert_close(reference, getattr(ref, _backward_name(op))(dy, x))


def test_dactivation_in_place_errors(device):
    x = randn(4, 8, device=device)
    for backend in (fa, ref):
        with pytest.raises(ValueError, match="contiguous"):
            backend.dactivation_(randn(4, 2, device=device), x[:, :4], "swiglu")
        with pytest.raises(ValueError, match="tanh"):
            backend.dactivation_(x, x, "tanh")
        with pytest.raises(ValueError, match="dy has shape"):
            backend.dactivation_(randn(4, 8, device=device), x, "swiglu")


def test_errors_and_supports(device):
    x = randn(2, 7, device=device)
    with pytest.raises(ValueError, match="even"):
        fa.swiglu(x)
    with pytest.raises(ValueError, match="dy has shape"):
        fa.dgelu(randn(2, 6, device=device), x)
    with pytest.raises(ValueError, match="limit"):
        fa.clamped_swiglu(randn(2, 8, device=device), 0.0)
    with pytest.raises(ValueError, match="activation"):
        fa.activation_quantize(x, "tanh", torch.ones(1, device=device), torch.float8_e4m3fn)
    verdict = fa.SUPPORTS["activation_quantize"](x, "gelu", torch.ones(1, dtype=torch.float64, device=device), torch.float8_e4m3fn)
    assert not verdict and "float32" in verdict.reason


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gelu", "swiglu", "clamped_swiglu"])
def test_large_gpu(op):
    x = randn(4097, 2 * 3001, dtype=torch.bfloat16, scale=3.0, device="cuda")
    _check_op(op, x)
    scale = torch.tensor([30.0], device="cuda")
    q, _, amax = fa.activation_quantize(x, op, scale, torch.float8_e4m3fn)
    q_ref, _, amax_ref = ref.activation_quantize(x, op, scale, torch.float8_e4m3fn)
    assert_fp8_near(q, q_ref)
    torch.testing.assert_close(amax, amax_ref, rtol=4e-6, atol=0.0)
