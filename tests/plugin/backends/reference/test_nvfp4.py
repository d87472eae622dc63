"""Reference NVFP4 ops vs the independent model of the format in ``tests/nvfp4_spec.py``, bit for bit.

E2M1 codes, E4M3 block scales and amaxes are compared exactly on random data spanning many binades
(blocks whose scale underflows included), zero blocks, ties, NaN / +-inf, 1-D and 2-D scaling, with and
without the random Hadamard transform, and with stochastic rounding (also checked to be unbiased);
the decode and the emulated GEMM are compared with the model's float64 values.
"""

import pytest
import torch

from tests.nvfp4_spec import E2M1_GRID, E4M3_GRID, spec_amax, spec_bits, spec_copy, spec_decode, spec_rht, unpack
from tests.utils import rel_err
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import nvfp4 as ref

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAN, INF = float("nan"), float("inf")


def _quantize(x, rowwise=True, columnwise=True, block_2d=False, rht=False, seed=None):
    return ops.quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, seed is not None, seed)


def _assert_copy_matches_spec(data, scale, amax, x, block_2d=False, bits=None):
    """data [R, C / 2], scale [R, C / 16], amax [1] are the NVFP4 copy of x [R, C] (codes and bits exact)."""
    expected_amax = spec_amax(x)
    codes, scale_codes = spec_copy(x, expected_amax, block_2d, bits)
    assert amax.dtype == torch.float32 and amax.shape == (1,) and amax.item() == expected_amax
    assert data.dtype == torch.uint8 and data.shape == (x.shape[0], x.shape[1] // 2)
    assert scale.dtype == torch.uint8 and torch.equal(scale.long(), scale_codes)
    assert torch.equal(unpack(data), codes)


def _wide_range(shape, dtype=torch.float32):
    """Random signs and magnitudes 1e-6 .. 1e4 (fp16: 1e-3 .. 1e3), a zero block and a zero tile in the corner."""
    low, high = (-3, 3) if dtype is torch.float16 else (-6, 4)
    x = torch.randn(shape).sign() * 10.0 ** (torch.rand(shape) * (high - low) + low)
    x[:16, :16] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 16), (32, 48), (48, 160), (112, 32)])
def test_quantize_matches_the_spec_bit_for_bit(shape, dtype, block_2d):
    x = _wide_range(shape, dtype)
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, block_2d=block_2d)
    _assert_copy_matches_spec(data, scale, amax, x, block_2d)
    _assert_copy_matches_spec(data_t, scale_t, amax_t, x.t(), block_2d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rht_column_wise_copy_matches_the_spec(dtype):
    x = (torch.randn(64, 48) * 3).to(dtype)
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, rht=True)
    _assert_copy_matches_spec(data, scale, amax, x)  # the row-wise copy is untouched
    x_t = spec_rht(x.t())
    _assert_copy_matches_spec(data_t, scale_t, amax_t, x_t)
    assert amax_t.item() != amax.item()  # the amax of RHT(x^T), not of x


def test_rht_matrix_is_te_s_orthogonal_signed_hadamard():
    r = ref.rht_matrix()
    torch.testing.assert_close(r @ r.t(), torch.eye(16, dtype=torch.float64), rtol=0, atol=0)
    assert set(r.abs().flatten().tolist()) == {0.25}
    # D H16: row i of Sylvester's H16 times sign i; sign mask (bit i where sign i is -1) as TE's 0xD7E8
    assert torch.equal(torch.sign(r[:, 0]), torch.tensor(ref.RHT_SIGNS, dtype=torch.float64))
    assert sum(1 << i for i, s in enumerate(ref.RHT_SIGNS) if s < 0) == 0xD7E8
    x = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(ref.rht_rows(x), spec_rht(x), rtol=1e-15, atol=0)


def test_gemm_of_rht_copies_is_the_plain_product():
    """wgrad dW = dy^T x from the column-wise copies of dy [T, O] and x [T, I]: RHT along T cancels."""
    dy, x = torch.randn(128, 32).bfloat16(), torch.randn(128, 48).bfloat16()
    exact = dy.double().t() @ x.double()
    errors = {}
    for rht in (False, True):
        _, _, _, dy_t, dy_s, dy_amax = _quantize(dy, rowwise=False, rht=rht)
        _, _, _, x_t, x_s, x_amax = _quantize(x, rowwise=False, rht=rht)
        errors[rht] = rel_err(exact, ops.gemm_nvfp4(dy_t, x_t, dy_s, x_s, dy_amax, x_amax, torch.float32))
    # the unquantized transform is exact up to rounding; quantized, both stay at NVFP4's error level: about
    # 0.095 per operand (see test_round_trip_error_is_nvfp4_s), so sqrt(2) * 0.095 = 0.134 for the product
    torch.testing.assert_close(spec_rht(dy.double().t()) @ spec_rht(x.double().t()).t(), exact)
    assert errors[True] < 0.16 and errors[False] < 0.16


