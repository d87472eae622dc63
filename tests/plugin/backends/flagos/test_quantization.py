"""flagos FP8 casts vs the reference backend: bit-identical codes, scale_inv and amax (delayed scaling:
test_delayed_scaling.py).

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py), where the
kernels take the integer-emulated cast; the GPU takes the hardware cast (sm_89+). Both must give
the reference's saturating round-to-nearest-even codes bit for bit.
"""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, HP_DTYPES, assert_close, assert_dbias_close, assert_fp8_equal, wide_range
from tests.utils import randn, sqnr
from transformer_engine.plugin.backends.flagos import activation as fa
from transformer_engine.plugin.backends.flagos import normalization as fn
from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.reference import activation as ra
from transformer_engine.plugin.backends.reference import normalization as rn
from transformer_engine.plugin.backends.reference import quantization as ref


def _scale(device):
    return torch.exp(torch.randn(1)).float().to(device)


def _assert_same_quantize(actual, expected):
    q, scale_inv, amax = actual
    q_ref, scale_inv_ref, amax_ref = expected
    assert_fp8_equal(q, q_ref)
    assert scale_inv.shape == amax.shape == () and scale_inv.dtype == amax.dtype == torch.float32
    assert torch.equal(scale_inv.cpu(), scale_inv_ref.cpu()) and torch.equal(amax.cpu(), amax_ref.cpu())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 131), (2, 5, 17)])
def test_quantize_bit_exact(shape, dtype, fp8_dtype, device):
    x, scale = wide_range(shape, dtype, device), _scale(device)
    _assert_same_quantize(fq.quantize(x, scale, fp8_dtype), ref.quantize(x, scale, fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_every_bfloat16_and_every_tie(fp8_dtype, device):
    # every bfloat16 bit pattern (subnormals, inf, NaN of both signs), plus the float32 midpoints
    # between neighbouring FP8 values, where round-half-to-even decides
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([every_bf16, ties, -ties]).to(device)
    one = torch.ones(1, device=device)
    _assert_same_quantize(fq.quantize(x, one, fp8_dtype), ref.quantize(x, one, fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_saturates_and_keeps_nan(fp8_dtype, device):
    fp8_max = torch.finfo(fp8_dtype).max
    x = torch.tensor([math.inf, -math.inf, 1e30, -1e30, 2 * fp8_max, math.nan, 3.0, -0.0], device=device)
    q, _, amax = fq.quantize(x, torch.ones(1, device=device), fp8_dtype)
    values = q.float().cpu()
    assert values[:5].tolist() == [fp8_max, -fp8_max, fp8_max, -fp8_max, fp8_max]
    assert torch.isnan(values[5]) and values[6].item() == 3.0 and torch.signbit(values[7])
    assert amax.item() == torch.tensor(1e30).item()


def test_quantize_empty_and_all_non_finite(device):
    scale = torch.tensor([4.0], device=device)
    q, scale_inv, amax = fq.quantize(torch.empty(0, 3, device=device), scale, torch.float8_e4m3fn)
    assert q.shape == (0, 3) and amax.item() == 0.0 and scale_inv.item() == 0.25
    assert fq.quantize(torch.tensor([math.nan, -math.inf], device=device), scale, torch.float8_e5m2)[2].item() == 0.0


@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize_every_code(fp8_dtype, out_dtype, device):
    q = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).reshape(16, 16).to(device)
    scale_inv = _scale(device)
    x, expected = fq.dequantize(q, scale_inv, out_dtype), ref.dequantize(q, scale_inv, out_dtype)
    finite = torch.isfinite(expected.cpu())
    assert torch.equal(torch.isnan(x.cpu()), torch.isnan(expected.cpu()))
    assert torch.equal(x.cpu()[~finite & ~torch.isnan(expected.cpu())], expected.cpu()[~finite & ~torch.isnan(expected.cpu())])
    if out_dtype == torch.float32:  # one float32 product on both sides: exact
        assert torch.equal(x.cpu()[finite], expected.cpu()[finite])
    else:
        assert_close(x.cpu()[finite], expected.cpu()[finite])


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_dequantize_sqnr(fp8_dtype, device):
    # N(0, 1) with amax mapped to fp8_max: E4M3 keeps 3 mantissa bits (~31 dB), E5M2 2 (~25 dB)
    x = randn(33, 65, device=device)
    scale = torch.finfo(fp8_dtype).max / x.abs().max().reshape(1)
    q, scale_inv, _ = fq.quantize(x, scale, fp8_dtype)
    assert sqnr(x, fq.dequantize(q, scale_inv, torch.float32)) > (25.0 if fp8_dtype == torch.float8_e4m3fn else 19.0)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (37, 1), (65, 130)])
def test_cast_transpose(shape, dtype, device):
    x, scale = wide_range(shape, dtype, device), _scale(device)
    q, q_t, scale_inv, amax = fq.cast_transpose(x, scale, torch.float8_e4m3fn)
    q_ref, q_t_ref, scale_inv_ref, amax_ref = ref.cast_transpose(x, scale, torch.float8_e4m3fn)
    assert q_t.is_contiguous() and q_t.shape == (shape[1], shape[0])
    _assert_same_quantize((q, scale_inv, amax), (q_ref, scale_inv_ref, amax_ref))
    assert_fp8_equal(q_t, q_t_ref)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (65, 130)])
