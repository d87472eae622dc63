"""Reference LayerNorm / RMSNorm vs float64 torch formulas; backward vs autograd of the float64 forward."""

import pytest
import torch
import torch.nn.functional as F

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference import normalization as ref
from transformer_engine.plugin.backends.reference.quantization import quantize
from transformer_engine.plugin.core import with_preference, with_strict_mode

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(1, 1), (3, 7), (2, 5, 31), (13, 97)]
EPS = 1e-5
# float32 statistics and sums over up to 128 terms vs float64: a few ulps, within 4x the fp32 table.
_FP32_REDUCE_TOLS = dict(rtol=4 * dtype_tols(torch.float32)["rtol"], atol=4 * dtype_tols(torch.float32)["atol"])


def _tols(dtype):
    return _FP32_REDUCE_TOLS if dtype == torch.float32 else dtype_tols(dtype)


def _inputs(shape, dtype):
    hidden = shape[-1]
    x = randn(*shape, dtype=dtype, scale=2.0) + 0.5
    weight = randn(hidden, dtype=dtype)
    bias = randn(hidden, dtype=dtype)
    return x, weight, bias


def _gamma64(weight, zero_centered):
    return weight.double() + 1.0 if zero_centered else weight.double()


def _layernorm64(x, weight, bias, zero_centered):
    return F.layer_norm(x.double(), (x.shape[-1],), _gamma64(weight, zero_centered), bias.double(), EPS)


def _rmsnorm64(x, weight, zero_centered):
    return F.rms_norm(x.double(), (x.shape[-1],), _gamma64(weight, zero_centered), EPS)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_fwd(shape, dtype, zero_centered):
    x, weight, bias = _inputs(shape, dtype)
    y, mean, rstd, scale_inv, amax = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered)
    assert y.dtype == dtype and y.shape == x.shape and scale_inv is None and amax is None
    torch.testing.assert_close(y.double(), _layernorm64(x, weight, bias, zero_centered), **_tols(dtype))
    rows = x.double().reshape(-1, shape[-1])
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (rows.shape[0],)
    torch.testing.assert_close(mean.double(), rows.mean(-1), **_FP32_REDUCE_TOLS)
    rstd64 = 1.0 / torch.sqrt(rows.var(-1, unbiased=False) + EPS)
    torch.testing.assert_close(rstd.double(), rstd64, **_FP32_REDUCE_TOLS)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_fwd(shape, dtype, zero_centered):
    x, weight, _ = _inputs(shape, dtype)
    y, rstd, scale_inv, amax = ref.rmsnorm_fwd(x, weight, EPS, zero_centered)
    assert y.dtype == dtype and y.shape == x.shape and scale_inv is None and amax is None
    torch.testing.assert_close(y.double(), _rmsnorm64(x, weight, zero_centered), **_tols(dtype))
    rows = x.double().reshape(-1, shape[-1])
    rstd64 = 1.0 / torch.sqrt(rows.square().mean(-1) + EPS)
    torch.testing.assert_close(rstd.double(), rstd64, **_FP32_REDUCE_TOLS)


def test_norm_out_dtype():
    x, weight, bias = _inputs((3, 20), torch.float32)
    y = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=torch.bfloat16)[0]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _layernorm64(x, weight, bias, zero_centered=False), **dtype_tols(torch.bfloat16))
    y = ref.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=torch.float16)[0]
    torch.testing.assert_close(y.double(), _rmsnorm64(x, weight, zero_centered=False), **dtype_tols(torch.float16))


def _check_fp8_output(y, scale_inv, amax, y64, scale, fp8_dtype):
    assert y.dtype == fp8_dtype and y.shape == y64.shape
    assert scale_inv.item() == 1.0 / scale.item()
    torch.testing.assert_close(amax.double(), y64.abs().max(), **_FP32_REDUCE_TOLS)
    fp8_max = torch.finfo(fp8_dtype).max
    torch.testing.assert_close(y.double(), (y64 * scale.double()).clamp(-fp8_max, fp8_max), **dtype_tols(fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_norms_fp8_output(dtype, fp8_dtype):
    x, weight, bias = _inputs((5, 67), dtype)
    scale = torch.tensor([16.0])  # |y| up to ~8 -> up to ~128: E4M3 saturates the largest ones
    y, _, _, scale_inv, amax = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered_gamma=True, fp8_scale=scale, fp8_dtype=fp8_dtype)
    _check_fp8_output(y, scale_inv, amax, _layernorm64(x, weight, bias, zero_centered=True), scale, fp8_dtype)
    y, _, scale_inv, amax = ref.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=fp8_dtype)
    _check_fp8_output(y, scale_inv, amax, _rmsnorm64(x, weight, zero_centered=False), scale, fp8_dtype)


