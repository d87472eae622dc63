"""Reference quantization casts (per tensor, per block) vs independent float64 oracles (delayed scaling:
test_delayed_scaling.py).

The FP8 oracle below never calls torch's float8 cast: it rounds |v| to the nearest value of the
FP8 grid (ties to the even code), saturates at fp8_max and sets the sign bit, so "q is the
saturating round-to-nearest-even cast of x * scale" is checked bit for bit.
"""

import math

import pytest
import torch

from tests.utils import dtype_tols, randn, sqnr
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference import quantization as ref
from transformer_engine.plugin.core import with_preference, with_strict_mode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_CODE = {E4M3: 0x7E, E5M2: 0x7B}  # largest finite positive code: 448 and 57344
_FP32_MAX = torch.finfo(torch.float32).max


def _fp8_codes(v: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """uint8 codes of saturate-then-round-to-nearest-even(v) on the FP8 grid (v finite or inf, not NaN)."""
    grid = torch.arange(_MAX_CODE[fp8_dtype] + 1, dtype=torch.uint8).view(fp8_dtype).double()  # increasing
    mag = v.double().abs().clamp(max=grid[-1].item()).reshape(-1)
    hi = torch.searchsorted(grid, mag).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = code | (torch.signbit(v.reshape(-1)).long() << 7)
    return code.to(torch.uint8).reshape(v.shape)


def _wide_range(shape, dtype):
    """Random values spanning ~1e-6 .. 1e4 in magnitude: FP8 subnormals, normals and saturation."""
    magnitude = 10.0 ** (torch.rand(shape) * 10 - 6)
    return (randn(*shape) * magnitude).to(dtype)


def _random_scale():
    return torch.exp(torch.randn(1)).float()


def _product_f32(x, scale):
    """x * scale rounded once to float32 (the float64 product of two <=24-bit values is exact)."""
    return (x.double() * scale.double()).float()


def _finite_amax(x):
    x64 = x.double()
    finite = x64[torch.isfinite(x64)]
    return finite.abs().max().item() if finite.numel() else 0.0


# ---------------------------------------------------------------- per-tensor quantize / dequantize


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 131), (2, 5, 17)])
def test_quantize_bit_exact(shape, dtype, fp8_dtype):
    x = _wide_range(shape, dtype)
    scale = _random_scale()
    q, scale_inv, amax = ref.quantize(x, scale, fp8_dtype)
    assert q.dtype == fp8_dtype and q.shape == x.shape
    assert torch.equal(q.view(torch.uint8), _fp8_codes(_product_f32(x, scale), fp8_dtype))
    assert scale_inv.shape == () and scale_inv.dtype == torch.float32
    assert scale_inv.item() == torch.tensor(1.0 / scale.double().item(), dtype=torch.float32).item()
    assert amax.shape == () and amax.dtype == torch.float32 and amax.item() == _finite_amax(x)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_saturates_inf_and_large_keeps_nan(fp8_dtype):
    fp8_max = torch.finfo(fp8_dtype).max
    x = torch.tensor([math.inf, -math.inf, 1e30, -1e30, 2 * fp8_max, math.nan, 3.0, -0.0])
    q, _, amax = ref.quantize(x, torch.ones(1), fp8_dtype)
    values = q.float()
    assert values[:5].tolist() == [fp8_max, -fp8_max, fp8_max, -fp8_max, fp8_max]
    assert torch.isnan(values[5]) and values[6].item() == 3.0
    assert torch.signbit(values[7]) and values[7].item() == 0.0
    assert amax.item() == torch.tensor(1e30).item()  # NaN and inf do not poison amax


@pytest.mark.parametrize(
    "fp8_dtype, x, expected",
    [
        # halfway cases round to the even code (e4m3 step 0.125 at 1, e5m2 step 0.25)
        (E4M3, [1.0625, 1.1875, -1.0625, 0.001953125 * 1.5], [1.0, 1.25, -1.0, 0.001953125 * 2]),
        (E5M2, [1.125, 1.375, -1.125, 2.0**-16 * 1.5], [1.0, 1.5, -1.0, 2.0**-16 * 2]),
    ],
)
def test_quantize_rounds_half_to_even(fp8_dtype, x, expected):
    q, _, _ = ref.quantize(torch.tensor(x), torch.ones(1), fp8_dtype)
    assert q.float().tolist() == expected


