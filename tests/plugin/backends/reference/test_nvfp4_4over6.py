"""Reference NVFP4 4over6 vs the independent model in ``tests/nvfp4_4over6_spec.py``, bit for bit.

E2M1 codes, E4M3 scales and amaxes of both copies are compared exactly on fresh random data spanning many
binades (both candidates win somewhere), zero blocks, NaN / +-inf, ties, 1-D blocks and 16 x 16 tiles, both
error modes and both global scale bounds; the decode and the emulated GEMM under the bound 256 against the
model's values; the 2-D tile sum's order; what 4over6 promises (never a larger measured error than map-to-6,
which is the plain cast); and the refusals NVIDIA TE makes.
"""

import pytest
import torch

from tests.nvfp4_4over6_spec import spec_4over6_copy, spec_4over6_decode, spec_4over6_errors
from tests.nvfp4_spec import E4M3_GRID, spec_amax, unpack
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import _nvfp4_4over6 as four_over_six

MODES = ("MAE", "MSE")
BOUNDS = (448, 256)
NAN, INF = float("nan"), float("inf")
E4M3_256 = 0x78  # 2^8


def _quantize(x, mode, bound, block_2d=False, rowwise=True, columnwise=True):
    return ops.quantize_nvfp4(x, rowwise, columnwise, block_2d, rht=False, stochastic_rounding=False, seed=None, four_over_six=mode,
                              e4m3_max=bound)


def _assert_copy_is_the_spec(data, scale, amax, x, mode, bound, block_2d):
    """data / scale / amax are the 4over6 copy of x (codes and scale bits exact); returns the model's map-to-4 mask."""
    expected_amax = spec_amax(x)
    codes, scale_codes, map_to_4 = spec_4over6_copy(x, expected_amax, bound, mode, block_2d)
    assert amax.dtype == torch.float32 and amax.shape == (1,) and amax.item() == expected_amax
    assert scale.dtype == torch.uint8 and torch.equal(scale.long(), scale_codes)
    assert torch.equal(unpack(data), codes)
    return map_to_4


def _wide_range(shape, dtype):
    """Random signs, magnitudes over 6 decades (float16: 4) by row, a few outliers; past one tile a zero 16 x 16 tile
    and a -0."""
    low, high = (-2, 2) if dtype is torch.float16 else (-3, 3)
    band = 10.0 ** (torch.rand(shape[0], 1) * (high - low) + low)
    x = torch.randn(shape) * band * (1 + 4 * (torch.rand(shape) < 0.05))
    if shape[1] > 16:
        x[:16, :16] = 0.0
        x[0, 17] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 16), (48, 160), (112, 32)])
def test_both_copies_match_the_spec_bit_for_bit(shape, dtype, mode, bound, block_2d):
    x = _wide_range(shape, dtype)
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, mode, bound, block_2d)
    _assert_copy_is_the_spec(data, scale, amax, x, mode, bound, block_2d)
    _assert_copy_is_the_spec(data_t, scale_t, amax_t, x.t(), mode, bound, block_2d)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
