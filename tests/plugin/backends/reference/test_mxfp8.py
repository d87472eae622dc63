"""Reference MXFP8 ops vs the independent model of the format in ``tests/mxfp8_spec.py``, bit for bit.

Block scales (E8M0 codes) and FP8 codes are compared exactly, on random data spanning many binades,
on zero blocks, saturation, NaN / +-inf, the extremes of float32, bf16 and fp16 inputs, E4M3 and E5M2;
the decode and the emulated GEMM are compared with the model's float64 values.
"""

import math

import pytest
import torch

from tests.mxfp8_spec import pow2, spec_qdq, spec_quantize, spec_scales
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import mxfp8 as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _assert_copy_matches_spec(q, s, x, fp8_dtype):
    """q [R, C], s [R, C / 32] are the MXFP8 row-wise copy of x [R, C] (codes exact; NaN only where the spec has it)."""
    q_spec, s_spec = spec_quantize(x, fp8_dtype)
    assert s.dtype == torch.uint8 and torch.equal(s.long(), s_spec)
    nan = torch.isnan(q_spec)
    assert torch.equal(torch.isnan(q.float()), nan)
    assert torch.equal(_codes(q)[~nan], _codes(q_spec.to(fp8_dtype))[~nan])


def _wide_range(shape, dtype=torch.float32):
    """Random signs and magnitudes 1e-8 .. 1e8, each block of 32 with its own spread."""
    magnitude = 10.0 ** (torch.rand(shape) * 16 - 8)
    return (torch.randn(shape).sign() * magnitude).to(dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (96, 224), (32, 1024)])
def test_quantize_matches_the_spec_bit_for_bit(shape, dtype, fp8_dtype):
    x = _wide_range(shape, dtype) if dtype is not torch.float16 else torch.randn(shape, dtype=dtype) * 100
    data, scale, data_t, scale_t = ops.quantize_mxfp8(x, fp8_dtype, rowwise=True, columnwise=True)
    assert data.shape == shape and data.dtype == fp8_dtype and scale.shape == (shape[0], shape[1] // 32)
    assert data_t.shape == shape[::-1] and scale_t.shape == (shape[1], shape[0] // 32)
    _assert_copy_matches_spec(data, scale, x, fp8_dtype)
    _assert_copy_matches_spec(data_t, scale_t, x.t().contiguous(), fp8_dtype)


def test_the_copies_are_asked_for_separately():
    x = torch.randn(64, 32)
    data, scale, none_t, none_st = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    assert none_t is None and none_st is None
    none, none_s, data_t, scale_t = ops.quantize_mxfp8(x, E4M3, rowwise=False, columnwise=True)
    assert none is None and none_s is None
    both = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=True)
    assert torch.equal(_codes(both[0]), _codes(data)) and torch.equal(_codes(both[2]), _codes(data_t))
    # the column-wise copy is a quantization of x^T, not the transpose of the row-wise one
    assert not torch.equal(_codes(data_t), _codes(data).t())


def test_scale_rounds_up_so_the_block_max_does_not_saturate():
    """scale = 2^ceil(log2(amax / 448)): amax = 448 * 2^k is exactly representable, amax just above it
    takes the next power of two (OCP's floor rule would saturate it instead)."""
    x = torch.zeros(1, 64)
    x[0, 0] = 448.0 * 2.0**-10  # block 0: amax / 448 = 2^-10
    x[0, 32] = 449.0 * 2.0**-10  # block 1: just above, rounded up to 2^-9
    data, scale, _, _ = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    assert scale.tolist() == [[127 - 10, 127 - 9]]
    assert data.float()[0, 0] == 448.0 and data.float()[0, 32] == 224.0  # 449 / 2 = 224.5 rounds to 224
    assert torch.equal(ops.dequantize_mxfp8(data, scale, torch.float32)[0, 0], x[0, 0])


def test_zero_blocks_get_the_smallest_scale_and_decode_to_zero():
    x = torch.zeros(32, 64)
    x[:, 32:] = torch.randn(32, 32)
    x[3, 40] = -0.0
    data, scale, data_t, scale_t = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=True)
    assert (scale[:, 0] == 0).all() and (scale[:, 1] > 0).all()  # 2^-127 for an all-zero block
    assert (data.float()[:, :32] == 0).all()
    assert (scale_t[:32] == 0).all()
    assert torch.equal(ops.dequantize_mxfp8(data, scale, torch.float32)[:, :32], x[:, :32])


