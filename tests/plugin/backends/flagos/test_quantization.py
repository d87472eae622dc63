"""flagos FP8 casts vs the reference backend: bit-identical codes, scale_inv and amax.

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py), where the
kernels take the integer-emulated cast; the GPU takes the hardware cast (sm_89+). Both must give
the reference's saturating round-to-nearest-even codes bit for bit.
"""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, HP_DTYPES, assert_close, assert_dbias_close, assert_fp8_equal, wide_range
from tests.plugin.backends.reference.test_quantization import amaxes_to_fold, five_step_update, fold_then_update
from tests.utils import randn, sqnr
from transformer_engine.plugin.backends.flagos import activation as fa
from transformer_engine.plugin.backends.flagos import normalization as fn
from transformer_engine.plugin.backends.flagos import delayed_scaling as fd
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


# ---------------------------------------------------------------- delayed scaling update


def _histories(length, n, device):
    """H [L, N] over 40 decades (tiny amaxes overflow fp8_max / amax) with zeros, inf and NaN; s [N] > 0."""
    history = torch.rand(length, n) * 10.0 ** (torch.rand(length, n) * 40 - 20)
    pick = torch.rand(length, n)
    history[pick < 0.1] = 0.0
    history[(pick >= 0.1) & (pick < 0.15)] = math.inf
    history[(pick >= 0.15) & (pick < 0.2)] = math.nan
    return history.to(device), (torch.rand(n) * 4).to(device)


def _assert_bitwise_equal(actual, expected):
    """Same float32 bit patterns (NaN payloads and the sign of zero included)."""
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.cpu().view(torch.int32), expected.cpu().view(torch.int32))


def _assert_same_update(history, scale, fp8_max, margin, algo):
    actual = fd.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    expected = ref.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    for got, want in zip(actual, expected):
        _assert_bitwise_equal(got, want)


def _fp8_max_forms(n, device):
    """(margin, fp8_max): a float, a float32 [N] vector and a one-element tensor; margins 0 and 2."""
    return ((0.0, 448.0), (2.0, torch.rand(n, device=device) * 6e4), (2.0, torch.tensor([57344.0], device=device)))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("length", [1, 16])
def test_delayed_scaling_update_bit_exact(length, n, algo, device):
    history, scale = _histories(length, n, device)
    for margin, fp8_max in _fp8_max_forms(n, device):
        _assert_same_update(history, scale, fp8_max, margin, algo)


def test_delayed_scaling_update_edge_values(device):
    # amax 0, subnormal (s overflows to float32 max), normal, inf, NaN, negative; an infinite old
    # scale kept by an invalid amax also becomes float32 max; a non-integer margin
    row0 = torch.tensor([0.0, 1e-40, 3.0, math.inf, math.nan, -2.0, 0.0, 5.0])
    history = torch.stack([row0, torch.rand(8), torch.rand(8) * 10]).to(device)
    scale = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, math.inf, 0.5], device=device)
    for algo in ("max", "most_recent"):
        _assert_same_update(history, scale, 448.0, 0.3, algo)
    new_history, new_scale = fd.delayed_scaling_update(history, scale, 448.0, 1.0, "most_recent")
    fp32_max = torch.finfo(torch.float32).max
    assert torch.equal(new_scale[[0, 1, 2, 3, 6]].cpu(), torch.tensor([2.0, fp32_max, 448.0 / 3.0 / 2.0, 2.0, fp32_max]))
    _assert_bitwise_equal(new_history, torch.cat([torch.zeros(1, 8, device=device), history[[2, 0]]]))


def test_delayed_scaling_update_strided_and_low_precision_inputs(device):
    wide, scale = _histories(5, 22, device)
    history = wide[:, ::2]  # column stride 2
    _assert_same_update(history, scale[:11].bfloat16(), 448.0, 0.0, "max")
    _assert_same_update(history.t().contiguous().t(), scale[:11], torch.full((11,), 57344.0, dtype=torch.float64), 2.0, "max")
    _assert_same_update(history.bfloat16(), scale[:11], 448.0, 0.0, "most_recent")


def test_delayed_scaling_update_empty_errors_and_supports(device):
    new_history, new_scale = fd.delayed_scaling_update(torch.zeros(3, 0, device=device), torch.ones(0, device=device), 448.0, 0.0, "max")
    assert new_history.shape == (3, 0) and new_scale.shape == (0,)
    history, scale = torch.zeros(2, 3, device=device), torch.ones(3, device=device)
    with pytest.raises(ValueError, match="most_recent"):
        fd.delayed_scaling_update(history, scale, 448.0, 0.0, "mean")
    with pytest.raises(ValueError, match=r"needs \[3\]"):
        fd.delayed_scaling_update(history, scale[:2], 448.0, 0.0, "max")
    with pytest.raises(ValueError, match="fp8_max"):
        fd.delayed_scaling_update(history, scale, torch.ones(2), 0.0, "max")
    with pytest.raises(ValueError, match="margin"):
        fd.delayed_scaling_update(history, scale, 448.0, math.inf, "max")
    supports = fd.SUPPORTS["delayed_scaling_update"]
    verdict = supports(history, torch.ones(3, device="meta"), 448.0, 0.0, "max")
    assert not verdict and "device" in verdict.reason
    assert supports(history, scale, 448.0, 0.0, "max")


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_large_gpu(algo):
    history, scale = _histories(1024, 4096, "cuda")
    history[0, :4] = torch.tensor([1e-40, 1e-38, 0.0, 2.0**-149])  # subnormal amaxes: no flush to zero
    for margin, fp8_max in _fp8_max_forms(4096, "cuda"):
        _assert_same_update(history, scale, fp8_max, margin, algo)


