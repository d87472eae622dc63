"""flagos block-scaled FP8 casts vs the reference backend: bit-identical codes and scale_inv.

``quantize_blockwise`` is compared with the reference's on the same arguments;
``cast_transpose_blockwise`` with the contract: the reference's 1 x B ``quantize_blockwise`` of x
and of x^T. Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py).
Shapes are small (the interpreter is slow) but cover ragged edge tiles, sizes below one block,
odd and prime sizes, and several programs per dimension.
"""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import (
    FP8_DTYPES, HP_DTYPES, assert_dbias_close, assert_fp8_equal, flagos_and_reference, wide_range,
)
from tests.utils import randn
from transformer_engine.plugin.backends import flagos
from transformer_engine.plugin.backends import reference
from transformer_engine.plugin.backends.flagos import quantization_blockwise as fq
from transformer_engine.plugin.backends.reference import quantization as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TILES = [(1, 16), (16, 16), (1, 128), (128, 128)]
SHAPES = [(1, 1), (7, 37), (131, 67)]  # one element; below one block; ragged in both dimensions, prime
SETTINGS = [(E4M3, False, 0.0), (E5M2, True, 0.0), (E4M3, True, 1e-2), (E5M2, False, 1e-2)]  # fp8, pow-2, eps


def _assert_same_blockwise(actual, expected):
    """Bit-identical FP8 codes and exactly equal float32 scale_inv."""
    q, scale_inv = actual
    q_ref, scale_inv_ref = expected
    assert_fp8_equal(q, q_ref)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == scale_inv_ref.shape
    assert torch.equal(scale_inv.cpu(), scale_inv_ref.cpu())


def _assert_same_cast_transpose(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """flagos cast_transpose_blockwise vs the reference quantize_blockwise of x and of x^T (the contract)."""
    q, scale_inv, q_t, scale_inv_t = fq.cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon)
    _assert_same_blockwise((q, scale_inv), ref.quantize_blockwise(x, fp8_dtype, 1, block_len, power_2_scale, amax_epsilon))
    expected_t = ref.quantize_blockwise(x.t(), fp8_dtype, 1, block_len, power_2_scale, amax_epsilon)
    _assert_same_blockwise((q_t, scale_inv_t), expected_t)
    assert q_t.is_contiguous()


@pytest.mark.parametrize("fp8_dtype, power_2_scale, amax_epsilon", SETTINGS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_quantize_blockwise_bit_exact(tile, shape, dtype, fp8_dtype, power_2_scale, amax_epsilon, device):
    # magnitudes over 10 decades: tiles get very different scales, eps = 1e-2 lifts some of them
    x = wide_range(shape, dtype, device)
    args = (fp8_dtype, *tile, power_2_scale, amax_epsilon)
    _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))


@pytest.mark.parametrize("fp8_dtype, power_2_scale, amax_epsilon", SETTINGS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_len", [16, 128])
def test_cast_transpose_blockwise_bit_exact(block_len, shape, dtype, fp8_dtype, power_2_scale, amax_epsilon, device):
    _assert_same_cast_transpose(wide_range(shape, dtype, device), fp8_dtype, block_len, power_2_scale, amax_epsilon)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (131, 67), (40, 200)])
@pytest.mark.parametrize("block_len", [16, 128])
def test_square_tiles_of_a_transposed_view(block_len, shape, dtype, device):
    # x = w^T (column-major): read from w, stored transposed; w with strided rows too
    w = wide_range(shape, dtype, device)
    for x in (w.t(), wide_range((shape[0], shape[1] + 3), dtype, device)[:, 1 : shape[1] + 1].t()):
        for fp8_dtype, power_2_scale, amax_epsilon in SETTINGS[:2]:
            args = (fp8_dtype, block_len, block_len, power_2_scale, amax_epsilon)
            q, scale_inv = fq.quantize_blockwise(x, *args)
            _assert_same_blockwise((q, scale_inv), ref.quantize_blockwise(x, *args))
            assert q.is_contiguous() and scale_inv.is_contiguous()


