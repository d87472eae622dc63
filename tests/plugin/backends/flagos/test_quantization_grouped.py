"""flagos cast_transpose_grouped and current_scale_grouped vs the flagos per-split ops: bit-identical results.

Split g of x (rows o_g .. o_g + m_g - 1) cast with scale[g] must give the codes of cast_transpose(x_g, scale[g]),
in q's rows and q_t's columns of the split, whatever the splits (empty ones, ones straddling the kernel's 128-row
tiles); amax[g] is that cast's amax and scale_inv[g] = 1 / scale[g]. current_scale_grouped's (scale[g], amax[g])
are the bits of current_scale(x_g). Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py).
"""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, HP_DTYPES, assert_fp8_equal, wide_range
from tests.utils import randn
from transformer_engine.plugin.backends._splits import split_bounds, split_ends
from transformer_engine.plugin.backends.flagos._common import stream_counters
from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.flagos import quantization_grouped as fg

SPLITS = [
    [300],  # one split
    [0, 129, 0, 1, 127, 43],  # empty splits (first and inner), a tile holding three splits
    [128, 128, 44],  # on the tile boundaries
    [70, 0, 0, 230, 0],  # trailing empty split
    [5] * 60,  # many small splits: 60 groups, GP = 64
]


def _scales(groups, device):
    return torch.exp(torch.randn(groups)).float().to(device)


def _per_split(x, m_splits, scale, fp8_dtype):
    """(q, q_t, scale_inv, amax) assembled from one flagos cast_transpose per split."""
    results, start = [], 0
    for g, rows in enumerate(m_splits):
        results.append(fq.cast_transpose(x[start : start + rows], scale[g : g + 1], fp8_dtype))
        start += rows
    q, q_t, scale_inv, amax = zip(*results)
    return torch.cat(q), torch.cat(q_t, dim=1), torch.stack(scale_inv), torch.stack(amax)


def _assert_as_per_split(actual, x, m_splits, scale, fp8_dtype):
    """The grouped outputs equal the per-split casts bit for bit; scale_inv is float32 [G], 16-byte aligned elements."""
    q, q_t, scale_inv, amax = actual
    q_ref, q_t_ref, scale_inv_ref, amax_ref = _per_split(x, m_splits, scale, fp8_dtype)
    assert q.shape == tuple(x.shape) and q_t.is_contiguous()
    assert_fp8_equal(q, q_ref)
    assert_fp8_equal(q_t, q_t_ref)
    assert scale_inv.dtype == amax.dtype == torch.float32 and scale_inv.shape == amax.shape == (len(m_splits),)
    assert torch.equal(scale_inv.cpu(), scale_inv_ref.cpu())
    assert torch.equal(scale_inv.cpu(), torch.reciprocal(scale.cpu()))
    assert all(scale_inv[g].data_ptr() % 16 == 0 for g in range(len(m_splits)))
    assert torch.equal(amax.cpu(), amax_ref.cpu())


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_grouped_is_the_cast_transpose_of_each_split(dtype, fp8_dtype, m_splits, device):
    x, scale = wide_range((300, 70), dtype, device), _scales(len(m_splits), device)
    _assert_as_per_split(fg.cast_transpose_grouped(x, m_splits, scale, fp8_dtype), x, m_splits, scale, fp8_dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_grouped_strided_rows(dtype, device):
    wide = wide_range((200, 72), dtype, device)
    x, m_splits, scale = wide[:, 3:68], [77, 0, 123], _scales(3, device)  # row stride 72, 65 columns
    result = fg.cast_transpose_grouped(x, m_splits, scale, torch.float8_e5m2)
    _assert_as_per_split(result, x, m_splits, scale, torch.float8_e5m2)


def test_grouped_strided_scale_and_amax_history_slots(device):
    """scale and amax_out strided views of a state's [3G] scales and [L, 3G] history: only the selected slots of
    history row 0 move, to max(slot, amax[g]) (a larger value already there stays), and amax_out comes back."""
    m_splits, groups = [40, 0, 200, 1, 59], 5
    x = wide_range((300, 33), torch.bfloat16, device)
    scales = _scales(3 * groups, device)
    scale = scales[1::3]
    expected = _per_split(x, m_splits, scale, torch.float8_e4m3fn)
    history = torch.rand(4, 3 * groups, device=device) * 1e-3
    history[0, 0] = 2 * expected[3][0]  # larger than split 0's amax: kept
    history[0, 6] = 0.0
    before = history.clone()
    amax_out = history[0, 0::3]
    q, q_t, scale_inv, amax = fg.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn, amax_out=amax_out)
    assert amax.data_ptr() == amax_out.data_ptr() and amax.stride() == (3,)
    want = before.clone()
    want[0, 0::3] = torch.maximum(before[0, 0::3], expected[3])
    assert torch.equal(history.cpu(), want.cpu())
    assert history[0, 0].item() == before[0, 0].item() and history[0, 3].item() == before[0, 3].item()  # empty split
    assert_fp8_equal(q, expected[0])
    assert_fp8_equal(q_t, expected[1])
    assert torch.equal(scale_inv.cpu(), expected[2].cpu())