def _idle_histories(length, n, device):
    """``_histories`` whose row 0 also holds idle columns (0, -0.0), NaN, inf, tiny and subnormal amaxes."""
    history, scale = _histories(length, n, device)
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, 1e-40, 2.0**-149, 1e-38, 3.0], device=device)
    history[0, : min(n, 8)] = special[: min(n, 8)]
    history[0, 8::3] = 0.0  # more idle columns among the random ones
    return history, scale


def _assert_same_update_(history, scale, scale_inv, fp8_max, margin, algo):
    """fd.delayed_scaling_update_ in place on (H, s, scale_inv) gives the 5-step sequence bit for bit."""
    expected = five_step_update(history, scale, fp8_max, margin, algo)
    assert fd.delayed_scaling_update_(history, scale, scale_inv, fp8_max, margin, algo) is None
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("length", [1, 2, 16, 31])
def test_delayed_scaling_update_in_place_bit_exact(length, n, algo, device):
    for margin, fp8_max in _fp8_max_forms(n, device):
        history, scale = _idle_histories(length, n, device)
        before = history.clone()
        _assert_same_update_(history, scale, torch.empty(n, device=device), fp8_max, margin, algo)
        idle = before[0] == 0
        _assert_bitwise_equal(history[:, idle], before[:, idle])  # idle columns untouched


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_in_place_long_history(algo, device):
    history, scale = _idle_histories(1024, 37, device)
    _assert_same_update_(history, scale, torch.empty(37, device=device), 448.0, 0.0, algo)


def test_delayed_scaling_update_in_place_strided(device):
    wide, scale_buf = _idle_histories(9, 24, device)
    wide_before, inv_buf = wide.clone(), torch.full((24,), 7.0, device=device)
    history, scale, scale_inv = wide[:, 3:14], scale_buf[:22:2], inv_buf[1::2][:11]  # a column slice, stride-2 vectors
    _assert_same_update_(history, scale, scale_inv, torch.rand(11, device=device) * 6e4, 2.0, "max")
    for outside in (slice(0, 3), slice(14, None)):
        _assert_bitwise_equal(wide[:, outside], wide_before[:, outside])
    assert torch.all(inv_buf[::2] == 7.0)
    history_t = _idle_histories(5, 11, device)[0].t().contiguous().t()  # column-major H
    _assert_same_update_(history_t, scale.clone(), torch.empty(11, device=device), 448.0, 0.0, "most_recent")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length, n", [(1, 7), (31, 300), (1024, 37)])
def test_delayed_scaling_update_in_place_folds_amax(length, n, algo, device):
    """``amax`` folded into H[0] in the kernel (NaN from either side, idle slots in both) gives the fold by
    torch.maximum then the reference's update, bit for bit, and leaves amax as it was; strided amax too."""
    history, scale = _idle_histories(length, n, device)
    wide = amaxes_to_fold(2 * n).to(device)
    amax = wide[::2]
    expected, wide_before = fold_then_update(history, scale, amax, 448.0, 1.0, algo), wide.clone()
    scale_inv = torch.empty(n, device=device)
    assert fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 1.0, algo, amax=amax) is None
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)
    _assert_bitwise_equal(wide, wide_before)
    verdict = fd.SUPPORTS["delayed_scaling_update_"](history, scale, scale_inv, 448.0, 0.0, "max", torch.ones(n, device="meta"))
    assert not verdict and "amax" in verdict.reason


@pytest.mark.parametrize("k", [1, 3, 37])
def test_delayed_scaling_update_in_place_folds_the_amaxes_of_the_first_k_columns(k, device):
    """``amax`` [K <= N] (a traced backward hands one grad cast's amax over as [1]): the reference's update
    bit for bit, columns K.. untouched by the fold, over more than one program's columns."""
    history, scale = _idle_histories(16, 37, device)
    amax = amaxes_to_fold(k).to(device)
    # no NaN in row 0 or amax: which NaN torch.maximum keeps depends on its CPU vector path; the NaN rule
    # of the fold is test_delayed_scaling_update_in_place_folds_amax's
    history[0] = torch.nan_to_num(history[0], nan=5.0)
    amax = torch.nan_to_num(amax, nan=7.0)
    expected = fold_then_update(history, scale, amax, 448.0, 0.0, "max")
    scale_inv = torch.empty(37, device=device)
    fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "max", amax=amax)
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)