@pytest.mark.parametrize("shape", [(70, 64), (64, 200)])
@pytest.mark.parametrize("block_len", [32, 64, 256])
def test_other_block_lengths(block_len, shape, device):
    # full and ragged tiles of every other block length (several programs along one dimension)
    x = wide_range(shape, torch.bfloat16, device)
    for tile in ((1, block_len), (block_len, block_len)):
        args = (E4M3, *tile, True, 0.0)
        _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))
    _assert_same_cast_transpose(x, E5M2, block_len, power_2_scale=False, amax_epsilon=0.0)


_CT_SETTINGS = [  # (split, columns per program, transpose the codes, block_len)
    (True, 32, True, 16), (True, 16, False, 32), (True, 128, True, 64), (True, 64, False, 16),  # split: tile B x C
    (False, 16, True, 16), (False, 32, False, 32),  # fused, B x B tiles: 2-D rows
    (False, 64, True, 16), (False, 64, False, 32),  # fused, B x 4B / B x 2B tiles: rows through the 3-D view
]


@pytest.mark.parametrize("split, tile_n, codes, block_len", _CT_SETTINGS)
def test_cast_transpose_blockwise_launch_settings(split, tile_n, codes, block_len, monkeypatch, device):
    # both modes (split, fused), both transposes (of the 8-bit codes, of the values), column tiles
    # narrower and wider than B, several programs per dimension and ragged edges in both: what
    # benchmarks/sweep_fp8_casts.py times
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_SPLIT", split)
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_COL_TILE" if split else "_CT_BLOCKWISE_TILE_N", tile_n)
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_CODES", codes)
    for dtype in HP_DTYPES:
        _assert_same_cast_transpose(wide_range((131, 67), dtype, device), E4M3, block_len, power_2_scale=True, amax_epsilon=1e-2)


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_cast_transpose_blockwise_tile_n(split, monkeypatch):
    # the kernel's column tile: the mode's setting, shrunk to x's power-of-two width, fused at least B
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_SPLIT", split)
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_COL_TILE", 64)
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_TILE_N", 256)
    wide, narrow = (64, 32) if split else (256, 128)
    assert fq._ct_blockwise_tile_n(4096, 128) == wide
    assert fq._ct_blockwise_tile_n(20, 128) == narrow
    assert fq._ct_blockwise_tile_n(3, 16) == 16


def _assert_same_cast_transpose_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """flagos cast_transpose_blockwise_dbias: the same casts as cast_transpose_blockwise, dbias near the reference's."""
    *casts, dbias = fq.cast_transpose_blockwise_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon)
    q, scale_inv, q_t, scale_inv_t = fq.cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon)
    assert_fp8_equal(casts[0], q)
    assert_fp8_equal(casts[2], q_t)
    assert torch.equal(casts[1], scale_inv) and torch.equal(casts[3], scale_inv_t)
    assert_dbias_close(dbias, ref.cast_transpose_blockwise_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon)[4], x)


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cast_transpose_blockwise_dbias(shape, dtype, split, monkeypatch, device):
    monkeypatch.setattr(fq, "_CT_BLOCKWISE_SPLIT", split)
    _assert_same_cast_transpose_dbias(wide_range(shape, dtype, device), E4M3, 16, power_2_scale=True, amax_epsilon=0.0)


def test_cast_transpose_blockwise_dbias_sums_integers_exactly(monkeypatch, device):
    # small integers sum exactly in float32 in any order: every element counted once, masked lanes 0;
    # 300 rows = two full 128-row tiles and a ragged one, strided rows of 67 columns (two column tiles
    # of the split kernel), more tiles than the interpreter's programs (each program loops)
    wide = torch.randint(-8, 9, (300, 72)).to(torch.bfloat16).to(device)
    x = wide[:, 2:69]
    for split in (True, False):
        monkeypatch.setattr(fq, "_CT_BLOCKWISE_SPLIT", split)
        dbias = fq.cast_transpose_blockwise_dbias(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0)[4]
        assert torch.equal(dbias.cpu(), x.cpu().double().sum(0).float())