def test_quantize_all_non_finite_gives_zero_amax():
    x = torch.tensor([math.nan, math.inf, -math.inf])
    assert ref.quantize(x, torch.ones(1), E4M3)[2].item() == 0.0


@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dequantize(fp8_dtype, out_dtype):
    q, scale_inv, _ = ref.quantize(_wide_range((5, 37), torch.float32), _random_scale(), fp8_dtype)
    x = ref.dequantize(q, scale_inv, out_dtype)
    expected = q.double() * scale_inv.double()
    assert x.dtype == out_dtype and x.shape == q.shape
    if out_dtype == torch.float32:  # one rounding on both sides: exact
        assert torch.equal(x, expected.float())
    else:
        torch.testing.assert_close(x.double(), expected, **dtype_tols(out_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_dequantize_sqnr(fp8_dtype):
    # Round trip of N(0, 1) with a scale that maps amax to fp8_max: E4M3 keeps 3 mantissa bits
    # (~31 dB for uniform rounding error), E5M2 2 bits (~25 dB); the floors leave ~5 dB slack.
    x = randn(64, 129)
    scale = torch.tensor([torch.finfo(fp8_dtype).max]) / x.abs().max()
    q, scale_inv, _ = ref.quantize(x, scale, fp8_dtype)
    assert sqnr(x, ref.dequantize(q, scale_inv, torch.float32)) > (25.0 if fp8_dtype == E4M3 else 19.0)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (37, 1), (64, 129)])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_cast_transpose(shape, dtype):
    x = _wide_range(shape, dtype)
    scale = _random_scale()
    q, q_t, scale_inv, amax = ref.cast_transpose(x, scale, E4M3)
    codes = _fp8_codes(_product_f32(x, scale), E4M3)
    assert torch.equal(q.view(torch.uint8), codes)
    assert q_t.shape == (shape[1], shape[0]) and q_t.is_contiguous()
    assert torch.equal(q_t.view(torch.uint8), codes.t())
    assert scale_inv.item() == torch.tensor(1.0 / scale.item(), dtype=torch.float64).float().item()
    assert amax.item() == _finite_amax(x)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (64, 129)])
def test_quantize_transposed(shape):
    x, scale = _wide_range(shape, torch.bfloat16), _random_scale()
    q_t, scale_inv, amax = ref.quantize_transposed(x, scale, E5M2)
    assert q_t.shape == (shape[1], shape[0]) and q_t.is_contiguous()
    assert torch.equal(q_t.view(torch.uint8), _fp8_codes(_product_f32(x, scale), E5M2).t())
    assert scale_inv.item() == torch.tensor(1.0 / scale.item(), dtype=torch.float64).float().item()
    assert amax.item() == _finite_amax(x)
    with pytest.raises(ValueError, match="2-D"):
        ref.quantize_transposed(_wide_range((2, 3, 4), torch.bfloat16), scale, E5M2)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (65, 130)])
def test_cast_transpose_dbias(shape, dtype, fp8_dtype):
    x = _wide_range(shape, dtype)
    scale = _random_scale()
    q, q_t, scale_inv, amax, dbias = ref.cast_transpose_dbias(x, scale, fp8_dtype)
    codes = _fp8_codes(_product_f32(x, scale), fp8_dtype)
    assert torch.equal(q.view(torch.uint8), codes) and q_t.is_contiguous()
    assert torch.equal(q_t.view(torch.uint8), codes.t())
    assert scale_inv.item() == torch.tensor(1.0 / scale.item(), dtype=torch.float64).float().item()
    assert amax.item() == _finite_amax(x)
    # a float32 sum of n terms in torch's cascade order errs by ~log2(n) * 2^-24 * sum |x| at most; 1e-5 bounds it
    assert dbias.dtype == torch.float32 and dbias.shape == (shape[1],)
    error = (dbias.double() - x.double().sum(0)).abs()
    assert bool((error <= 1e-5 * x.double().abs().sum(0)).all())