def test_2d_tiles_share_one_scale_and_the_copies_transpose():
    x = torch.randn(48, 64) * torch.rand(48, 1) * 10
    data, scale, _, data_t, scale_t, _ = _quantize(x, block_2d=True)
    tiles = scale.reshape(3, 16, 4)
    assert (tiles == tiles[:, :1]).all()  # the 16 rows of a tile carry one scale
    assert torch.equal(scale[::16], scale_t[::16].t())  # tile (i, j) of x is tile (j, i) of x^T


def test_rowwise_and_columnwise_are_asked_for_separately():
    x = torch.randn(32, 64)
    row_only = _quantize(x, columnwise=False)
    col_only = _quantize(x, rowwise=False)
    assert all(t is None for t in row_only[3:]) and all(t is None for t in col_only[:3])
    both = _quantize(x)
    assert all(torch.equal(a, b) for a, b in zip(row_only[:3] + col_only[3:], both))


def test_nearest_rounding_ties_to_even_codes():
    """amax = 2688 makes S_enc = 1; a block with amax 6 then has s = 1 and enc = 1: y = x exactly."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[0, 16:24], x[0, 24:32] = ties, -ties
    data, scale, _, _, _, _ = _quantize(x, columnwise=False)
    assert ref.decode_e4m3(scale).tolist() == [[448.0, 1.0]]
    expected = [0, 2, 2, 4, 4, 6, 6, 7]
    assert unpack(data)[0, 16:].tolist() == expected + [8 + c for c in expected]


def test_values_beyond_the_grid_saturate_to_six():
    """A block whose E4M3 scale underflows to 0 gets enc = fp32_max: its elements saturate to +-6 (x_hat = 0)."""
    x = torch.zeros(2, 16)
    x[0, 0], x[1, :] = 1e4, torch.linspace(-1e-4, 1e-4, 16)
    data, scale, amax, _, _, _ = _quantize(x, columnwise=False)
    assert scale[1].item() == 0 and set(unpack(data)[1].tolist()) == {7, 15}
    assert (ops.dequantize_nvfp4(data, scale, amax, torch.float32)[1] == 0).all()
    _assert_copy_matches_spec(data, scale, amax, x)


def test_zero_tensor():
    data, scale, amax, data_t, scale_t, amax_t = _quantize(torch.zeros(32, 32))
    assert amax.item() == 0 and amax_t.item() == 0
    assert (data == 0).all() and (scale == 0).all() and (data_t == 0).all() and (scale_t == 0).all()
    assert (ops.dequantize_nvfp4(data, scale, amax, torch.float32) == 0).all()


def test_nan_inf_and_negative_zero():
    """As TE's kernels: NaN is ignored by both amaxes (fmaxf) and becomes +6; +-inf counts, so amax = inf
    and S_enc = 1, its block's scale saturates to 448, inf saturates to 6; -0 keeps its sign."""
    x = torch.randn(32, 32)
    x[0, 3], x[5, 20], x[17, 2] = NAN, -INF, -0.0
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x)
    _assert_copy_matches_spec(data, scale, amax, x)
    _assert_copy_matches_spec(data_t, scale_t, amax_t, x.t())
    codes = unpack(data)
    assert codes[0, 3] == 7 and codes[5, 20] == 15 and codes[17, 2] == 8 and amax.item() == INF
    assert ref.decode_e4m3(scale)[5, 1] == 448.0
    finite = x.clone()
    finite[5, 20] = 0.0
    assert _quantize(finite)[2].item() == spec_amax(finite)  # NaN ignored: the amax of the finite values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_stochastic_rounding_matches_the_spec_and_is_deterministic(dtype, rht):
    x = (torch.randn(32, 48) * 2).to(dtype)
    seed = torch.tensor([-(2**40) - 12345])
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, rht=rht, seed=seed)
    _assert_copy_matches_spec(data, scale, amax, x, bits=spec_bits(seed.item(), 0, x.numel()))
    x_t = spec_rht(x.t()) if rht else x.t()
    _assert_copy_matches_spec(data_t, scale_t, amax_t, x_t, bits=spec_bits(seed.item(), 1, x.numel()))
    again = _quantize(x, rht=rht, seed=seed.clone())
    assert torch.equal(again[0], data) and torch.equal(again[3], data_t)
    other = _quantize(x, rht=rht, seed=seed + 1)
    assert not torch.equal(other[0], data) and torch.equal(other[1], scale)  # other draws, the same scales


