"""Reference grouped casts vs the reference per-split ops, bit for bit.

cast_transpose_grouped: q[rows of g] = quantize(x_g, scale[g]), q_t = q^T, scale_inv[g], amax[g] as quantize's;
current_scale_grouped: (scale[g], amax[g]) = current_scale(x_g). Bad splits raise ValueError naming the value.
"""

import math

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin.backends._splits import split_bounds
from transformer_engine.plugin.backends.reference import grouped as ref
from transformer_engine.plugin.backends.reference import quantization as refq

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [[300], [0, 129, 0, 1, 127, 43], [70, 0, 0, 230, 0], [5] * 60]


def _x(dtype):
    """Random values from ~1e-6 to ~1e4 in magnitude, with a NaN and +-inf."""
    x = randn(300, 40) * 10.0 ** (torch.rand(300, 40) * 10 - 6)
    x[3, 1], x[150, 7], x[299, 0] = math.nan, math.inf, -math.inf
    return x.to(dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_transpose_grouped_is_quantize_of_each_split(dtype, fp8_dtype, m_splits):
    x, scale = _x(dtype), torch.exp(torch.randn(len(m_splits)))
    q, q_t, scale_inv, amax = ref.cast_transpose_grouped(x, m_splits, scale, fp8_dtype)
    per_split = [refq.quantize(x[start:stop], scale[g], fp8_dtype) for g, (start, stop) in enumerate(split_bounds(m_splits))]
    q_ref = torch.cat([q for q, _, _ in per_split])
    assert _same_bits(q, q_ref) and _same_bits(q_t, q_ref.t().contiguous())
    assert _same_bits(scale_inv, torch.stack([s for _, s, _ in per_split]))
    assert _same_bits(amax, torch.stack([a for _, _, a in per_split]))


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amax_epsilon, power_2_scale", [(0.0, False), (1e-3, True)])
def test_current_scale_grouped_is_current_scale_of_each_split(dtype, fp8_dtype, m_splits, amax_epsilon, power_2_scale):
    x = _x(dtype)
    x[:5] = 0.0  # the first rows: an empty split's neighbour, an all-zero split in [5] * 60
    scale, amax = ref.current_scale_grouped(x, m_splits, fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
    per_split = [refq.current_scale(x[start:stop], fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
                 for start, stop in split_bounds(m_splits)]
    assert scale.shape == amax.shape == (len(m_splits),)
    assert _same_bits(scale, torch.stack([s for s, _ in per_split])) and _same_bits(amax, torch.stack([a for _, a in per_split]))
    assert torch.isfinite(scale).all() and (amax >= 0).all()


def test_current_scale_grouped_empty_and_transposed():
    scale, amax = ref.current_scale_grouped(torch.empty(0, 8), (0, 0), E4M3)
    assert scale.tolist() == [1.0, 1.0] and amax.tolist() == [0.0, 0.0]
    x = randn(8, 6, dtype=torch.bfloat16).t()  # [6, 8], not contiguous
    scale, amax = ref.current_scale_grouped(x, [4, 2], E5M2)
    assert _same_bits(amax, torch.stack([refq.compute_amax(x[:4]), refq.compute_amax(x[4:])]))


@pytest.mark.parametrize("op", ["current_scale_grouped", "cast_transpose_grouped"])
def test_bad_splits_raise(op):
    x = randn(10, 8)

    def call(m_splits, source=x):
        if op == "current_scale_grouped":
            return ref.current_scale_grouped(source, m_splits, E4M3)
        return ref.cast_transpose_grouped(source, m_splits, torch.ones(len(m_splits)), E4M3)

    bad = [
        ([4, 4, 1], r"m_splits=\[4, 4, 1\] sums to 9; the splits must sum to 10"),
        ([11, -1, 0], r"m_splits=\[11, -1, 0\] holds -1"),
        ([5, 5.0, 0], r"holds 5.0"),
        ([5, True, 4], r"holds True"),
        ([], r"m_splits=\[\] must be a list or tuple of >= 1"),
    ]
    for m_splits, match in bad:
        with pytest.raises(ValueError, match=match):
            call(m_splits)
    with pytest.raises(ValueError, match="2-D"):
        call([1, 1], source=x.reshape(2, 5, 8))