def test_cast_transpose_blockwise_dbias_non_finite_and_empty(device):
    x = randn(40, 5)
    x[3, 0] = math.nan
    x[5, 1] = math.inf
    x[6, 2], x[36, 2] = math.inf, -math.inf  # in two 32-row tiles: inf - inf = NaN
    x = x.to(device)
    dbias = fq.cast_transpose_blockwise_dbias(x, E5M2, 32, power_2_scale=False, amax_epsilon=0.0)[4].cpu()
    assert torch.isnan(dbias[0]) and dbias[1].item() == math.inf and torch.isnan(dbias[2])
    assert math.isfinite(dbias[3].item()) and math.isfinite(dbias[4].item())
    for shape in ((0, 5), (5, 0)):
        q, scale_inv, q_t, scale_inv_t, dbias = fq.cast_transpose_blockwise_dbias(torch.empty(shape, device=device), E4M3, 16,
                                                                                  power_2_scale=True, amax_epsilon=0.0)
        assert q.shape == shape and q_t.shape == shape[::-1] and dbias.dtype == torch.float32
        assert dbias.cpu().tolist() == [0.0] * shape[1]


def _edge_tiles(dtype, device):
    """x [40, 50] whose 16 x 16 tiles / 1 x 16 blocks hit every special case of the scale.

    Zeros (amax 0: scale 1), +-inf and NaN (not finite: scale 1, inf saturates, NaN stays), tiny
    amaxes whose scale fp8_max / a overflows float32 (float32 max; subnormal x, whose 1 / scale is
    subnormal too), and everything else N(0, 1). bfloat16 / float16 get 3e-37 instead of subnormals:
    the interpreter flushes bfloat16 subnormals when it widens them (the GPU does not; see the gpu test),
    and float16 has none that small.
    """
    x = randn(40, 50)
    x[0:16, 0:16] = 0.0
    x[3, 20], x[5, 40], x[20, 5] = math.inf, -math.inf, math.nan
    tiny = 1e-40 if dtype == torch.float32 else 3e-37
    x[16:32, 16:32] = randn(16, 16).sign() * (1 + torch.rand(16, 16)) * tiny  # |x| in [tiny, 2 tiny]
    x[:, 44:48] = 1e-37
    return x.to(dtype).to(device)


@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-3, math.inf])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_zero_non_finite_and_overflowing_tiles(dtype, amax_epsilon, device):
    x = _edge_tiles(dtype, device)
    for fp8_dtype, power_2_scale in ((E4M3, False), (E5M2, True)):
        for tile in ((1, 16), (16, 16)):
            args = (fp8_dtype, *tile, power_2_scale, amax_epsilon)
            _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))
        _assert_same_cast_transpose(x, fp8_dtype, 16, power_2_scale, amax_epsilon)


def test_edge_scales_by_value(device):
    # the special cases, by value: 16 x 16 tiles of _edge_tiles(float32)
    scale_inv = fq.quantize_blockwise(_edge_tiles(torch.float32, device), E4M3, 16, 16, power_2_scale=True, amax_epsilon=0.0)[1].cpu()
    assert scale_inv[0, 0] == 1.0 and scale_inv[0, 1] == 1.0 and scale_inv[1, 0] == 1.0  # zeros, inf, NaN
    assert scale_inv[1, 1] == 2.0**-127  # float32 max, rounded down to 2^127
    assert scale_inv[2, 2] == 2.0 ** math.ceil(math.log2(_edge_tiles(torch.float32, "cpu")[32:, 32:48].abs().max() / 448))


def test_strided_rows(device):
    wide = wide_range((37, 150), torch.float16, device)
    x = wide[:, 3:133]  # row stride 150, 130 columns
    for tile in ((1, 16), (16, 16)):
        args = (E5M2, *tile, False, 0.0)
        _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))
    _assert_same_cast_transpose(x, E4M3, 16, power_2_scale=True, amax_epsilon=0.0)


def test_scale_inv_layouts(device):
    # 1 x B scales column-major (storage [cdiv(N, B), M]), B x B row-major: cuBLASLt's layouts
    m, n = 37, 70
    x = randn(m, n, device=device)
    assert fq.quantize_blockwise(x, E4M3, 1, 16, power_2_scale=False, amax_epsilon=0.0)[1].stride() == (1, m)
    assert fq.quantize_blockwise(x, E4M3, 16, 16, power_2_scale=False, amax_epsilon=0.0)[1].stride() == (5, 1)
    _, scale_inv, q_t, scale_inv_t = fq.cast_transpose_blockwise(x, E4M3, 16, power_2_scale=False, amax_epsilon=0.0)
    assert scale_inv.shape == (m, 5) and scale_inv.stride() == (1, m)
    assert q_t.shape == (n, m) and scale_inv_t.shape == (n, 3) and scale_inv_t.stride() == (1, n)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0)])