def test_stochastic_rounding_is_unbiased():
    """4096 rows repeat one row: each row draws its own bits, so the column means estimate E[x_hat] = x."""
    row = torch.tensor([6.0, 0.1, 0.3, -0.7, 1.2, 1.6, 2.2, -2.9, 3.3, 4.4, 5.5, 0.5, -1.0, 0.05, 4.9, -5.9])
    x = row.repeat(4096, 1)
    data, scale, amax, _, _, _ = _quantize(x, columnwise=False, seed=torch.tensor([7]))
    x_hat = ops.dequantize_nvfp4(data, scale, amax, torch.float32).double()
    # every draw is one of the two grid neighbours of x (here s = 448 and S_enc = 448: x_hat is on the grid)
    grid = torch.cat((-E2M1_GRID.flip(0), E2M1_GRID))
    below = grid[torch.searchsorted(grid, row.double(), right=True) - 1]
    above = grid[torch.searchsorted(grid, row.double(), right=False).clamp(max=len(grid) - 1)]
    assert ((x_hat == below) | (x_hat == above)).all()
    # |mean - x| within 5 standard errors of a two-point draw (step <= 2, so sd <= 1, se <= 1/64)
    assert (x_hat.mean(dim=0) - row.double()).abs().max() < 5 / 64
    nearest = ops.dequantize_nvfp4(*_quantize(x[:1], columnwise=False)[:3], torch.float32).double()
    assert (x_hat.mean(dim=0) - row.double()).abs().sum() < (nearest - row.double()).abs().sum()


def test_random_bits_are_the_spec_hash():
    bits = ref.random_bits(torch.tensor([2**33 + 5]), 1, (4, 8), torch.device("cpu"))
    assert bits.flatten().tolist() == spec_bits(2**33 + 5, 1, 32)


# -- dequantize and GEMM ---------------------------------------------------------------------------
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_dequantize_is_the_spec_decode(rht):
    x = _wide_range((48, 64))
    data, scale, amax, data_t, scale_t, amax_t = _quantize(x, rht=rht)
    for q, s, a, source in ((data, scale, amax, x), (data_t, scale_t, amax_t, spec_rht(x.t()) if rht else x.t())):
        codes, scale_codes = spec_copy(source, a.item())
        decoded = ops.dequantize_nvfp4(q, s, a, torch.float32)
        assert torch.equal(decoded.double(), spec_decode(codes, scale_codes, a.item()))
        assert torch.equal(ops.dequantize_nvfp4(q, s, a, torch.bfloat16), decoded.bfloat16())


def test_round_trip_error_is_nvfp4_s():
    """Gaussian data: E2M1 with E4M3 block scales keeps the relative error near 0.095 (about 20 dB)."""
    x = torch.randn(64, 256)
    data, scale, amax, _, _, _ = _quantize(x, columnwise=False)
    assert rel_err(x, ops.dequantize_nvfp4(data, scale, amax, torch.float32)) < 0.12


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_is_the_float32_gemm_of_the_decoded_operands(accumulate):
    a_hp, b_hp, bias = torch.randn(48, 96), torch.randn(40, 96), torch.randn(40)
    a, a_s, a_amax, _, _, _ = _quantize(a_hp, columnwise=False)
    b, b_s, b_amax, _, _, _ = _quantize(b_hp, columnwise=False)
    a_dq = spec_decode(*spec_copy(a_hp, a_amax.item()), a_amax.item())
    b_dq = spec_decode(*spec_copy(b_hp, b_amax.item()), b_amax.item())
    expected = a_dq @ b_dq.t() + bias.double()
    if accumulate:
        out = torch.randn(48, 40)
        expected = expected + out.double()
        result = ops.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, torch.float32, bias, out, accumulate=True)
        assert result is out
    else:
        result = ops.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, torch.bfloat16, bias)
        assert result.dtype == torch.bfloat16
    # float32 accumulation over K = 96 vs float64 (1e-5); a bfloat16 output rounds to 2^-8 relative
    torch.testing.assert_close(result.double(), expected, rtol=1.6e-2 if not accumulate else 1e-5, atol=1e-4)


