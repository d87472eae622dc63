"""Reference GEMM vs a float64 matmul of the (dequantized) operands."""

import pytest
import torch

from tests.utils import dtype_tols, randn, sqnr
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference.gemm import gemm, gemm_blockwise
from transformer_engine.plugin.backends.reference.quantization import quantize, quantize_blockwise
from transformer_engine.plugin.core import with_preference, with_strict_mode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(1, 1, 1), (1, 7, 3), (5, 13, 1), (17, 31, 29), (64, 37, 48)]  # (M, K, N)


def _tols(dtype, k):
    """DTYPE_TOLS, except for float32 results: a K-term float32 dot product differs from float64 by
    up to ~sqrt(K) ulps of its terms' magnitude, so atol grows as sqrt(K) * 1e-6 (K <= 64 here)."""
    tols = dtype_tols(dtype)
    if dtype == torch.float32:
        tols["atol"] = max(tols["atol"], 2e-6 * k**0.5)
    return tols


def _operands(m, k, n, dtype, trans_a, trans_b):
    a = randn(*((k, m) if trans_a else (m, k)), dtype=dtype)
    b = randn(*((n, k) if trans_b else (k, n)), dtype=dtype)
    return a, b


def _oracle(a64, b64, trans_a, trans_b, bias=None, acc=None):
    d = (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)
    if bias is not None:
        d = d + bias.double()
    return d if acc is None else d + acc.double()


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_gemm_high_precision(m, k, n, dtype, trans_a, trans_b):
    a, b = _operands(m, k, n, dtype, trans_a, trans_b)
    bias = randn(n, dtype=dtype)
    d = gemm(a, b, bias=bias, trans_a=trans_a, trans_b=trans_b)
    assert d.shape == (m, n) and d.dtype == dtype
    expected = _oracle(a.double(), b.double(), trans_a, trans_b, bias)
    torch.testing.assert_close(d.double(), expected, **_tols(dtype, k))


def test_gemm_linear_layer_conventions():
    """fprop y = x W^T, dgrad dx = dy W, wgrad dW = dy^T x (catalog text)."""
    x, w, dy = randn(9, 11), randn(5, 11), randn(9, 5)
    tols = _tols(torch.float32, 11)
    torch.testing.assert_close(gemm(x, w, trans_b=True).double(), x.double() @ w.double().t(), **tols)
    torch.testing.assert_close(gemm(dy, w).double(), dy.double() @ w.double(), **tols)
    torch.testing.assert_close(gemm(dy, x, trans_a=True).double(), dy.double().t() @ x.double(), **tols)


@pytest.mark.parametrize("trans_a, trans_b", [(False, True), (True, False)])
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("a_fp8, b_fp8", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("m, k, n", [(1, 7, 3), (17, 31, 29)])
def test_gemm_fp8_operands(m, k, n, a_fp8, b_fp8, out_dtype, trans_a, trans_b):
    a_hp, b_hp = _operands(m, k, n, torch.float32, trans_a, trans_b)
    a, a_scale_inv, _ = quantize(a_hp, torch.tensor([3.0]), a_fp8)
    b, b_scale_inv, _ = quantize(b_hp, torch.tensor([0.7]), b_fp8)
    bias = randn(n, dtype=out_dtype)
    d = gemm(a, b, bias, a_scale_inv, b_scale_inv, trans_a, trans_b, out_dtype)
    assert d.shape == (m, n) and d.dtype == out_dtype
    a64, b64 = a.double() * a_scale_inv.double(), b.double() * b_scale_inv.double()
    expected = _oracle(a64, b64, trans_a, trans_b, bias)
    torch.testing.assert_close(d.double(), expected, **_tols(out_dtype, k))
    if k >= 13 and a_fp8 == b_fp8 == E4M3:  # FP8 vs the high-precision product: torchao's 18 dB fprop floor
        assert sqnr(_oracle(a_hp.double(), b_hp.double(), trans_a, trans_b, bias), d) > 18.0


def test_gemm_fp8_mixed_with_high_precision_operand():
    a_hp, b = randn(6, 10), randn(10, 3, dtype=torch.bfloat16)
    a, a_scale_inv, _ = quantize(a_hp, torch.tensor([2.0]), E4M3)
    d = gemm(a, b, a_scale_inv=a_scale_inv, out_dtype=torch.bfloat16)
    expected = (a.double() * a_scale_inv.double()) @ b.double()
    torch.testing.assert_close(d.double(), expected, **dtype_tols(torch.bfloat16))


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_gemm_out_and_accumulate(dtype):
    a, b = randn(7, 19, dtype=dtype), randn(19, 5, dtype=dtype)
    out = randn(7, 5, dtype=dtype)
    start = out.clone()
    result = gemm(a, b, out=out, accumulate=True)
    assert result is out
    torch.testing.assert_close(out.double(), _oracle(a.double(), b.double(), trans_a=False, trans_b=False, acc=start), **_tols(dtype, 19))
    fresh = torch.empty(7, 5, dtype=dtype)
    assert gemm(a, b, out=fresh) is fresh
    torch.testing.assert_close(fresh.double(), _oracle(a.double(), b.double(), trans_a=False, trans_b=False), **_tols(dtype, 19))


def test_gemm_fp8_into_out_takes_its_dtype():
    a, a_scale_inv, _ = quantize(randn(4, 8), torch.ones(1), E4M3)
    b, b_scale_inv, _ = quantize(randn(8, 3), torch.ones(1), E4M3)
    out = torch.zeros(4, 3, dtype=torch.bfloat16)
    gemm(a, b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, out=out)
    expected = (a.double() * a_scale_inv.double()) @ (b.double() * b_scale_inv.double())
    torch.testing.assert_close(out.double(), expected, **dtype_tols(torch.bfloat16))


def _fp8(shape):
    return quantize(randn(*shape), torch.ones(1), E4M3)[:2]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: gemm(randn(2, 3, 4), randn(4, 2)), ValueError, "must be 2-D"),
        (lambda: gemm(randn(3), randn(3, 2)), ValueError, "must be 2-D"),
        (lambda: gemm(randn(2, 3), randn(4, 2)), ValueError, r"op\(a\) is \(2, 3\), op\(b\) is \(4, 2\)"),
        (lambda: gemm(randn(2, 3), randn(2, 3), trans_b=False), ValueError, "inner dimensions"),
        (lambda: gemm(_fp8((2, 3))[0], randn(3, 2), out_dtype=torch.float32), ValueError, "a_scale_inv is None"),
        (lambda: gemm(randn(2, 3), _fp8((3, 2))[0]), ValueError, "b_scale_inv is None"),
        (lambda: gemm(*_fp8((2, 3))[:1], randn(3, 2), a_scale_inv=torch.ones(1)), ValueError, "needs out_dtype"),
        (lambda: gemm(randn(2, 3), randn(3, 2), a_scale_inv=torch.ones(1)), ValueError, "not FP8"),
        (lambda: gemm(randn(2, 3), randn(3, 2), out_dtype=E4M3), ValueError, "not FP8"),
        (lambda: gemm(randn(2, 3), randn(3, 2), bias=randn(3)), ValueError, r"bias must be \[2\]"),
        (lambda: gemm(randn(2, 3), randn(3, 2), accumulate=True), ValueError, "out is None"),
        (lambda: gemm(randn(2, 3), randn(3, 2), out=torch.zeros(2, 3)), ValueError, r"output is \[2, 2\]"),
        (lambda: gemm(torch.ones(2, 3, dtype=torch.int32), randn(3, 2)), TypeError, "floating-point"),
    ],
)
def test_gemm_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_gemm_dispatch_through_ops():
    a, b = randn(3, 5), randn(4, 5)
    with with_preference("reference"), with_strict_mode():
        d, impl = ops.gemm.traced(a, b, trans_b=True)
    assert impl.impl_id == IMPL_ID
    assert torch.equal(d, gemm(a, b, trans_b=True))


