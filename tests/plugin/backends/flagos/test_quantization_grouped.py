"""flagos cast_transpose_grouped vs the flagos cast_transpose of each split: bit-identical codes and amaxes.

Split g of x (rows o_g .. o_g + m_g - 1) cast with scale[g] must give the codes of cast_transpose(x_g, scale[g]),
in q's rows and q_t's columns of the split, whatever the splits (empty ones, ones straddling the kernel's 128-row
tiles); amax[g] is that cast's amax and scale_inv[g] = 1 / scale[g]. Runs on the GPU when there is one, else in
Triton's CPU interpreter (conftest.py).
"""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, HP_DTYPES, assert_fp8_equal, wide_range
from tests.utils import randn
from transformer_engine.plugin.backends._splits import split_ends
from transformer_engine.plugin.backends.flagos import quantization as fq

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
    _assert_as_per_split(fq.cast_transpose_grouped(x, m_splits, scale, fp8_dtype), x, m_splits, scale, fp8_dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_grouped_strided_rows(dtype, device):
    wide = wide_range((200, 72), dtype, device)
    x, m_splits, scale = wide[:, 3:68], [77, 0, 123], _scales(3, device)  # row stride 72, 65 columns
    result = fq.cast_transpose_grouped(x, m_splits, scale, torch.float8_e5m2)
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
    q, q_t, scale_inv, amax = fq.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn, amax_out=amax_out)
    assert amax.data_ptr() == amax_out.data_ptr() and amax.stride() == (3,)
    want = before.clone()
    want[0, 0::3] = torch.maximum(before[0, 0::3], expected[3])
    assert torch.equal(history.cpu(), want.cpu())
    assert history[0, 0].item() == before[0, 0].item() and history[0, 3].item() == before[0, 3].item()  # empty split
    assert_fp8_equal(q, expected[0])
    assert_fp8_equal(q_t, expected[1])
    assert torch.equal(scale_inv.cpu(), expected[2].cpu())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grouped_non_finite(fp8_dtype, device):
    """NaN stays NaN, +-inf saturate to +-fp8_max, amax skips them; an all-non-finite split has amax 0."""
    m_splits = [3, 130, 4]
    x = randn(137, 9)
    x[0:3] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(3, 3)  # split 0: nothing finite
    x[5, 2], x[100, 7], x[134, 0] = math.nan, math.inf, -math.inf
    x, scale = x.to(device), _scales(3, device)
    q, q_t, scale_inv, amax = fq.cast_transpose_grouped(x, m_splits, scale, fp8_dtype)
    _assert_as_per_split((q, q_t, scale_inv, amax), x, m_splits, scale, fp8_dtype)
    fp8_max, values = torch.finfo(fp8_dtype).max, q.float().cpu()
    assert torch.isnan(values[5, 2]) and torch.isnan(values[0, 0]) and torch.isnan(q_t.float().cpu()[2, 5])
    assert values[100, 7].item() == fp8_max and values[134, 0].item() == -fp8_max
    finite = torch.where(torch.isfinite(x), x, 0.0).abs().cpu()
    assert amax.cpu().tolist() == [0.0, finite[3:133].max().item(), finite[133:].max().item()]


@pytest.mark.parametrize("shape, m_splits", [((0, 5), [0]), ((0, 5), [0, 0, 0]), ((4, 0), [1, 0, 3])])
def test_grouped_empty(shape, m_splits, device):
    x, scale = torch.empty(shape, device=device), _scales(len(m_splits), device)
    q, q_t, scale_inv, amax = fq.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn)
    assert q.shape == shape and q_t.shape == shape[::-1]
    assert torch.equal(scale_inv.cpu(), torch.reciprocal(scale.cpu())) and amax.cpu().tolist() == [0.0] * len(m_splits)
    amax_out = torch.full((len(m_splits),), 0.5, device=device)
    assert fq.cast_transpose_grouped(x, m_splits, scale, torch.float8_e4m3fn, amax_out)[3] is amax_out
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
            fq.cast_transpose_grouped(x, m_splits, s, torch.float8_e4m3fn, amax_out=amax_out)
    with pytest.raises(ValueError, match=r"amax_out has shape \(2,\)"):
        fq.cast_transpose_grouped(x, [4, 4, 2], scale, torch.float8_e4m3fn, amax_out=amax_out[:2])
    with pytest.raises(ValueError, match="fp8_dtype"):
        fq.cast_transpose_grouped(x, [4, 4, 2], scale, torch.bfloat16, amax_out=amax_out)
    with pytest.raises(ValueError, match="2-D"):
        fq.cast_transpose_grouped(x.reshape(2, 5, 8), [1, 1, 0], scale, torch.float8_e4m3fn)
    assert amax_out.cpu().tolist() == [0.5] * 3


def test_grouped_supports(device):
    x, supports = randn(4, 4, device=device), fq.SUPPORTS["cast_transpose_grouped"]
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
        _assert_as_per_split(fq.cast_transpose_grouped(x, m_splits, scale, fp8_dtype), x, m_splits, scale, fp8_dtype)
    ragged = [3000, 0, 1100, 2500, 577, 4100, 1500, 2071, 1536]  # tiles straddling splits
    scale = _scales(9, "cuda")
    result = fq.cast_transpose_grouped(x, ragged, scale, torch.float8_e4m3fn)
    _assert_as_per_split(result, x, ragged, scale, torch.float8_e4m3fn)