def test_nan_and_inf():
    """NaN is ignored by the block amax (TE's fmaxf) and stays NaN; inf makes the block's scale 2^127
    (254), saturates to fp8_max (decoding to inf) and flushes the block's finite values to zero."""
    x = torch.randn(4, 64)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 33] = float("-inf")
    data, scale, _, _ = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    _assert_copy_matches_spec(data, scale, x, E4M3)
    finite_row = x[:1, :32].clone()
    finite_row[0, 5] = 0.0
    assert scale[0, 0] == spec_scales(finite_row, E4M3)[0, 0]  # the NaN did not change the block's scale
    assert torch.isnan(data.float()[0, 5]) and torch.isfinite(data.float()[0, :5]).all()
    assert scale[1, 0] == 254 and scale[2, 1] == 254
    assert data.float()[1, 7] == 448.0 and data.float()[2, 33] == -448.0
    assert (data.float()[1, :7] == 0).all()
    decoded = ops.dequantize_mxfp8(data, scale, torch.float32)
    assert decoded[1, 7] == float("inf") and decoded[2, 33] == float("-inf") and torch.isnan(decoded[0, 5])


def test_float32_extremes():
    x = torch.zeros(3, 32)
    x[0, :] = FP32_MAX  # amax / 448 ~ 2^119.2 -> 2^120
    x[1, :] = torch.finfo(torch.float32).tiny  # 2^-126: v = 2^-126 / 448 < 2^-127 -> the smallest scale
    x[2, :3] = torch.tensor([1e-45, 2e-45, 5e-44])  # float32 subnormals
    data, scale, _, _ = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    _assert_copy_matches_spec(data, scale, x, E4M3)
    assert scale[0, 0] == 127 + 120 and scale[1, 0] == 0 and scale[2, 0] == 0


def test_e8m0_round_up_at_the_bit_level():
    """The float32 -> E8M0 rule on chosen v: exact powers of two keep their exponent, anything above rounds
    up, v <= 2^-127 (zero, small subnormals) is code 0, saturation at 254 (inf too), NaN 255."""
    v = torch.tensor([2.0**-3, 2.0**-3 * (1 + 2**-23), 2.0**-127, 2.0**-127 * 1.5, 2.0**-140, 0.0, 2.0**127,
                      float("inf"), float("nan")], dtype=torch.float64).float()
    assert ref.e8m0_round_up(v).tolist() == [124, 125, 0, 1, 0, 0, 254, 254, 255]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_dequantize_is_the_spec_decode(fp8_dtype):
    x = _wide_range((64, 128))
    data, scale, _, _ = ops.quantize_mxfp8(x, fp8_dtype, rowwise=True, columnwise=False)
    decoded = ops.dequantize_mxfp8(data, scale, torch.float32)
    assert torch.equal(decoded.double(), spec_qdq(x, fp8_dtype))
    assert torch.equal(ops.dequantize_mxfp8(data, scale, torch.bfloat16), decoded.bfloat16())


def test_dequantize_scale_codes_at_the_ends():
    q = torch.full((2, 32), 1.0).to(E4M3)
    scale = torch.tensor([[0], [255]], dtype=torch.uint8)
    decoded = ops.dequantize_mxfp8(q, scale, torch.float32)
    assert (decoded[0] == 2.0**-127).all() and torch.isnan(decoded[1]).all()
    assert torch.equal(ref.decode_scale(torch.arange(256, dtype=torch.uint8))[1:255].double(), pow2(torch.arange(1, 255) - 127))


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_is_the_float32_gemm_of_the_decoded_operands(accumulate):
    a_hp, b_hp, bias = torch.randn(48, 96), torch.randn(40, 96), torch.randn(40)
    a, a_s, _, _ = ops.quantize_mxfp8(a_hp, E4M3, rowwise=True, columnwise=False)
    b, b_s, _, _ = ops.quantize_mxfp8(b_hp, E4M3, rowwise=True, columnwise=False)
    expected = spec_qdq(a_hp) @ spec_qdq(b_hp).t() + bias.double()
    if accumulate:
        out = torch.randn(48, 40)
        expected = expected + out.double()
        result = ops.gemm_mxfp8(a, b, a_s, b_s, torch.float32, bias, out, accumulate=True)
        assert result is out
    else:
        result = ops.gemm_mxfp8(a, b, a_s, b_s, torch.bfloat16, bias)
        assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result.double(), expected, rtol=1.6e-2 if not accumulate else 1e-5, atol=1e-4)