# ---------------------------------------------------------------- block-scaled FP8
def _block(rows, cols, block):
    """(q, scale_inv, x64): E4M3 data in ``block`` tiles and the float64 values it stands for."""
    q, scale_inv = quantize_blockwise(randn(rows, cols), E4M3, block[0], block[1], power_2_scale=False, amax_epsilon=0.0)
    full = scale_inv.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q, scale_inv, q.double() * full


@pytest.mark.parametrize("a_block, b_block", [((1, 128), (128, 128)), ((128, 128), (1, 128)), ((1, 128), (1, 128)), ((1, 32), (1, 32))])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (130, 200, 129), (64, 256, 48)])
def test_gemm_blockwise_matches_the_dequantized_product(m, k, n, a_block, b_block):
    a, a_scale_inv, a64 = _block(m, k, a_block)
    b, b_scale_inv, b64 = _block(n, k, b_block)
    bias = randn(n)
    d = gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, torch.float32, bias=bias)
    torch.testing.assert_close(d.double(), a64 @ b64.t() + bias.double(), **_tols(torch.float32, k))
    out = randn(m, n, dtype=torch.bfloat16)
    expected = out.double() + a64 @ b64.t()
    assert gemm_blockwise(a, b, a_scale_inv.t().contiguous().t(), b_scale_inv, a_block, b_block, torch.bfloat16,
                          out=out, accumulate=True) is out  # scale_inv of any strides
    # bf16 rounding of the result, plus the float32 dot product's error where out and the product cancel
    torch.testing.assert_close(out.double(), expected, rtol=dtype_tols(torch.bfloat16)["rtol"], atol=_tols(torch.float32, k)["atol"])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: gemm_blockwise(randn(4, 8), _block(4, 8, (1, 4))[0], torch.ones(4, 2), torch.ones(4, 2), (1, 4), (1, 4), torch.float32),
         TypeError, "must be FP8"),
        (lambda: gemm_blockwise(*_block(4, 8, (1, 4))[:1], *_block(4, 8, (1, 4))[:1], torch.ones(4, 3), torch.ones(4, 2), (1, 4), (1, 4),
                                torch.float32), ValueError, "scale_inv has shape"),
        (lambda: gemm_blockwise(*_block(4, 8, (1, 4))[:1], *_block(4, 8, (1, 4))[:1], torch.ones(4, 2), torch.ones(4, 2), 4, (1, 4),
                                torch.float32), ValueError, "a_block=4"),
        (lambda: gemm_blockwise(*_block(4, 8, (1, 4))[:1], *_block(4, 12, (1, 4))[:1], torch.ones(4, 2), torch.ones(4, 3), (1, 4), (1, 4),
                                torch.float32), ValueError, "inner dimensions"),
        (lambda: gemm_blockwise(*_block(4, 8, (1, 4))[:1], *_block(4, 8, (1, 4))[:1], torch.ones(4, 2), torch.ones(4, 2), (1, 4), (1, 4),
                                torch.float32, accumulate=True), ValueError, "out is None"),
    ],
)
def test_gemm_blockwise_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