def test_each_candidate_wins_somewhere(mode, bound, block_2d):
    """256 x 256 of uniform and Gaussian rows over 4 decades: map-to-4 wins 2.7 to 55 % of the blocks (tiles: 3 to 12 %)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 256, generator=g) * 10 ** (torch.rand(256, 1, generator=g) * 4 - 2)
    x[:128] = (torch.rand(128, 256, generator=g) * 2 - 1) * 10 ** (torch.rand(128, 1, generator=g) * 4 - 2)
    data, scale, amax = _quantize(x, mode, bound, block_2d, columnwise=False)[:3]
    picked = _assert_copy_is_the_spec(data, scale, amax, x, mode, bound, block_2d)
    assert picked.any() and not picked.all()


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
def test_each_copy_alone_is_the_same_cast(mode, bound):
    x = _wide_range((32, 64), torch.bfloat16)
    both = _quantize(x, mode, bound, block_2d=True)
    assert all(torch.equal(a, b) for a, b in zip(both[:3], _quantize(x, mode, bound, block_2d=True, columnwise=False)[:3]))
    assert all(torch.equal(a, b) for a, b in zip(both[3:], _quantize(x, mode, bound, block_2d=True, rowwise=False)[3:]))


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("mode", MODES)
def test_special_values(mode, block_2d):
    """NaN (a NaN error keeps map-to-6 in its block or tile), -0, and +-inf (amax inf: every error is inf or NaN)."""
    x = _wide_range((32, 64), torch.float32)
    x[3, 20], x[20, 40], x[5, 1] = NAN, NAN, -0.0
    for t in (x, torch.where(torch.arange(64) == 50, INF, x)):
        t = t.clone()
        t[30, 33] = -INF if torch.isinf(t).any() else t[30, 33]
        data, scale, amax, data_t, scale_t, amax_t = _quantize(t, mode, 256, block_2d)
        picked = _assert_copy_is_the_spec(data, scale, amax, t, mode, 256, block_2d)
        _assert_copy_is_the_spec(data_t, scale_t, amax_t, t.t(), mode, 256, block_2d)
        assert not picked[3, 1] and not picked[20, 2]  # the NaN blocks keep map-to-6
        if torch.isinf(t).any():
            assert not picked.any()


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("mode", MODES)
def test_a_tie_keeps_map_to_6(mode, block_2d):
    """Under the bound 256 (amax 6: S_enc = 256) a block (or tile) of 6, 3, 1.5 and 0 is exact with both scales,
    256 (map-to-6) and 384 (map-to-4): a tie of zero errors, kept as map-to-6. A block of 4s is exact with its
    map-to-4 scale 256 only (map-to-6: 176, and 4 -> 6 * 176 / 256 = 4.125): map-to-4."""
    x = torch.zeros(16, 64)
    x[:, :16] = torch.tensor([6.0, 3.0, 1.5, 0.0] * 4)
    x[:, 16:32] = 4.0
    x[:, 32:48] = torch.tensor([-6.0, 1.5] * 8)
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, mode, 256, block_2d)
    assert scale.eq(torch.tensor([E4M3_256, E4M3_256, E4M3_256, 0], dtype=torch.uint8)).all()
    assert _assert_copy_is_the_spec(data, scale, amax, x, mode, 256, block_2d).eq(torch.tensor([False, True, False, False])).all()
    _assert_copy_is_the_spec(data_t, scale_t, amax_t, x.t(), mode, 256, block_2d)
    if block_2d:  # the same tiles seen from x^T
        assert scale_t[:48].eq(E4M3_256).all() and scale_t[48:].eq(0).all()
    assert torch.equal(ops.dequantize_nvfp4(data, scale, amax, torch.float32, e4m3_max=256), x)


def test_tile_error_sums_rows_in_warp_shuffle_order():
    """r_0 = 2^24 and fifteen 1s in float32: a row-order sum loses every 1 (2^24); TE's tree (a_i = r_i + r_(i+8),
    then offsets 4, 2, 1) loses the one 1 paired with 2^24 and keeps the other 14 (2^24 + 14), in either row order."""
    rows = torch.ones(16, 1)
    rows[0] = 2.0**24
    sequential = torch.zeros(1)
    for r in rows:
        sequential = sequential + r
    assert sequential.item() == 2.0**24
    assert four_over_six.tile_errors(rows).item() == 2.0**24 + 14
    assert four_over_six.tile_errors(rows.flip(0)).item() == 2.0**24 + 14


def test_map_to_4_only_where_its_error_is_smaller_and_map_to_6_is_the_plain_cast():
    """With the bound 448, map-to-6 is the plain NVFP4 cast: the blocks that keep it hold its bytes, and no block's
    measured error exceeds the plain cast's."""
    x = _wide_range((64, 128), torch.float32)
    plain = ops.quantize_nvfp4(x, rowwise=True, columnwise=False, block_2d=False, rht=False, stochastic_rounding=False, seed=None)
    data, scale, amax = _quantize(x, "MSE", 448, columnwise=False)[:3]
    picked = scale != plain[1]
    kept = ~picked.repeat_interleave(8, dim=1)
    assert torch.equal(data[kept], plain[0][kept])
    x64, a = x.double(), amax.item()
    err = spec_4over6_errors(x64, unpack(data), scale.long(), a, 448, "MSE")
    err_plain = spec_4over6_errors(x64, unpack(plain[0]), plain[1].long(), a, 448, "MSE")
    assert (err <= err_plain).all() and (err < err_plain).sum() == picked.sum() > 0


@pytest.mark.parametrize("bound", BOUNDS)
def test_dequantize_and_gemm_use_each_operand_s_bound(bound):
    a_x, b_x = _wide_range((32, 64), torch.float32), _wide_range((48, 64), torch.bfloat16)
    a, a_s, a_amax = _quantize(a_x, "MAE", bound, columnwise=False)[:3]
    b, b_s, b_amax = ops.quantize_nvfp4(b_x, rowwise=True, columnwise=False, block_2d=False, rht=False, stochastic_rounding=False,
                                        seed=None)[:3]  # plain: bound 448
    a_hat = spec_4over6_decode(unpack(a), a_s.long(), a_amax.item(), bound)
    b_hat = spec_4over6_decode(unpack(b), b_s.long(), b_amax.item(), 448)
    assert torch.equal(ops.dequantize_nvfp4(a, a_s, a_amax, torch.float64, e4m3_max=bound), a_hat)
    d = ops.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, torch.float32, a_e4m3_max=bound)
    torch.testing.assert_close(d.double(), a_hat @ b_hat.t(), rtol=1e-5, atol=1e-5 * a_hat.abs().max().item())
    if bound == 256:  # the bound is part of the decode: read with 448 the values are 256 / 448 of the truth
        wrong = ops.dequantize_nvfp4(a, a_s, a_amax, torch.float64)
        assert not torch.equal(wrong, a_hat)
    assert E4M3_GRID[a_s.long()].max().item() <= 448


def test_refusals_name_the_value_and_the_rule():
    x = torch.randn(32, 32)
    with pytest.raises(ValueError, match=r"four_over_six='MAE' with rht=True.*does not support"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=True, stochastic_rounding=False, seed=None,
                           four_over_six="MAE")
    with pytest.raises(ValueError, match=r"four_over_six='MSE' with stochastic_rounding=True"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True, seed=torch.tensor([1]),
                           four_over_six="MSE")
    with pytest.raises(ValueError, match=r"e4m3_max=256 without 4over6"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=None, e4m3_max=256)
    with pytest.raises(ValueError, match=r"four_over_six='mae'"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=None,
                           four_over_six="mae")
    with pytest.raises(ValueError, match=r"e4m3_max=300"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=None,
                           four_over_six="MAE", e4m3_max=300)
    q, s, a = ops.quantize_nvfp4(x, rowwise=True, columnwise=False, block_2d=False, rht=False, stochastic_rounding=False, seed=None)[:3]
    with pytest.raises(ValueError, match=r"e4m3_max=True"):
        ops.dequantize_nvfp4(q, s, a, torch.float32, e4m3_max=True)
    with pytest.raises(ValueError, match=r"b_e4m3_max=512"):
        ops.gemm_nvfp4(q, q, s, s, a, a, torch.float32, b_e4m3_max=512)