def _non_finite_splits():
    """(splits, x [137, 9]): split 0 holds nothing finite, the others a NaN and an inf among finite values."""
    x = randn(137, 9)
    x[0:3] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(3, 3)
    x[5, 2], x[100, 7], x[134, 0] = math.nan, math.inf, -math.inf
    return [3, 130, 4], x


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grouped_non_finite(fp8_dtype, device):
    """NaN stays NaN, +-inf saturate to +-fp8_max, amax skips them; an all-non-finite split has amax 0."""
    m_splits, x = _non_finite_splits()
    x, scale = x.to(device), _scales(3, device)
    q, q_t, scale_inv, amax = fg.cast_transpose_grouped(x, m_splits, scale, fp8_dtype)
    _assert_as_per_split((q, q_t, scale_inv, amax), x, m_splits, scale, fp8_dtype)
    fp8_max, values = torch.finfo(fp8_dtype).max, q.float().cpu()
    assert torch.isnan(values[5, 2]) and torch.isnan(values[0, 0]) and torch.isnan(q_t.float().cpu()[2, 5])
    assert values[100, 7].item() == fp8_max and values[134, 0].item() == -fp8_max
    finite = torch.where(torch.isfinite(x), x, 0.0).abs().cpu()
    assert amax.cpu().tolist() == [0.0, finite[3:133].max().item(), finite[133:].max().item()]


@pytest.mark.parametrize("shape, m_splits", [((0, 5), [0]), ((0, 5), [0, 0, 0]), ((4, 0), [1, 0, 3])])
def test_grouped_empty(shape, m_splits, device):
    x, scale = torch.empty(shape, device=device), _scales(len(m_splits), device)
    q, q_t, scale_inv, amax = fg.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn)
    assert q.shape == shape and q_t.shape == shape[::-1]
    assert torch.equal(scale_inv.cpu(), torch.reciprocal(scale.cpu())) and amax.cpu().tolist() == [0.0] * len(m_splits)
    amax_out = torch.full((len(m_splits),), 0.5, device=device)
    assert fg.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn, amax_out)[3] is amax_out
    assert amax_out.cpu().tolist() == [0.5] * len(m_splits)