def test_empty(shape, device):
    m, n = shape
    x = torch.empty(shape, device=device)
    for tile, scale_shape in (((1, 16), (m, math.ceil(n / 16))), ((16, 16), (math.ceil(m / 16), math.ceil(n / 16)))):
        q, scale_inv = fq.quantize_blockwise(x, E4M3, *tile, power_2_scale=False, amax_epsilon=0.0)
        assert q.shape == shape and q.dtype == E4M3 and scale_inv.shape == scale_shape
    q, scale_inv, q_t, scale_inv_t = fq.cast_transpose_blockwise(x, E4M3, 16, power_2_scale=False, amax_epsilon=0.0)
    assert q.shape == shape and q_t.shape == (n, m)
    assert scale_inv.shape == (m, math.ceil(n / 16)) and scale_inv_t.shape == (n, math.ceil(m / 16))


_BAD_TILES = [(2, 64), (64, 128), (128, 64), (1, 8), (8, 8), (1, 512), (1, 100), (0, 128), (True, 16), (1, 128.0)]
_BAD_BLOCK_LENS = [8, 100, 512, 0, True, 128.0]


@pytest.mark.parametrize("tile", _BAD_TILES, ids=str)
def test_supports_rejects_other_tiles(tile, device):
    x = randn(4, 4, device=device)
    verdict = fq.SUPPORTS["quantize_blockwise"](x, E4M3, *tile, power_2_scale=False, amax_epsilon=0.0)
    assert not verdict and "power of two in [16, 256]" in verdict.reason
    with pytest.raises(ValueError, match="tiles"):
        fq.quantize_blockwise(x, E4M3, *tile, power_2_scale=False, amax_epsilon=0.0)


@pytest.mark.parametrize("block_len", _BAD_BLOCK_LENS, ids=str)
def test_supports_rejects_other_block_lengths(block_len, device):
    x = randn(4, 4, device=device)
    verdict = fq.SUPPORTS["cast_transpose_blockwise"](x, E4M3, block_len, power_2_scale=False, amax_epsilon=0.0)
    assert not verdict and "power of two in [16, 256]" in verdict.reason
    with pytest.raises(ValueError, match="tiles"):
        fq.cast_transpose_blockwise(x, E4M3, block_len, power_2_scale=False, amax_epsilon=0.0)


def test_supports_accepts_every_kernel_tile(device):
    x = randn(4, 4, device=device)
    for b in (16, 32, 64, 128, 256):
        assert fq.SUPPORTS["quantize_blockwise"](x, E4M3, 1, b, power_2_scale=False, amax_epsilon=0.0) is True
        assert fq.SUPPORTS["quantize_blockwise"](x, E4M3, b, b, power_2_scale=True, amax_epsilon=1e-12) is True
        assert fq.SUPPORTS["cast_transpose_blockwise"](x, E5M2, b, power_2_scale=False, amax_epsilon=0.0) is True
        assert fq.SUPPORTS["cast_transpose_blockwise_dbias"](x, E5M2, b, power_2_scale=False, amax_epsilon=0.0) is True


def test_errors(device):
    x = randn(4, 4, device=device)
    for bad_epsilon in (-1.0, math.nan, 1e39):
        with pytest.raises(ValueError, match="amax_epsilon"):
            fq.quantize_blockwise(x, E4M3, 1, 16, power_2_scale=False, amax_epsilon=bad_epsilon)
        with pytest.raises(ValueError, match="amax_epsilon"):
            fq.cast_transpose_blockwise(x, E4M3, 16, power_2_scale=False, amax_epsilon=bad_epsilon)
    with pytest.raises(ValueError, match="fp8_dtype"):
        fq.quantize_blockwise(x, torch.bfloat16, 1, 16, power_2_scale=False, amax_epsilon=0.0)
    with pytest.raises(ValueError, match="2-D"):
        fq.cast_transpose_blockwise(x.reshape(2, 2, 4), E4M3, 16, power_2_scale=False, amax_epsilon=0.0)
    with pytest.raises(TypeError, match="dtype"):
        fq.quantize_blockwise(x.int(), E4M3, 16, 16, power_2_scale=False, amax_epsilon=0.0)


