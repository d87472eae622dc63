"""Reference activations vs float64 torch formulas; every backward vs autograd of the float64 forward."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference import activation as ref
from transformer_engine.plugin.backends.reference.quantization import quantize
from transformer_engine.plugin.core import with_preference, with_strict_mode

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAIN_SHAPES = [(1,), (3, 31), (2, 5, 97)]
GATED_SHAPES = [(1, 2), (3, 14), (2, 3, 194)]
LIMIT, ALPHA = 2.0, 1.5  # small limit so that the clamps are exercised by N(0, 3^2) inputs


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


# float64 forward formulas written from the catalog text, independent of the backend
PLAIN64 = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "qgelu": _qgelu,
    "relu": F.relu,
    "srelu": lambda x: F.relu(x) ** 2,
    "silu": F.silu,
}
GATE64 = {"glu": torch.sigmoid, "geglu": PLAIN64["gelu"], "qgeglu": _qgelu, "reglu": F.relu, "sreglu": PLAIN64["srelu"], "swiglu": F.silu}


def _gated64(name):
    def forward(x):
        a, b = x.chunk(2, dim=-1)
        return GATE64[name](a) * b

    return forward


def _clamped64(x, limit=7.0, alpha=1.702):
    a, b = x.chunk(2, dim=-1)
    a_c, b_c = a.clamp(max=limit), b.clamp(-limit, limit)
    return a_c * torch.sigmoid(alpha * a_c) * (b_c + 1.0)


# float32 results vs float64: a handful of ulps through tanh/sigmoid/exp; 2x the fp32 table covers it.
_FP32_TOLS = dict(rtol=2 * dtype_tols(torch.float32)["rtol"], atol=dtype_tols(torch.float32)["atol"])


def _tols(dtype):
    return _FP32_TOLS if dtype == torch.float32 else dtype_tols(dtype)


def _check(got, want64, dtype):
    assert got.dtype == dtype and got.shape == want64.shape
    torch.testing.assert_close(got.double(), want64, **_tols(dtype))


def _vjp64(forward64, x, dy):
    x64 = x.detach().double().requires_grad_()
    return torch.autograd.grad(forward64(x64), x64, dy.double())[0]


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", PLAIN_SHAPES)
@pytest.mark.parametrize("name", list(PLAIN64))
def test_plain_forward_and_backward(name, shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    dy = randn(*shape, dtype=dtype)
    _check(getattr(ref, name)(x), PLAIN64[name](x.double()), dtype)
    _check(getattr(ref, "d" + name)(dy, x), _vjp64(PLAIN64[name], x, dy), dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("name", list(GATE64))
def test_gated_forward_and_backward(name, shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    dy = randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
    _check(getattr(ref, name)(x), _gated64(name)(x.double()), dtype)
    _check(getattr(ref, "d" + name)(dy, x), _vjp64(_gated64(name), x, dy), dtype)


@pytest.mark.parametrize("params", [{}, {"limit": LIMIT, "alpha": ALPHA}])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES)
def test_clamped_swiglu_forward_and_backward(shape, dtype, params):
    x = randn(*shape, dtype=dtype, scale=3.0 if params else 6.0)
    dy = randn(*shape[:-1], shape[-1] // 2, dtype=dtype)

    def forward64(t):
        return _clamped64(t, **params)

    _check(ref.clamped_swiglu(x, **params), forward64(x.double()), dtype)
    _check(ref.clamped_dswiglu(dy, x, **params), _vjp64(forward64, x, dy), dtype)


def test_clamped_dswiglu_is_zero_where_clamped():
    x = torch.tensor([[9.0, -1.0, 0.5, 8.0, -9.0, 0.25]])  # a = [9, -1, 0.5], b = [8, -9, 0.25]
    dx = ref.clamped_dswiglu(torch.ones(1, 3), x)
    assert dx[0, 0].item() == 0.0  # a > limit
    assert dx[0, 3].item() == 0.0 and dx[0, 4].item() == 0.0  # |b| > limit
    assert dx[0, 1].item() != 0.0 and dx[0, 5].item() != 0.0


FORWARD_NAMES = list(PLAIN64) + list(GATE64) + ["clamped_swiglu"]


def _forward64(name, x):
    if name in PLAIN64:
        return PLAIN64[name](x)
    return _gated64(name)(x) if name in GATE64 else _clamped64(x, LIMIT, ALPHA)


@pytest.mark.parametrize(
    "dtype, fp8_dtype",
    [(torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn),
     (torch.float16, torch.float8_e5m2)],
)
@pytest.mark.parametrize("name", FORWARD_NAMES)
def test_activation_quantize(name, dtype, fp8_dtype):
    x = randn(3, 38, dtype=dtype, scale=2.0)
    scale = torch.tensor([9.0])  # |act| up to ~20 -> ~180: inside E4M3's range, a few may saturate
    q, scale_inv, amax = ref.activation_quantize(x, name, scale, fp8_dtype, LIMIT, ALPHA)
    y64 = _forward64(name, x.double())
    fp8_max = torch.finfo(fp8_dtype).max
    assert q.dtype == fp8_dtype and q.shape == y64.shape and scale_inv.item() == float(torch.tensor(1.0 / 9.0))
    torch.testing.assert_close(q.double(), (y64 * 9.0).clamp(-fp8_max, fp8_max), **dtype_tols(fp8_dtype))
    torch.testing.assert_close(amax.double(), y64.abs().max(), **_FP32_TOLS)
    if dtype == torch.float32:  # exactly quantize(<op>(x)) when no rounding to x's dtype intervenes
        y = ref.clamped_swiglu(x, LIMIT, ALPHA) if name == "clamped_swiglu" else getattr(ref, name)(x)
        q_ref, _, amax_ref = quantize(y, scale, fp8_dtype)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and amax.item() == amax_ref.item()


def test_activations_keep_nan_and_inf_math():
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0])
    y = ref.relu(x)
    assert math.isnan(y[0].item()) and y[1:].tolist() == [math.inf, 0.0, 0.0]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ref.swiglu(randn(3, 7)), ValueError, "must be even"),
        (lambda: ref.dgeglu(randn(3, 4), randn(3, 7)), ValueError, "must be even"),
        (lambda: ref.dgeglu(randn(3, 4), randn(3, 6)), ValueError, r"must be \(3, 3\)"),
        (lambda: ref.dgelu(randn(3, 5), randn(3, 4)), ValueError, r"must be \(3, 4\)"),
        (lambda: ref.gelu(torch.ones(3, dtype=torch.int64)), TypeError, "dtype"),
        (lambda: ref.clamped_swiglu(randn(2, 4), limit=0.0), ValueError, "limit > 0"),
        (lambda: ref.activation_quantize(randn(2, 4), "tanh", torch.ones(1), torch.float8_e4m3fn), ValueError, "forward activation"),
        (lambda: ref.activation_quantize(randn(2, 4), "gelu", torch.ones(1), torch.bfloat16), ValueError, "not an FP8"),
        (lambda: ref.activation_quantize(randn(2, 5), "reglu", torch.ones(1), torch.float8_e4m3fn), ValueError, "even"),
    ],
)
def test_activation_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_every_catalog_activation_is_implemented():
    expected = {n for n in FORWARD_NAMES} | {"d" + n for n in PLAIN64} | {"d" + n for n in GATE64}
    assert set(ref.__all__) == expected | {"clamped_dswiglu", "activation_quantize", "dactivation_"}
    assert len(ref.__all__) == 26


def test_activation_dispatch_through_ops():
    x = randn(4, 10)
    with with_preference("reference"), with_strict_mode():
        y, impl = ops.swiglu.traced(x)
        q, _, _ = ops.activation_quantize(x, "gelu", torch.ones(1), torch.float8_e4m3fn)
    assert impl.impl_id == IMPL_ID
    assert torch.equal(y, ref.swiglu(x)) and q.shape == x.shape