def test_cast_transpose_dbias_non_finite_and_empty():
    x = randn(9, 4)
    x[2, 0], x[3, 1], x[4, 2], x[5, 2] = math.nan, math.inf, math.inf, -math.inf
    dbias = ref.cast_transpose_dbias(x, torch.ones(1), E4M3)[4]
    assert torch.isnan(dbias[0]) and dbias[1].item() == math.inf and torch.isnan(dbias[2])
    assert dbias[3].item() == pytest.approx(x[:, 3].double().sum().item(), rel=1e-6)
    q, q_t, _, amax, dbias = ref.cast_transpose_dbias(torch.empty(0, 3, dtype=torch.bfloat16), torch.ones(1), E5M2)
    assert q.shape == (0, 3) and q_t.shape == (3, 0) and amax.item() == 0.0
    assert dbias.dtype == torch.float32 and dbias.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (17, 64)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_transpose(shape, fp8_dtype):
    q = randn(*shape).to(fp8_dtype)
    q_t = ref.fp8_transpose(q)
    assert q_t.dtype == fp8_dtype and q_t.is_contiguous()
    bits, bits_t = q.view(torch.uint8), q_t.view(torch.uint8)
    assert all(bits_t[j, i] == bits[i, j] for i in range(shape[0]) for j in range(shape[1]))


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (13,), (4, 97)])
def test_compute_amax(shape, dtype):
    x = randn(*shape, scale=3.0).to(dtype)
    if x.numel() > 2:
        x.view(-1)[0], x.view(-1)[1] = math.nan, -math.inf
    amax = ref.compute_amax(x)
    assert amax.shape == () and amax.dtype == torch.float32
    assert amax.item() == _finite_amax(x)