# -- clear errors where TE requires alignment ------------------------------------------------------
def test_alignment_errors_name_the_dim():
    with pytest.raises(ValueError, match=r"last dim \(48\) must be divisible by 32"):
        ops.quantize_mxfp8(torch.randn(32, 48), E4M3, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match=r"column-wise .* first dim \(16\) must be divisible by 32"):
        ops.quantize_mxfp8(torch.randn(16, 64), E4M3, rowwise=True, columnwise=True)
    data, _, _, _ = ops.quantize_mxfp8(torch.randn(16, 64), E4M3, rowwise=True, columnwise=False)  # row-wise only: rows are free
    assert data.shape == (16, 64)
    ops.quantize_mxfp8(torch.randn(64, 16), E4M3, rowwise=False, columnwise=True)  # column-wise only: features are free


def test_argument_errors():
    with pytest.raises(ValueError, match="2-D"):
        ops.quantize_mxfp8(torch.randn(2, 32, 32), E4M3, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="at least one copy"):
        ops.quantize_mxfp8(torch.randn(32, 32), E4M3, rowwise=False, columnwise=False)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ops.quantize_mxfp8(torch.randn(32, 32).to(E4M3), E4M3, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        ops.quantize_mxfp8(torch.randn(32, 32), torch.bfloat16, rowwise=True, columnwise=False)
    q, s, _, _ = ops.quantize_mxfp8(torch.randn(32, 64), E4M3, rowwise=True, columnwise=False)
    with pytest.raises(TypeError, match="uint8"):
        ops.dequantize_mxfp8(q, s.float(), torch.float32)
    with pytest.raises(ValueError, match="scales"):
        ops.dequantize_mxfp8(q, s[:, :1], torch.float32)
    b, b_s, _, _ = ops.quantize_mxfp8(torch.randn(32, 32), E4M3, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="inner dimensions"):
        ops.gemm_mxfp8(q, b, s, b_s, torch.float32)


def test_empty_tensors():
    data, scale, data_t, scale_t = ops.quantize_mxfp8(torch.randn(0, 64), E4M3, rowwise=True, columnwise=True)
    assert data.shape == (0, 64) and scale.shape == (0, 2) and data_t.shape == (64, 0) and scale_t.shape == (64, 0)


def test_traces_as_custom_ops_without_graph_breaks():
    def roundtrip(x):
        data, scale, data_t, scale_t = ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=True)
        return ops.dequantize_mxfp8(data, scale, torch.float32), ops.dequantize_mxfp8(data_t, scale_t, torch.float32), \
            ops.gemm_mxfp8(data, data, scale, scale, torch.float32)

    x = torch.randn(64, 64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(roundtrip)(x)
    assert explained.graph_break_count == 0
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    for c, e in zip(compiled(x), roundtrip(x)):
        assert torch.equal(c, e)


def test_rowwise_only_returns_none_under_compile():
    def rowwise(x):
        return ops.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)

    torch._dynamo.reset()
    data, scale, data_t, scale_t = torch.compile(rowwise, fullgraph=True, backend="aot_eager")(torch.randn(16, 64))
    assert data_t is None and scale_t is None and data.shape == (16, 64)


def test_rcp_is_the_float32_reciprocal():
    assert ref._rcp_fp8_max(E4M3) == float(torch.tensor(1 / 448, dtype=torch.float32))
    assert not math.log2(1 / ref._rcp_fp8_max(E4M3)).is_integer()  # not a power of two: the product rounds