def test_quantize_transposed(shape, dtype, fp8_dtype, device):
    x, scale = wide_range(shape, dtype, device), _scale(device)
    q_t, scale_inv, amax = fq.quantize_transposed(x, scale, fp8_dtype)
    assert q_t.is_contiguous() and q_t.shape == (shape[1], shape[0])
    _assert_same_quantize((q_t, scale_inv, amax), ref.quantize_transposed(x, scale, fp8_dtype))


def test_quantize_transposed_strided_rows_and_errors(device):
    wide = wide_range((9, 70), torch.bfloat16, device)
    x, scale = wide[:, 3:68], _scale(device)  # row stride 70, 65 columns
    _assert_same_quantize(fq.quantize_transposed(x, scale, torch.float8_e5m2), ref.quantize_transposed(x, scale, torch.float8_e5m2))
    with pytest.raises(ValueError, match="2-D"):
        fq.quantize_transposed(wide.reshape(3, 3, 70), scale, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 dtype"):
        fq.quantize_transposed(x, scale, torch.bfloat16)


def test_cast_transpose_strided_rows(device):
    wide = wide_range((9, 70), torch.bfloat16, device)
    x, scale = wide[:, 3:68], _scale(device)  # row stride 70, 65 columns
    q, q_t, _, amax = fq.cast_transpose(x, scale, torch.float8_e5m2)
    q_ref, q_t_ref, _, amax_ref = ref.cast_transpose(x, scale, torch.float8_e5m2)
    assert_fp8_equal(q, q_ref)
    assert_fp8_equal(q_t, q_t_ref)
    assert torch.equal(amax.cpu(), amax_ref.cpu())


def _assert_same_cast_transpose_dbias(actual, expected, x):
    q, q_t, scale_inv, amax, dbias = actual
    q_ref, q_t_ref, scale_inv_ref, amax_ref, dbias_ref = expected
    assert q_t.is_contiguous() and q_t.shape == (x.shape[1], x.shape[0])
    _assert_same_quantize((q, scale_inv, amax), (q_ref, scale_inv_ref, amax_ref))
    assert_fp8_equal(q_t, q_t_ref)
    assert_dbias_close(dbias, dbias_ref, x)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (65, 130)])
def test_cast_transpose_dbias(shape, dtype, fp8_dtype, device):
    x, scale = wide_range(shape, dtype, device), _scale(device)
    expected = ref.cast_transpose_dbias(x, scale, fp8_dtype)
    _assert_same_cast_transpose_dbias(fq.cast_transpose_dbias(x, scale, fp8_dtype), expected, x)


def test_cast_transpose_dbias_sums_integers_exactly(device):
    # small integers sum exactly in float32 in any order: every element counted once, masked lanes
    # 0; 260 rows = two full 128-row tiles and a ragged one, strided rows of 67 columns
    wide = torch.randint(-8, 9, (260, 72)).to(torch.bfloat16).to(device)
    x = wide[:, 2:69]
    dbias = fq.cast_transpose_dbias(x, torch.ones(1, device=device), torch.float8_e4m3fn)[4]
    assert torch.equal(dbias.cpu(), x.cpu().double().sum(0).float())