def _current_scale_oracle(amax: float, fp8_max: float, eps: float, pow2: bool) -> float:
    """The catalog text in Python floats: the float64 quotient rounded once to float32 (correct rounding),
    eps as the float32 it becomes on the tensor."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    eps = float(torch.tensor(eps, dtype=torch.float32))
    scale = float(torch.tensor(fp8_max / max(amax, eps), dtype=torch.float64).float())
    scale = min(scale, _FP32_MAX)
    return 2.0 ** math.floor(math.log2(scale)) if pow2 else scale


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_scale_from_amax_matches_oracle(fp8_dtype, pow2, eps):
    fp8_max = torch.finfo(fp8_dtype).max
    amaxes = [3.7, 1e-3 * torch.rand(()).item() + 1e-6, 0.0, math.inf, math.nan, 1e-40, 5e4, 448.0, 13.4598]
    amaxes += (torch.rand(200) * 100).tolist()  # fresh values: the quotient is correctly rounded, bit for bit
    for amax in amaxes:
        got = ref.scale_from_amax(torch.tensor(amax), fp8_dtype, eps, pow2)
        want = torch.tensor(_current_scale_oracle(float(torch.tensor(amax)), fp8_max, eps, pow2), dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == ()
        assert torch.equal(got, want), f"amax={amax}"


def test_current_scale_is_amax_then_scale():
    x = randn(33, 17, scale=5.0)
    scale, amax = ref.current_scale(x, torch.float8_e5m2, 0.0, power_2_scale=True)
    assert torch.equal(amax, ref.compute_amax(x))
    assert torch.equal(scale, ref.scale_from_amax(amax, torch.float8_e5m2, 0.0, power_2_scale=True))
    for bad in (-1.0, math.nan, 1e39):  # negative, NaN, finite beyond float32: the rule shared with flagos
        with pytest.raises(ValueError, match="amax_epsilon=.* must be 0, a float32 value > 0 or inf"):
            ref.current_scale(x, torch.float8_e4m3fn, bad)


# ---------------------------------------------------------------- block scaling


def _block_oracle(x, fp8_dtype, block_rows, block_cols, power_2, eps):
    """(codes, scale_inv) from per-tile Python loops, following the catalog text."""
    fp8_max = torch.finfo(fp8_dtype).max
    m, n = x.shape
    tiles_m, tiles_n = -(-m // block_rows), -(-n // block_cols)
    scale_inv = torch.empty(tiles_m, tiles_n, dtype=torch.float32)
    scale_full = torch.empty(m, n, dtype=torch.float64)
    for ti in range(tiles_m):
        for tj in range(tiles_n):
            rows, cols = slice(ti * block_rows, (ti + 1) * block_rows), slice(tj * block_cols, (tj + 1) * block_cols)
            a = max(x[rows, cols].double().abs().max().item(), eps)
            scale = fp8_max / a if (a > 0 and math.isfinite(a)) else 1.0
            scale = min(float(torch.tensor(scale, dtype=torch.float32)), _FP32_MAX)  # float32 division, inf -> max
            if power_2:
                scale = 2.0 ** (math.frexp(scale)[1] - 1)
            scale_inv[ti, tj] = 1.0 / scale
            scale_full[rows, cols] = scale
    return _fp8_codes((x.double() * scale_full).float(), fp8_dtype), scale_inv


BLOCK_CASES = [(1, 128, False), (1, 128, True), (128, 128, True), (128, 128, False), (1, 32, True)]


@pytest.mark.parametrize("block_rows, block_cols, power_2", BLOCK_CASES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (130, 131)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_blockwise_matches_tile_oracle(shape, dtype, block_rows, block_cols, power_2):
    x = _wide_range(shape, dtype)
    x[: min(block_rows, shape[0]), : min(block_cols, shape[1])] = 0  # an all-zero tile: scale 1
    q, scale_inv = ref.quantize_blockwise(x, E4M3, block_rows, block_cols, power_2, 0.0)
    codes, expected_scale_inv = _block_oracle(x, E4M3, block_rows, block_cols, power_2, 0.0)
    assert q.shape == x.shape and q.dtype == E4M3 and q.is_contiguous()
    assert scale_inv.dtype == torch.float32 and torch.equal(scale_inv, expected_scale_inv)
    assert scale_inv[0, 0].item() == 1.0
    assert torch.equal(q.view(torch.uint8), codes)


@pytest.mark.parametrize("op", ["cast_transpose_dbias", "cast_transpose_blockwise_dbias"])
def test_dbias_in_the_bias_dtype_is_the_float32_sum_rounded_once(op):
    x = randn(70, 40, dtype=torch.bfloat16)
    args = (torch.ones(1), E4M3) if op == "cast_transpose_dbias" else (E4M3, 16, False, 0.0)
    dbias = getattr(ref, op)(x, *args, dbias_dtype=torch.bfloat16)[-1]
    assert dbias.dtype == torch.bfloat16 and torch.equal(dbias, x.sum(0, dtype=torch.float32).to(torch.bfloat16))
    assert getattr(ref, op)(x, *args)[-1].dtype == torch.float32
    with pytest.raises(ValueError, match="dbias_dtype"):
        getattr(ref, op)(x, *args, dbias_dtype=torch.int32)


@pytest.mark.parametrize("block_rows, block_cols", [(128, 128), (1, 128), (32, 1), (3, 5)])
@pytest.mark.parametrize("power_2", [True, False])
def test_shards_cast_by_range_are_the_whole_matrix_block_cast(block_rows, block_cols, power_2):
    # shards of the flattened matrix (one empty, one of one element, others across tile rows): the MAX of their tile
    # amaxes, then each shard's range cast, laid side by side, equal quantize_blockwise of the whole, bit for bit
    rows, cols = 300, 260
    x = _wide_range((rows, cols), torch.bfloat16)
    x[5, 7] = math.inf  # a tile of scale 1
    flat = x.reshape(-1)
    cuts = [0, 1, 777, 777, 40000, 60000, flat.numel()]
    shards = [(flat[a:b], a) for a, b in zip(cuts, cuts[1:])]
    amax = torch.stack([ref.block_amax_of_range(v, rows, cols, a, block_rows, block_cols) for v, a in shards]).amax(0)
    casts = [ref.quantize_blockwise_range(v, amax, rows, cols, a, block_rows, block_cols, E4M3, power_2, 1e-6) for v, a in shards]
    q, scale_inv = ref.quantize_blockwise(x, E4M3, block_rows, block_cols, power_2, 1e-6)
    assert torch.equal(torch.cat([c[0] for c in casts]).view(torch.uint8), q.view(torch.uint8).reshape(-1))
    assert all(torch.equal(c[1], scale_inv) for c in casts)
    assert torch.equal(amax, torch.tensor(_tile_amax(x, block_rows, block_cols)))


def _tile_amax(x, block_rows, block_cols):
    rows, cols = x.shape
    return [[x[i:i + block_rows, j:j + block_cols].float().abs().max().item() for j in range(0, cols, block_cols)]
            for i in range(0, rows, block_rows)]


def test_block_range_tiles_outside_the_range_are_zero_and_bad_ranges_are_refused():
    x = torch.ones(10)
    amax = ref.block_amax_of_range(x, 4, 8, 14, 2, 4)  # elements 14..23: rows 1 (cols 6, 7) and 2 (cols 0-7)
    assert amax.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="does not fit"):
        ref.block_amax_of_range(x, 4, 8, 23, 2, 4)
    with pytest.raises(ValueError, match="block_cols"):
        ref.block_amax_of_range(x, 4, 8, 0, 2, 0)
    with pytest.raises(ValueError, match="tile grid"):
        ref.quantize_blockwise_range(x, torch.ones(2, 3), 4, 8, 0, 2, 4, E4M3, power_2_scale=False, amax_epsilon=0.0)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_mxfp8_scale_is_e8m0_rounded_up(fp8_dtype):
    x = _wide_range((5, 96), torch.float32)
    _, scale_inv = ref.quantize_blockwise(x, fp8_dtype, 1, 32, power_2_scale=True, amax_epsilon=0.0)
    tile_amax = x.double().abs().reshape(5, 3, 32).amax(-1)
    fp8_max = torch.finfo(fp8_dtype).max
    expected = [[2.0 ** math.ceil(math.log2(a / fp8_max)) for a in row] for row in tile_amax.tolist()]
    assert scale_inv.tolist() == expected


def test_quantize_blockwise_epsilon_and_non_finite_tiles():
    x = randn(2, 64)
    x[0, :32] *= 1e-6  # tile amax below eps: a = eps
    x[1, 40] = math.inf  # a non-finite tile amax: scale 1, inf saturates
    q, scale_inv = ref.quantize_blockwise(x, E4M3, 1, 32, power_2_scale=False, amax_epsilon=1e-3)
    eps_f32 = float(torch.tensor(1e-3))
    scale_f32 = float(torch.tensor(448.0 / eps_f32))  # float32 division, rounded once
    assert scale_inv[0, 0].item() == float(torch.tensor(1.0 / scale_f32))
    assert scale_inv[1, 1].item() == 1.0 and q[1, 40].float().item() == 448.0


@pytest.mark.parametrize("block_rows, block_cols, power_2", BLOCK_CASES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
def test_dequantize_blockwise(block_rows, block_cols, power_2, out_dtype):
    x = randn(131, 150)
    q, scale_inv = ref.quantize_blockwise(x, E4M3, block_rows, block_cols, power_2, 0.0)
    out = ref.dequantize_blockwise(q, scale_inv, block_rows, block_cols, out_dtype)
    expected = torch.empty(131, 150, dtype=torch.float64)
    for i in range(0, 131, block_rows):
        for j in range(0, 150, block_cols):
            tile = (slice(i, i + block_rows), slice(j, j + block_cols))
            expected[tile] = q[tile].double() * scale_inv[i // block_rows, j // block_cols].item()
    assert out.dtype == out_dtype
    if out_dtype == torch.float32:
        assert torch.equal(out, expected.float())
    else:
        torch.testing.assert_close(out.double(), expected, **dtype_tols(out_dtype))
    assert sqnr(x, out.float()) > 25.0  # E4M3 with per-tile scales: same floor as per tensor


@pytest.mark.parametrize("shape", [(1, 1), (130, 200), (257, 131)])
@pytest.mark.parametrize("power_2", [False, True])
def test_cast_transpose_blockwise_quantizes_each_direction_on_its_own(shape, power_2):
    x = _wide_range(shape, torch.bfloat16)
    q, scale_inv, q_t, scale_inv_t = ref.cast_transpose_blockwise(x, E4M3, 128, power_2, 0.0)
    codes, expected = _block_oracle(x, E4M3, 1, 128, power_2, 0.0)
    codes_t, expected_t = _block_oracle(x.t(), E4M3, 1, 128, power_2, 0.0)
    assert torch.equal(q.view(torch.uint8), codes) and torch.equal(scale_inv, expected)
    assert torch.equal(q_t.view(torch.uint8), codes_t) and torch.equal(scale_inv_t, expected_t)
    assert q_t.shape == shape[::-1] and scale_inv_t.shape == (shape[1], -(-shape[0] // 128))
    if min(shape) > 1:  # column blocks have their own scales: q_t is not q^T
        assert not torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8))


def test_cast_transpose_blockwise_dbias_adds_the_float32_column_sums():
    x = _wide_range((257, 131), torch.bfloat16)
    *casts, dbias = ref.cast_transpose_blockwise_dbias(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0)
    for got, want in zip(casts, ref.cast_transpose_blockwise(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got, want.view(torch.uint8) if want.dtype == E4M3 else want)
    assert dbias.dtype == torch.float32 and torch.equal(dbias, x.sum(0, dtype=torch.float32))


# ---------------------------------------------------------------- errors and dispatch


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ref.quantize(randn(4), torch.ones(1), torch.float16), ValueError, "not an FP8 dtype"),
        (lambda: ref.quantize(randn(4), torch.ones(2), E4M3), ValueError, "exactly one element"),
        (lambda: ref.quantize(randn(4).to(E4M3), torch.ones(1), E4M3), TypeError, "dequantize FP8 first"),
        (lambda: ref.dequantize(randn(4), torch.ones(1), torch.float32), TypeError, "float8"),
        (lambda: ref.dequantize(randn(4).to(E5M2), torch.ones(1), E4M3), ValueError, "not FP8"),
        (lambda: ref.cast_transpose(randn(2, 3, 4), torch.ones(1), E4M3), ValueError, "2-D"),
        (lambda: ref.cast_transpose_dbias(randn(5), torch.ones(1), E4M3), ValueError, "2-D"),
        (lambda: ref.cast_transpose_dbias(randn(2, 3).int(), torch.ones(1), E4M3), TypeError, "dtype"),
        (lambda: ref.quantize_blockwise(randn(4, 4), E4M3, 0, 32, power_2_scale=True, amax_epsilon=0.0), ValueError, "block_rows"),
        (lambda: ref.quantize_blockwise(randn(4, 4), E4M3, 1, 32, power_2_scale=True, amax_epsilon=-1.0), ValueError, "amax_epsilon"),
        (lambda: ref.dequantize_blockwise(randn(4, 40).to(E4M3), torch.ones(4, 1), 1, 32, torch.float32), ValueError, r"\(4, 2\)"),
        (lambda: ref.quantize(randn(4), torch.ones(1), E4M3, torch.zeros(2)), ValueError, "amax_out must hold exactly one"),
        (lambda: ref.cast_transpose(randn(4, 4), torch.ones(1), E4M3, torch.zeros(()).half()), ValueError, "amax_out must be a float32"),
        (lambda: ref.cast_transpose_dbias(randn(4, 4), torch.ones(1), E4M3, [0.0]), TypeError, "amax_out must be a torch.Tensor"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_dispatch_through_ops():
    x = randn(3, 40)
    with with_preference("reference"), with_strict_mode():
        (q, scale_inv, amax), impl = ops.quantize.traced(x, torch.ones(1), E4M3)
        history, scale = ops.delayed_scaling_update(torch.ones(2, 2), torch.ones(2), 448.0, 0.0, "max")
        q_b, _ = ops.quantize_blockwise(x, E4M3, 1, 32, power_2_scale=True, amax_epsilon=0.0)
        dbias_result, dbias_impl = ops.cast_transpose_dbias.traced(x, torch.ones(1), E4M3)
    assert impl.impl_id == dbias_impl.impl_id == IMPL_ID
    assert torch.equal(dbias_result[4], x.sum(0))
    assert torch.equal(q.view(torch.uint8), ref.quantize(x, torch.ones(1), E4M3)[0].view(torch.uint8))
    assert scale.tolist() == [448.0, 448.0] and q_b.shape == x.shape