def test_grouped_errors_before_any_work(device):
    x, scale = randn(10, 8, device=device), torch.ones(3, device=device)
    amax_out = torch.full((3,), 0.5, device=device)
    bad = [
        (([4, 4, 1], scale), ValueError, r"m_splits=\[4, 4, 1\] sums to 9; the splits must sum to 10"),
        (([11, -1, 0], scale), ValueError, r"m_splits=\[11, -1, 0\] holds -1"),
        (([5, 5.0, 0], scale), ValueError, r"holds 5.0"),
        (([], scale), ValueError, r"m_splits=\[\] must be a list or tuple of >= 1"),
        (([4, 6], scale), ValueError, r"scale has shape \(3,\); it must be \[2\]"),
        (([4, 4, 2], scale.double()), TypeError, "scale has dtype torch.float64; it must be float32"),
        (([4, 4, 2], scale[:, None]), ValueError, r"scale has shape \(3, 1\)"),
    ]
    for (m_splits, s), error, match in bad:
        with pytest.raises(error, match=match):
            fg.cast_transpose_grouped(x, m_splits, s, torch.float8_e4m3fn, amax_out=amax_out)
    with pytest.raises(ValueError, match=r"amax_out has shape \(2,\)"):
        fg.cast_transpose_grouped(x, [4, 4, 2], scale, torch.float8_e4m3fn, amax_out=amax_out[:2])
    with pytest.raises(ValueError, match="fp8_dtype"):
        fg.cast_transpose_grouped(x, [4, 4, 2], scale, torch.bfloat16, amax_out=amax_out)
    with pytest.raises(ValueError, match="2-D"):
        fg.cast_transpose_grouped(x.reshape(2, 5, 8), [1, 1, 0], scale, torch.float8_e4m3fn)
    assert amax_out.cpu().tolist() == [0.5] * 3


def test_grouped_supports(device):
    x, supports = randn(4, 4, device=device), fg.SUPPORTS["cast_transpose_grouped"]
    assert supports(x, [1, 3], torch.ones(2, device=device), torch.float8_e4m3fn)
    assert supports(x, [1, 3], torch.ones(6, device=device)[::3], torch.float8_e4m3fn, torch.zeros(2, device=device))
    verdict = supports(x, [1, 3], torch.ones(2, dtype=torch.float64, device=device), torch.float8_e4m3fn)
    assert not verdict and "scale must be float32" in verdict.reason
    verdict = supports(x, [1, 3], torch.ones(2, device=device), torch.float8_e4m3fn, torch.zeros(2, device="meta"))
    assert not verdict and "amax_out must be float32" in verdict.reason


def test_split_ends_cached_per_splits_and_device(device):
    ends = split_ends([3, 0, 5], device)
    assert ends.dtype == torch.int32 and ends.cpu().tolist() == [3, 3, 8] and ends.device.type == device
    assert split_ends((3, 0, 5), device) is ends and split_ends([3, 5], device) is not ends


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_large_gpu(dtype):
    m_splits = [3072, 1024, 2560, 512, 4096, 1536, 2048, 1536]
    x, scale = randn(16384, 4096, dtype=dtype, device="cuda"), _scales(8, "cuda")
    x[7, 9], x[5000, 3] = math.nan, math.inf
    for fp8_dtype in FP8_DTYPES:
        _assert_as_per_split(fg.cast_transpose_grouped(x, m_splits, scale, fp8_dtype), x, m_splits, scale, fp8_dtype)
    ragged = [3000, 0, 1100, 2500, 577, 4100, 1500, 2071, 1536]  # tiles straddling splits
    scale = _scales(9, "cuda")
    result = fg.cast_transpose_grouped(x, ragged, scale, torch.float8_e4m3fn)
    _assert_as_per_split(result, x, ragged, scale, torch.float8_e4m3fn)


def _bits(t):
    return t.cpu().view(torch.int32)