def test_dispatch_runs_flagos_and_falls_back_for_other_tiles(monkeypatch, device):
    manager = flagos_and_reference(monkeypatch, device)
    x = randn(20, 40, device=device)
    _, impl = manager.dispatcher("quantize_blockwise").traced(x, E4M3, 1, 16, power_2_scale=False, amax_epsilon=0.0)
    assert impl.impl_id == flagos.IMPL_ID
    (q, scale_inv), impl = manager.dispatcher("quantize_blockwise").traced(x, E4M3, 1, 20, power_2_scale=False, amax_epsilon=0.0)
    assert impl.impl_id == reference.IMPL_ID and scale_inv.shape == (20, 2)
    _, impl = manager.dispatcher("cast_transpose_blockwise").traced(x, E4M3, 16, power_2_scale=False, amax_epsilon=0.0)
    assert impl.impl_id == flagos.IMPL_ID
    _, impl = manager.dispatcher("cast_transpose_blockwise_dbias").traced(x, E4M3, 16, power_2_scale=False, amax_epsilon=0.0)
    assert impl.impl_id == flagos.IMPL_ID
    _, impl = manager.dispatcher("cast_transpose_blockwise_dbias").traced(x, E4M3, 20, power_2_scale=False, amax_epsilon=0.0)
    assert impl.impl_id == reference.IMPL_ID


# ---------------------------------------------------------------- on the GPU, at training shapes


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_quantize_blockwise_gpu(tile, fp8_dtype):
    x = wide_range((4096, 4096), torch.bfloat16, "cuda")
    for power_2_scale in (False, True):
        args = (fp8_dtype, *tile, power_2_scale, 0.0)
        _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))
    x, args = wide_range((2049, 4097), torch.float16, "cuda"), (fp8_dtype, *tile, True, 1e-6)  # ragged, with eps
    _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_cast_transpose_blockwise_gpu(dtype, fp8_dtype):
    # float32 full tiles included: Triton once transposed 8-bit tiles of 32-bit loads wrongly on the H200
    _assert_same_cast_transpose(wide_range((4096, 4096), dtype, "cuda"), fp8_dtype, 128, power_2_scale=True, amax_epsilon=0.0)
    _assert_same_cast_transpose(wide_range((2049, 4097), dtype, "cuda"), fp8_dtype, 128, power_2_scale=False, amax_epsilon=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_cast_transpose_blockwise_dbias_gpu(dtype):
    _assert_same_cast_transpose_dbias(wide_range((4096, 4096), dtype, "cuda"), E4M3, 128, power_2_scale=True, amax_epsilon=0.0)
    _assert_same_cast_transpose_dbias(wide_range((2049, 4097), dtype, "cuda"), E5M2, 128, power_2_scale=False, amax_epsilon=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_square_tiles_of_a_transposed_view_gpu(dtype):
    for shape, args in (((4096, 4096), (E4M3, 128, 128, True, 0.0)), ((2049, 4097), (E5M2, 128, 128, False, 1e-6))):
        x = wide_range(shape, dtype, "cuda").t()
        _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))


@pytest.mark.gpu
def test_bfloat16_subnormal_tiles_gpu():
    # bfloat16 subnormals (widened exactly on the GPU): scale overflows to float32 max
    x = _edge_tiles(torch.float32, "cuda").to(torch.bfloat16)
    for tile in ((1, 16), (16, 16), (1, 128), (128, 128)):
        args = (E4M3, *tile, True, 0.0)
        _assert_same_blockwise(fq.quantize_blockwise(x, *args), ref.quantize_blockwise(x, *args))
    _assert_same_cast_transpose(x, E5M2, 16, power_2_scale=False, amax_epsilon=0.0)