def test_delayed_scaling_update_in_place_empty_errors_and_supports(device):
    empty = (torch.zeros(3, 0, device=device), torch.ones(0, device=device), torch.ones(0, device=device))
    assert fd.delayed_scaling_update_(*empty, 448.0, 0.0, "max") is None
    history, scale = _idle_histories(2, 3, device)
    scale_inv, before = torch.empty(3, device=device), (history.clone(), scale.clone())
    bad = [
        ((history, scale, scale_inv.double()), TypeError, "scale_inv has dtype torch.float64"),
        ((history.bfloat16(), scale, scale_inv), TypeError, "amax_history has dtype"),
        ((history, scale.half(), scale_inv), TypeError, "must be float32"),
        ((history, scale, scale_inv[:2]), ValueError, r"scale_inv has shape \(2,\).*needs \[3\]"),
        ((history, scale[:2], scale_inv), ValueError, r"needs \[3\]"),
        ((history, scale, torch.empty(3, device="meta")), ValueError, "device"),
        ((history, scale, [1.0, 1.0, 1.0]), TypeError, "scale_inv must be a torch.Tensor"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            fd.delayed_scaling_update_(*args, 448.0, 0.0, "max")
    with pytest.raises(ValueError, match="most_recent"):
        fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "mean")
    _assert_bitwise_equal(history, before[0])  # checked before any work
    _assert_bitwise_equal(scale, before[1])
    supports = fd.SUPPORTS["delayed_scaling_update_"]
    verdict = supports(history, scale, torch.ones(3, device="meta"), 448.0, 0.0, "max")
    assert not verdict and "scale_inv" in verdict.reason
    assert supports(history, scale, scale_inv, 448.0, 0.0, "max")


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_in_place_large_gpu(algo):
    history, scale = _idle_histories(1024, 4096, "cuda")
    for margin, fp8_max in _fp8_max_forms(4096, "cuda"):
        _assert_same_update_(history.clone(), scale.clone(), torch.empty(4096, device="cuda"), fp8_max, margin, algo)


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
        "layernorm_fwd": lambda: norm_mod.layernorm_fwd(x, ones, ones, 1e-5, False, scale, e4m3, None, amax_out),
        "rmsnorm_fwd": lambda: norm_mod.rmsnorm_fwd(x, ones, 1e-5, False, scale, e4m3, None, amax_out),
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


def _states_of_a_step(device):
    """(H, s, scale_inv) of five modules as one step leaves them: L 16 or 1, N 3 to 300 (several column
    blocks), idle and non-finite amaxes, and one state of strided views into larger buffers."""
    states = []
    for length, n in ((16, 3), (16, 6), (1, 5), (16, 300)):
        history, scale = _idle_histories(length, n, device)
        states.append((history, scale, torch.empty(n, device=device)))
    wide, scale_buf = _idle_histories(7, 30, device)
    states.append((wide[:, 4:12], scale_buf[:16:2], torch.empty(16, device=device)[1::2]))
    return states


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_many_is_each_state_update(algo, device):
    """One call updates every state exactly as the reference backend's delayed_scaling_update_ on each does, bit
    for bit, again on a second step (the cached table) and on new tensors of the same shapes (a new table)."""
    for states in (_states_of_a_step(device), _states_of_a_step(device)):
        for step in range(2):
            expected = [tuple(t.clone() for t in state) for state in states]
            for state in expected:
                ref.delayed_scaling_update_(*state, 448.0, 1.0, algo)
            assert fd.delayed_scaling_update_many_(*map(list, zip(*states)), 448.0, 1.0, algo) is None
            for got, want in zip(states, expected):
                for g, w in zip(got, want):
                    _assert_bitwise_equal(g, w)
            for history, _, _ in states:  # new amaxes for the next step
                history[0] = torch.rand_like(history[0]) * 100


def test_delayed_scaling_update_many_errors_before_any_work(device):
    states = _states_of_a_step(device)[:2]
    histories, scales, scale_invs = map(list, zip(*states))
    fd.delayed_scaling_update_many_(histories[:1], scales[:1], scale_invs[:1], 448.0, 0.0, "max")  # a cached table of state 0
    before = [tuple(t.clone() for t in state) for state in states]
    bad = [
        ((histories, scales[:1], scale_invs, 448.0), ValueError, "pass one of each per state"),
        ((histories, scales, scale_invs[:1], 448.0), ValueError, "pass one of each per state"),
        ((histories, scales, scale_invs, torch.tensor(448.0)), TypeError, "one float for every state"),
        (([histories[0]] * 2, [scales[0], scales[0].clone()], [scale_invs[0], scale_invs[0].clone()], 448.0), ValueError, "share memory"),
        ((histories, [scales[0], scales[1].double()], scale_invs, 448.0), TypeError, "must be float32"),
    ]
    for (h, s, i, fp8_max), error, match in bad:
        with pytest.raises(error, match=match):
            fd.delayed_scaling_update_many_(h, s, i, fp8_max, 0.0, "max")
    for got, want in zip(states, before):
        for g, w in zip(got, want):
            _assert_bitwise_equal(g, w)


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