def test_norms_fp8_output_equals_quantize_of_float32_output():
    """For float32 x the fused FP8 output is exactly quantize(unquantized y)."""
    x, weight, bias = _inputs((6, 45), torch.float32)
    scale = torch.tensor([3.0])
    y_fp8, _, _, _, amax = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered_gamma=False, fp8_scale=scale,
                                             fp8_dtype=torch.float8_e4m3fn)
    q, _, amax_q = quantize(ref.layernorm_fwd(x, weight, bias, EPS)[0], scale, torch.float8_e4m3fn)
    assert torch.equal(y_fp8.view(torch.uint8), q.view(torch.uint8)) and amax.item() == amax_q.item()
    y_fp8, _, _, amax = ref.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=True, fp8_scale=scale, fp8_dtype=torch.float8_e5m2)
    q, _, amax_q = quantize(ref.rmsnorm_fwd(x, weight, EPS, zero_centered_gamma=True)[0], scale, torch.float8_e5m2)
    assert torch.equal(y_fp8.view(torch.uint8), q.view(torch.uint8)) and amax.item() == amax_q.item()


def _autograd_grads(forward64, dy, tensors):
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    y = forward64(*leaves)
    return torch.autograd.grad(y, leaves, dy.double())


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_bwd(shape, dtype, zero_centered):
    x, weight, bias = _inputs(shape, dtype)
    dy = randn(*shape, dtype=dtype)
    _, mean, rstd, _, _ = ref.layernorm_fwd(x, weight, bias, EPS, zero_centered)
    dx, dgamma, dbeta = ref.layernorm_bwd(dy, x, mean, rstd, weight, zero_centered)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert dgamma.dtype == dbeta.dtype == weight.dtype and dgamma.shape == dbeta.shape == weight.shape
    expected = _autograd_grads(lambda a, w, b: _layernorm64(a, w, b, zero_centered), dy, (x, weight, bias))
    for got, want in zip((dx, dgamma, dbeta), expected):
        torch.testing.assert_close(got.double(), want, **_tols(dtype))


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_bwd(shape, dtype, zero_centered):
    x, weight, _ = _inputs(shape, dtype)
    dy = randn(*shape, dtype=dtype)
    _, rstd, _, _ = ref.rmsnorm_fwd(x, weight, EPS, zero_centered)
    dx, dgamma = ref.rmsnorm_bwd(dy, x, rstd, weight, zero_centered)
    assert dx.dtype == dtype and dgamma.dtype == weight.dtype and dgamma.shape == weight.shape
    expected = _autograd_grads(lambda a, w: _rmsnorm64(a, w, zero_centered), dy, (x, weight))
    for got, want in zip((dx, dgamma), expected):
        torch.testing.assert_close(got.double(), want, **_tols(dtype))


def test_layernorm_without_bias():
    x, weight, _ = _inputs((4, 9), torch.float32)
    y = ref.layernorm_fwd(x, weight, None, EPS)[0]
    expected = F.layer_norm(x.double(), (9,), weight.double(), None, EPS)
    torch.testing.assert_close(y.double(), expected, **_FP32_REDUCE_TOLS)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ref.layernorm_fwd(randn(3, 8), randn(7), randn(8), EPS), ValueError, r"weight must be \[8\]"),
        (lambda: ref.layernorm_fwd(randn(3, 8), randn(8), randn(2, 8), EPS), ValueError, r"bias must be \[8\]"),
        (lambda: ref.rmsnorm_fwd(randn(3, 8), randn(8, 1), EPS), ValueError, r"weight must be \[8\]"),
        (lambda: ref.rmsnorm_fwd(randn(3, 8), randn(8), -1.0), ValueError, "eps"),
        (lambda: ref.rmsnorm_fwd(randn(3, 8), randn(8), EPS, zero_centered_gamma=False, fp8_scale=None,
                                 fp8_dtype=torch.float8_e4m3fn), ValueError, "without fp8_scale"),
        (lambda: ref.rmsnorm_fwd(randn(3, 8), randn(8), EPS, zero_centered_gamma=False, fp8_scale=torch.ones(1),
                                 fp8_dtype=torch.float16), ValueError, "not an FP8"),
        (lambda: ref.layernorm_fwd(randn(3, 8).to(torch.float8_e4m3fn), randn(8), randn(8), EPS), TypeError, "dtype"),
        (lambda: ref.rmsnorm_bwd(randn(3, 8), randn(3, 9), torch.ones(3), randn(9)), ValueError, "dy has shape"),
        (lambda: ref.rmsnorm_bwd(randn(3, 8), randn(3, 8), torch.ones(4), randn(8)), ValueError, "rstd has 4 elements"),
        (lambda: ref.layernorm_bwd(randn(3, 8), randn(3, 8), torch.ones(3), torch.ones(3), randn(5)), ValueError, "weight"),
    ],
)
def test_norm_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_norms_dispatch_through_ops():
    x, weight, bias = _inputs((3, 10), torch.float32)
    with with_preference("reference"), with_strict_mode():
        (y, mean, rstd, _, _), impl = ops.layernorm_fwd.traced(x, weight, bias, EPS)
        dx, _ = ops.rmsnorm_bwd(x, x, ref.rmsnorm_fwd(x, weight, EPS)[1], weight)
    assert impl.impl_id == IMPL_ID
    assert torch.equal(y, ref.layernorm_fwd(x, weight, bias, EPS)[0]) and dx.shape == x.shape