# -- clear errors ----------------------------------------------------------------------------------
def test_alignment_errors_name_the_dim():
    with pytest.raises(ValueError, match=r"last dim \(40\) must be divisible by 16"):
        _quantize(torch.randn(32, 40), columnwise=False)
    with pytest.raises(ValueError, match=r"first dim \(8\) must be divisible by 16"):
        _quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"first dim \(8\) must be divisible by 16"):
        _quantize(torch.randn(8, 32), columnwise=False, block_2d=True)
    assert _quantize(torch.randn(8, 32), columnwise=False)[0].shape == (8, 16)  # row-wise only: rows are free
    assert _quantize(torch.randn(32, 8), rowwise=False)[3].shape == (8, 16)  # column-wise only: columns are free


def test_argument_errors():
    x = torch.randn(32, 32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        _quantize(x.double())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        _quantize(x.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="2-D"):
        _quantize(torch.randn(2, 16, 16))
    with pytest.raises(ValueError, match="at least one copy"):
        _quantize(x, rowwise=False, columnwise=False)
    with pytest.raises(TypeError, match="must be a bool"):
        ops.quantize_nvfp4(x, 1, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=None)
    with pytest.raises(ValueError, match="needs a seed"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True, seed=None)
    with pytest.raises(ValueError, match="stochastic_rounding=False"):
        ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=torch.tensor([1]))
    with pytest.raises(TypeError, match="int64"):
        _quantize(x, seed=torch.tensor([1.0]))
    q, s, a, _, _, _ = _quantize(x)
    with pytest.raises(TypeError, match="uint8"):
        ops.dequantize_nvfp4(q, s.float(), a, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        ops.dequantize_nvfp4(q, s[:, :1], a, torch.float32)
    with pytest.raises(TypeError, match="float32"):
        ops.dequantize_nvfp4(q, s, a.double(), torch.float32)
    b, b_s, b_a, _, _, _ = _quantize(torch.randn(32, 64), columnwise=False)
    with pytest.raises(ValueError, match="inner dimensions"):
        ops.gemm_nvfp4(q, b, s, b_s, a, b_a, torch.float32)


def test_empty_tensors():
    data, scale, amax, data_t, scale_t, amax_t = _quantize(torch.randn(0, 32))
    assert data.shape == (0, 16) and scale.shape == (0, 2) and amax.item() == 0
    assert data_t.shape == (32, 0) and scale_t.shape == (32, 0) and amax_t.item() == 0


def test_traces_without_graph_breaks():
    def roundtrip(x, seed):
        data, scale, amax, data_t, scale_t, amax_t = ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=True,
                                                                        stochastic_rounding=True, seed=seed)
        return (ops.dequantize_nvfp4(data, scale, amax, torch.float32),
                ops.gemm_nvfp4(data_t, data_t, scale_t, scale_t, amax_t, amax_t, torch.float32))

    x, seed = torch.randn(32, 32), torch.tensor([3])
    ops.prepare_for_compile()  # as a TE module's constructor does: dispatchers built on first use would break the graph
    torch._dynamo.reset()
    assert torch._dynamo.explain(roundtrip)(x, seed).graph_break_count == 0
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    for c, e in zip(compiled(x, seed), roundtrip(x, seed)):
        assert torch.equal(c, e)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_2d,rht,stochastic", [(False, False, False), (True, False, False), (False, True, True)])
def test_cuda_gives_the_cpu_bits(dtype, block_2d, rht, stochastic):
    """Every step is exact IEEE float32 on both devices (a division by a Python scalar is not, on CUDA:
    PyTorch multiplies by its rounded reciprocal, which once moved a scale by one E4M3 step)."""
    x = (torch.randn(64, 96) * 10.0 ** (torch.rand(64, 1) * 8 - 4)).to(dtype)
    x[0, 0] = NAN
    seed = torch.tensor([-77]) if stochastic else None
    on_cpu = _quantize(x, block_2d=block_2d, rht=rht, seed=seed)
    on_cuda = _quantize(x.cuda(), block_2d=block_2d, rht=rht, seed=None if seed is None else seed.cuda())
    assert all(torch.equal(c, g.cpu()) for c, g in zip(on_cpu, on_cuda))
    decoded = ops.dequantize_nvfp4(*on_cuda[:3], torch.float32).cpu()
    assert torch.equal(decoded, ops.dequantize_nvfp4(*on_cpu[:3], torch.float32))


def test_e4m3_grid_of_the_spec_is_torch_s():
    """The spec's grid, built from the bit fields, is the value of every finite E4M3 code."""
    codes = torch.arange(127, dtype=torch.uint8)
    assert torch.equal(codes.view(torch.float8_e4m3fn).double(), E4M3_GRID)