def _assert_scales_as_per_split(x, m_splits, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """current_scale_grouped equals current_scale of each split bit for bit (and leaves the stream's counters zero)."""
    scale, amax = fg.current_scale_grouped(x, m_splits, fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
    per_split = [fq.current_scale(x[start:stop], fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
                 for start, stop in split_bounds(m_splits)]
    assert scale.dtype == amax.dtype == torch.float32 and scale.shape == amax.shape == (len(m_splits),)
    assert scale.device == amax.device == x.device
    assert torch.equal(_bits(scale), _bits(torch.stack([s for s, _ in per_split])))
    assert torch.equal(_bits(amax), _bits(torch.stack([a for _, a in per_split])))
    assert stream_counters(x.device).cpu().tolist() == [0, 0]
    return scale, amax


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_current_scale_grouped_is_current_scale_of_each_split(dtype, fp8_dtype, m_splits, device):
    _assert_scales_as_per_split(wide_range((300, 70), dtype, device), m_splits, fp8_dtype)


@pytest.mark.parametrize("amax_epsilon, power_2_scale", [(0.0, False), (0.0, True), (0.5, False), (0.5, True), (1e-30, True)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_scale_grouped_epsilon_and_power_2(amax_epsilon, power_2_scale, fp8_dtype, device):
    """Splits whose amax is below eps (the quotient takes eps), subnormal (float32 max: overflow) and 0 (scale 1)."""
    m_splits = [100, 0, 60, 3, 137]
    x = wide_range((300, 40), torch.float32, "cpu")
    x[100:160] = torch.rand(60, 40) * 0.25  # amax below 0.5
    x[160:163] = 1e-40  # subnormal amax: fp8_max / amax overflows float32
    x[163:180] = 0.0  # a tile with an all-zero part of a split
    scale, _ = _assert_scales_as_per_split(x.to(device), m_splits, fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
    assert scale[1].item() == 1.0
    if amax_epsilon == 0.5:  # scale = fp8_max / 0.5
        expected = 2 * torch.finfo(fp8_dtype).max
        assert scale[2].item() == (2.0 ** math.floor(math.log2(expected)) if power_2_scale else expected)
    if amax_epsilon == 0.0:
        expected = 2.0**127 if power_2_scale else torch.finfo(torch.float32).max
        assert scale[3].item() == expected


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_current_scale_grouped_non_finite(dtype, device):
    """amax skips NaN and +-inf; a split with nothing finite has amax 0 and scale 1."""
    m_splits, x = _non_finite_splits()
    x = x.to(dtype).to(device)
    scale, amax = _assert_scales_as_per_split(x, m_splits, torch.float8_e4m3fn)
    finite = torch.where(torch.isfinite(x), x, 0.0).abs().float().cpu()
    assert amax.cpu().tolist() == [0.0, finite[3:133].max().item(), finite[133:].max().item()]
    assert scale[0].item() == 1.0 and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_current_scale_grouped_strided_and_transposed(dtype, device):
    wide = wide_range((200, 72), dtype, device)
    _assert_scales_as_per_split(wide[:, 3:68], [77, 0, 123], torch.float8_e5m2)  # row stride 72
    _assert_scales_as_per_split(wide.t(), [30, 42], torch.float8_e4m3fn)  # transposed: copied to rows


@pytest.mark.parametrize("shape, m_splits", [((0, 5), [0]), ((0, 5), [0, 0, 0]), ((4, 0), [1, 0, 3]), ((300, 0), [200, 100])])
def test_current_scale_grouped_empty(shape, m_splits, device):
    x = torch.empty(shape, device=device)
    scale, amax = _assert_scales_as_per_split(x, m_splits, torch.float8_e4m3fn, amax_epsilon=0.5, power_2_scale=True)
    assert scale.cpu().tolist() == [1.0] * len(m_splits) and amax.cpu().tolist() == [0.0] * len(m_splits)


def test_current_scale_grouped_repeated_calls(device):
    """The counters left zero: a second call (another fp8 format) starts afresh."""
    x = wide_range((260, 33), torch.bfloat16, device)
    first = _assert_scales_as_per_split(x, [129, 131], torch.float8_e4m3fn)
    _assert_scales_as_per_split(x, [129, 131], torch.float8_e5m2)
    assert all(torch.equal(a, b) for a, b in zip(first, fg.current_scale_grouped(x, [129, 131], torch.float8_e4m3fn)))


def test_current_scale_grouped_errors(device):
    x, e4m3 = randn(10, 8, device=device), torch.float8_e4m3fn
    bad = [
        (([4, 4, 1], e4m3), ValueError, r"m_splits=\[4, 4, 1\] sums to 9; the splits must sum to 10"),
        (([11, -1, 0], e4m3), ValueError, r"m_splits=\[11, -1, 0\] holds -1"),
        (([5, 5.0, 0], e4m3), ValueError, r"holds 5.0"),
        (([5, True, 4], e4m3), ValueError, r"holds True"),
        (([], e4m3), ValueError, r"m_splits=\[\] must be a list or tuple of >= 1"),
        ((torch.tensor([4, 6]), e4m3), ValueError, r"must be a list or tuple"),
        (([4, 6], torch.bfloat16), ValueError, "fp8_dtype"),
        (([4, 6], e4m3, -1.0), ValueError, "amax_epsilon"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            fg.current_scale_grouped(x, *args)
    with pytest.raises(ValueError, match="2-D"):
        fg.current_scale_grouped(x.reshape(2, 5, 8), [1, 1], e4m3)
    with pytest.raises(TypeError):
        fg.current_scale_grouped(x.to(torch.int32), [4, 6], e4m3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_current_scale_grouped_large_gpu(dtype):
    x = randn(16384, 4096, dtype=dtype, device="cuda")
    x[7, 9], x[5000, 3] = math.nan, math.inf
    for m_splits in ([3072, 1024, 2560, 512, 4096, 1536, 2048, 1536], [3000, 0, 1100, 2500, 577, 4100, 1500, 2071, 1536]):
        for fp8_dtype in FP8_DTYPES:
            _assert_scales_as_per_split(x, m_splits, fp8_dtype)
            _assert_scales_as_per_split(x, m_splits, fp8_dtype, amax_epsilon=1e-3, power_2_scale=True)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_column_sums_grouped_sum_each_split(dtype, out_dtype, device):
    """float32 sums of each split's rows (in another order than torch's: to float32 rounding), one rounding to
    out_dtype; an empty split sums to 0; the result does not change from call to call."""
    m_splits = [70, 0, 129, 1]
    wide = randn(200, 72, dtype=dtype, device=device)
    x = wide[:, 3:68]  # strided rows
    got = fg.column_sums_grouped(x, m_splits, out_dtype)
    want = torch.stack([x[start:stop].float().sum(0) for start, stop in split_bounds(m_splits)])
    assert got.shape == (4, 65) and got.dtype == (out_dtype or torch.float32)
    if out_dtype is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 ulp: the GPU rounds to nearest, Triton's CPU interpreter truncates float32 -> bfloat16 stores
        torch.testing.assert_close(got.float(), want.to(out_dtype).float(), rtol=2**-7, atol=1e-4)
    assert not got[1].any() and torch.equal(fg.column_sums_grouped(x, m_splits, out_dtype), got)


def test_column_sums_grouped_errors(device):
    x = randn(10, 8, device=device)
    with pytest.raises(ValueError, match="sums to 9"):
        fg.column_sums_grouped(x, [4, 5])
    with pytest.raises((TypeError, ValueError), match="out_dtype|dbias_dtype|int32"):
        fg.column_sums_grouped(x, [4, 6], torch.int32)


@pytest.mark.gpu
def test_column_sums_grouped_large_gpu():
    m_splits = [3072, 1024, 2560, 512, 4096, 1536, 2048, 1536]
    x = randn(sum(m_splits), 4096, dtype=torch.bfloat16, device="cuda")
    got = fg.column_sums_grouped(x, m_splits, torch.float32)
    want = torch.stack([x[start:stop].float().sum(0) for start, stop in split_bounds(m_splits)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