def test_cast_transpose_dbias_non_finite_and_empty(device):
    x = randn(70, 5)
    x[3, 0] = math.nan
    x[5, 1] = math.inf
    x[6, 2], x[66, 2] = math.inf, -math.inf  # in two tiles: inf - inf = NaN
    x[1, 3] = -math.inf
    x = x.to(device)
    dbias = fq.cast_transpose_dbias(x, torch.ones(1, device=device), torch.float8_e5m2)[4].cpu()
    assert torch.isnan(dbias[0]) and dbias[1].item() == math.inf and torch.isnan(dbias[2])
    assert dbias[3].item() == -math.inf and math.isfinite(dbias[4].item())
    empty = torch.empty(0, 5, device=device)
    scale = torch.tensor([4.0], device=device)
    q, q_t, scale_inv, amax, dbias = fq.cast_transpose_dbias(empty, scale, torch.float8_e4m3fn)
    assert q.shape == (0, 5) and q_t.shape == (5, 0) and scale_inv.item() == 0.25 and amax.item() == 0.0
    assert dbias.dtype == torch.float32 and dbias.cpu().tolist() == [0.0] * 5


def _stored_as(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values as a kernel stores them in ``dtype``: rounded to nearest even on a GPU; Triton's CPU
    interpreter keeps the upper 16 bits of a float32 stored as bfloat16 (it truncates)."""
    if dtype == torch.bfloat16 and not sums.is_cuda:
        return (sums.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return sums.to(dtype)


@pytest.mark.parametrize("dbias_dtype", [torch.bfloat16, torch.float16])
def test_cast_transpose_dbias_in_the_bias_dtype_is_the_float32_sum_rounded_once(dbias_dtype, device):
    x = randn(260, 67, dtype=torch.bfloat16, device=device)
    scale = torch.ones(1, device=device)
    *_, dbias = fq.cast_transpose_dbias(x, scale, torch.float8_e4m3fn, dbias_dtype=dbias_dtype)
    *_, dbias32 = fq.cast_transpose_dbias(x, scale, torch.float8_e4m3fn)
    assert dbias.dtype == dbias_dtype and torch.equal(dbias, _stored_as(dbias32, dbias_dtype))
    with pytest.raises(ValueError, match="dbias_dtype"):
        fq.cast_transpose_dbias(x, scale, torch.float8_e4m3fn, dbias_dtype=torch.float8_e4m3fn)


def test_cast_transpose_dbias_errors_and_supports(device):
    with pytest.raises(ValueError, match="2-D"):
        fq.cast_transpose_dbias(randn(2, 2, 4, device=device), torch.ones(1, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype"):
        fq.cast_transpose_dbias(randn(4, 4, device=device), torch.ones(1, device=device), torch.bfloat16)
    x, supports = randn(4, 4, device=device), fq.SUPPORTS["cast_transpose_dbias"]
    verdict = supports(x, torch.ones(1, dtype=torch.float64, device=device), torch.float8_e4m3fn)
    assert not verdict and "float32" in verdict.reason
    assert supports(x, torch.ones(1, device=device), torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(1, 1), (5, 67), (70, 3)])
def test_fp8_transpose(shape, device):
    q = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn).to(device)
    assert_fp8_equal(fq.fp8_transpose(q), ref.fp8_transpose(q))
    assert_fp8_equal(fq.fp8_transpose(q.t()), ref.fp8_transpose(q.t()))  # strided input


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 1001)])
def test_compute_amax(shape, dtype, device):
    x = wide_range(shape, dtype, device)
    if x.numel() > 2:
        x.view(-1)[1], x.view(-1)[2] = math.nan, -math.inf
    amax = fq.compute_amax(x)
    assert amax.shape == () and torch.equal(amax.cpu(), ref.compute_amax(x).cpu())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("eps, power_2", [(0.0, False), (1e-3, False), (0.0, True)])
def test_current_scale_bit_exact(fp8_dtype, eps, power_2, device):
    """One launch (amax, then the scale by the last program) equals the reference's amax and scale ops."""
    cases = [randn(3 * 8192 + 77, scale=s, device=device) for s in (1e-3, 3.0, 2e4)]  # several programs
    cases += [torch.zeros(9, device=device), torch.empty(0, device=device), randn(5, 7, dtype=torch.bfloat16, device=device),
              torch.tensor([math.inf, math.nan, -2.5], device=device), torch.tensor([1e-40], device=device)]
    for x in cases:
        scale, amax = fq.current_scale(x, fp8_dtype, eps, power_2)
        ref_scale, ref_amax = ref.current_scale(x, fp8_dtype, eps, power_2)
        assert scale.shape == amax.shape == () and scale.dtype == amax.dtype == torch.float32
        assert torch.equal(amax.cpu(), ref_amax.cpu()) and torch.equal(scale.cpu(), ref_scale.cpu()), x.flatten()[:3]
    with pytest.raises(ValueError, match="amax_epsilon=1e\\+39 must be 0, a float32 value > 0 or inf"):
        fq.current_scale(cases[0], fp8_dtype, 1e39)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_amax_skips_blocks_without_a_finite_element(fp8_dtype, device):
    # kernels reduce 4096-element blocks: block 0 all inf / NaN, block 1 finite, the short last one NaN
    x = randn(3 * 4096 + 5, device=device)
    x[:4096] = torch.tensor([math.inf, -math.inf, math.nan, -math.nan], device=device).repeat(1024)
    x[2 * 4096 :] = math.nan
    scale = _scale(device)
    _assert_same_quantize(fq.quantize(x, scale, fp8_dtype), ref.quantize(x, scale, fp8_dtype))
    assert torch.equal(fq.compute_amax(x).cpu(), ref.compute_amax(x).cpu())
    blocks = x[: 3 * 4096].reshape(384, 32)  # its 128 x 64 tiles over 32 columns: the same 4096-element blocks
    for cast in (fq.cast_transpose, fq.quantize_transposed):
        assert torch.equal(cast(blocks, scale, fp8_dtype)[-1].cpu(), ref.compute_amax(blocks).cpu())


def test_errors_and_supports(device):
    x = randn(4, 4, device=device)
    with pytest.raises(ValueError, match="fp8_dtype"):
        fq.quantize(x, torch.ones(1, device=device), torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        fq.quantize(x.int(), torch.ones(1, device=device), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="2-D"):
        fq.cast_transpose(x.reshape(2, 2, 4), torch.ones(1, device=device), torch.float8_e4m3fn)
    verdict = fq.SUPPORTS["quantize"](x, torch.ones(1, dtype=torch.float64, device=device), torch.float8_e4m3fn)
    assert not verdict and "float32" in verdict.reason
    assert fq.SUPPORTS["quantize"](x, torch.ones(1, device=device), torch.float8_e4m3fn)


@pytest.mark.gpu
def test_current_scale_large_gpu():
    """4096 programs race to finish: the last one must see every program's max (five fresh draws)."""
    for _ in range(5):
        x = randn(8192, 4096, dtype=torch.bfloat16, scale=float(torch.rand(()) * 100), device="cuda")
        x.view(-1)[int(torch.randint(0, x.numel(), ()))] = 1e4  # the max sits in one random program
        scale, amax = fq.current_scale(x, torch.float8_e4m3fn)
        ref_scale, ref_amax = ref.current_scale(x, torch.float8_e4m3fn)
        assert torch.equal(amax, ref_amax) and torch.equal(scale, ref_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_large_casts_bit_exact_gpu(fp8_dtype):
    x = wide_range((2049, 4097), torch.bfloat16, "cuda")
    scale = _scale("cuda")
    _assert_same_quantize(fq.quantize(x, scale, fp8_dtype), ref.quantize(x, scale, fp8_dtype))
    q, q_t, scale_inv, amax = fq.cast_transpose(x, scale, fp8_dtype)
    q_ref, q_t_ref, scale_inv_ref, amax_ref = ref.cast_transpose(x, scale, fp8_dtype)
    _assert_same_quantize((q, scale_inv, amax), (q_ref, scale_inv_ref, amax_ref))
    assert_fp8_equal(q_t, q_t_ref)
    assert torch.equal(fq.dequantize(q, scale_inv, torch.float32), ref.dequantize(q, scale_inv, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(16, 16), (64, 64), (100, 70), (8192, 4096)])
def test_cast_transpose_writes_the_transpose_gpu(dtype, shape):
    # full tiles of float32 once gave a wrong q_t on the H200 (Triton transposing 8-bit tiles of 32-bit loads)
    x, scale = randn(*shape, dtype=dtype, device="cuda"), _scale("cuda")
    for cast in (fq.cast_transpose, fq.cast_transpose_dbias):
        q, q_t = cast(x, scale, torch.float8_e5m2)[:2]
        assert_fp8_equal(q_t, q.t().contiguous())
        assert_fp8_equal(q, ref.quantize(x, scale, torch.float8_e5m2)[0])
    assert_fp8_equal(fq.quantize_transposed(x, scale, torch.float8_e5m2)[0], q_t)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_transpose_dbias_gpu(fp8_dtype):
    # a linear layer's dy at a training shape: 128 tile rows of partial sums per column
    x, scale = randn(8192, 4096, dtype=torch.bfloat16, device="cuda"), _scale("cuda")
    actual = fq.cast_transpose_dbias(x, scale, fp8_dtype)
    _assert_same_cast_transpose_dbias(actual, ref.cast_transpose_dbias(x, scale, fp8_dtype), x)
    assert_dbias_close(actual[4], x.double().sum(0), x)  # and against the float64 formula


# ---------------------------------------------------------------- amax_out: the cast's amax lands in a history slot

_AMAX_AT = {"quantize": 2, "cast_transpose": 3, "quantize_transposed": 2, "cast_transpose_dbias": 3, "layernorm_fwd": 4, "rmsnorm_fwd": 3,
            "activation_quantize": 2}


def _cast_op(op, backend, x, scale, amax_out):
    """(result tuple, amax) of one FP8-writing op of ``backend`` ((quantization, normalization, activation) modules)."""
    q_mod, norm_mod, act_mod = backend
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    e4m3 = torch.float8_e4m3fn
    calls = {
        "quantize": lambda: q_mod.quantize(x, scale, e4m3, amax_out),
        "cast_transpose": lambda: q_mod.cast_transpose(x, scale, e4m3, amax_out),
        "quantize_transposed": lambda: q_mod.quantize_transposed(x, scale, e4m3, amax_out),
        "cast_transpose_dbias": lambda: q_mod.cast_transpose_dbias(x, scale, e4m3, amax_out),
        "layernorm_fwd": lambda: norm_mod.layernorm_fwd(x, ones, ones, 1e-5, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=e4m3,
                                                        out_dtype=None, amax_out=amax_out),
        "rmsnorm_fwd": lambda: norm_mod.rmsnorm_fwd(x, ones, 1e-5, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=e4m3,
                                                    out_dtype=None, amax_out=amax_out),
        "activation_quantize": lambda: act_mod.activation_quantize(x, "gelu", scale, e4m3, 7.0, 1.702, amax_out),
    }
    result = calls[op]()
    return result, result[_AMAX_AT[op]]


@pytest.mark.parametrize("op", list(_AMAX_AT))
@pytest.mark.parametrize("start", ["below", "above"])
def test_amax_out_accumulates_into_the_slot(op, start, device):
    x, scale = randn(37, 24).to(device), _scale(device)
    for backend in ((fq, fn, fa), (ref, rn, ra)):
        plain, amax = _cast_op(op, backend, x, scale, None)
        history = torch.full((3, 4), 0.25, device=device)
        history[0, 2] = 0.0 if start == "below" else 2 * amax.item()
        before = history.clone()
        slot = history[0, 2]
        result, returned = _cast_op(op, backend, x, scale, slot)
        expected = before.clone()
        expected[0, 2] = torch.maximum(before[0, 2], amax)
        assert torch.equal(history, expected)  # only the slot moved, to max(slot, amax)
        assert returned.data_ptr() == slot.data_ptr() and returned.shape == ()
        assert_fp8_equal(result[0], plain[0])


def test_current_scale_calls_do_not_see_each_other(device):
    """Consecutive casts share the stream's counters, which each launch leaves zero: a small tensor after a
    large one (many programs) gets its own amax and scale, not the larger one's."""
    from transformer_engine.plugin.backends.flagos._common import stream_counters

    large, small = torch.randn(40000, device=device) * 50, torch.randn(300, device=device)
    for x in (large, small, large, small):
        scale, amax = fq.current_scale(x, torch.float8_e4m3fn)
        assert amax.item() == x.abs().max().item()
        torch.testing.assert_close(scale, torch.tensor(448.0, device=device) / amax, rtol=1e-6, atol=0)
        assert stream_counters(x.device).tolist() == [0, 0]
