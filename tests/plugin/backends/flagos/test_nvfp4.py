"""flagos NVFP4 kernels vs the reference backend: quantize and dequantize bit for bit, the emulated GEMM
within float32 accumulation error.

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py), at small shapes that
still cover several programs and ragged edges (a cast program takes 16 rows x 128 columns, an amax
program 128 x 128), every option combination, both copies and each alone, the three input dtypes, and the values that take special
paths: zeros, NaN, +-inf, -0, subnormals, amaxes whose S_dec is subnormal, E2M1 ties.
"""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_outputs_identical, assert_same_bits, flagos_and_reference
from transformer_engine.plugin.backends.flagos import nvfp4 as fn
from transformer_engine.plugin.backends.flagos import nvfp4_gemm as fg
from transformer_engine.plugin.backends.reference import nvfp4 as ref

NAN, INF = float("nan"), float("inf")
OPTIONS = [(b2d, rht, sr) for b2d in (False, True) for rht in (False, True) for sr in (False, True)]
OPTION_IDS = [f"{'2d' if b else '1d'}-{'rht' if r else 'plain'}-{'sr' if s else 'rn'}" for b, r, s in OPTIONS]
SEED = -(2**40) - 12345  # both halves non-zero, negative: the high half is the two's complement's


def _wide_range(shape, dtype, device):
    """Random signs, magnitudes 1e-6 .. 1e4 (float16: 1e-3 .. 1e3), a zero 16 x 16 tile and a -0 in the corner."""
    low, high = (-3, 3) if dtype is torch.float16 else (-6, 4)
    x = torch.randn(shape).sign() * 10.0 ** (torch.rand(shape) * (high - low) + low)
    x[:16, :16] = 0.0
    x[0, 1] = -0.0
    return x.to(dtype).to(device)


def _seed(sr, device):
    return torch.tensor([SEED], device=device) if sr else None


def _check_quantize(x, rowwise, columnwise, block_2d, rht, sr):
    args = (x, rowwise, columnwise, block_2d, rht, sr, _seed(sr, x.device))
    assert_outputs_identical(fn.quantize_nvfp4(*args), ref.quantize_nvfp4(*args))


# -- quantize --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_2d, rht, sr", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_quantize_both_copies_bit_exact(dtype, block_2d, rht, sr, device):
    # 80 x 144: 5 x 2 cast programs, ragged columns (and rows for the amax); 10 decades of magnitudes: scales from tiny to 448
    _check_quantize(_wide_range((80, 144), dtype, device), rowwise=True, columnwise=True, block_2d=block_2d, rht=rht, sr=sr)


@pytest.mark.parametrize("block_2d, rht, sr", [(False, False, False), (False, True, True), (True, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_one_copy_bit_exact(dtype, block_2d, rht, sr, device):
    # each copy alone; without block_2d the other dim is free (37: prime, below one tile)
    rows, cols = (48, 32) if block_2d else (37, 48)
    _check_quantize(_wide_range((rows, cols), dtype, device), rowwise=True, columnwise=False, block_2d=block_2d, rht=rht, sr=sr)
    _check_quantize(_wide_range((cols, rows), dtype, device), rowwise=False, columnwise=True, block_2d=block_2d, rht=rht, sr=sr)


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_special_values(dtype, device):
    """NaN (ignored by the amaxes, -> +6), +-inf (amax inf: S_enc = 1), subnormal blocks, a block whose scale
    underflows to 0 (enc = fp32_max), ties of the E2M1 grid (amax 2688 makes S_enc = 1, the block's s = 1)."""
    x = torch.randn(32, 64) * 3
    x[0, 16:24] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[0, 24:32] = -x[0, 16:24]
    x[0, 0] = 2688.0
    x[1, :16] = torch.finfo(dtype).tiny * torch.linspace(-0.5, 0.5, 16)  # subnormals of x's dtype
    x[2, :16] = 1e-4 * torch.linspace(-1, 1, 16)
    x[5, 3], x[9, 40] = NAN, -0.0
    finite = x.to(dtype).to(device)
    with_inf = finite.clone()
    with_inf[17, 2], with_inf[30, 33] = INF, -INF
    for t in (finite, with_inf):
        for block_2d, rht, sr in [(False, False, False), (False, True, True), (True, False, False)]:
            _check_quantize(t, rowwise=True, columnwise=True, block_2d=block_2d, rht=rht, sr=sr)


@pytest.mark.parametrize("scale", [1e-36, 3e37], ids=["tiny", "huge"])
def test_extreme_amax(scale, device):
    # amax 1e-36: S_enc clamps to fp32 max and S_dec = 1 / S_enc is subnormal; amax near fp32 max: S_enc tiny
    x = (torch.randn(32, 32) * scale).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        _check_quantize(x.to(dtype), rowwise=True, columnwise=True, block_2d=False, rht=False, sr=True)


def test_zeros_empty_and_strided_inputs(device):
    _check_quantize(torch.zeros(32, 48, device=device), rowwise=True, columnwise=True, block_2d=False, rht=True, sr=False)
    _check_quantize(torch.zeros(0, 32, device=device), rowwise=True, columnwise=True, block_2d=False, rht=False, sr=False)
    _check_quantize(torch.zeros(32, 0, device=device), rowwise=True, columnwise=True, block_2d=False, rht=False, sr=False)
    wide = _wide_range((48, 100), torch.bfloat16, device)
    _check_quantize(wide[:, 2:66], rowwise=True, columnwise=True, block_2d=False, rht=True, sr=True)  # strided rows
    _check_quantize(wide[:, :32].t(), rowwise=True, columnwise=True, block_2d=True, rht=False, sr=False)  # a transposed view (copied)


def test_seeds_draw_their_own_bits(device):
    x = (torch.randn(32, 48) * 2).to(device)
    for seed in (0, 1, 2**32, -1, 2**63 - 1):
        s = torch.tensor([seed], device=device)
        got = fn.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True, seed=s)
        assert_outputs_identical(got, ref.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False,
                                                         stochastic_rounding=True, seed=s))
    other = fn.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True,
                              seed=torch.tensor([3], device=device))
    assert not torch.equal(other[0], got[0]) and torch.equal(other[1], got[1])  # other draws, the same scales


# -- dequantize ------------------------------------------------------------------------------------
def _every_code(rows, k, device):
    """Every E2M1 code pair and every E4M3 scale code (0x7F, 0xFF: NaN) of a [rows, k] operand."""
    q = torch.arange(rows * k // 2).remainder(256).to(torch.uint8).reshape(rows, k // 2)
    scale = (torch.randperm(rows * k // 16) * 29 + 0x7F).remainder(256).to(torch.uint8).reshape(rows, k // 16)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("amax", [3.0, 1e-30, 3e38, INF, 0.0])
def test_dequantize_every_code_bit_exact(amax, device):
    q, scale = _every_code(64, 48, device)
    amax_t = torch.tensor([amax], device=device)
    for out_dtype in HP_DTYPES:
        assert_same_bits(fg.dequantize_nvfp4(q, scale, amax_t, out_dtype), ref.dequantize_nvfp4(q, scale, amax_t, out_dtype))
    wide_q, wide_s = _every_code(64, 96, device)  # row-strided views
    args = (wide_q[:, :24], wide_s[:, :3], amax_t, torch.bfloat16)
    assert_same_bits(fg.dequantize_nvfp4(*args), ref.dequantize_nvfp4(*args))


# -- GEMM ------------------------------------------------------------------------------------------
def _operand(rows, k, device, columnwise=False):
    """(data, scale, amax, float32 values of the quantized operand) of a random [rows, k] bfloat16 tensor."""
    x = (torch.randn(rows, k) * 10.0 ** (torch.rand(rows, 1) * 4 - 2)).bfloat16().to(device)
    if columnwise:  # the wgrad operand: the column-wise copy of x^T, after the RHT
        data, scale, amax = fn.quantize_nvfp4(x.t().contiguous(), rowwise=False, columnwise=True, block_2d=False, rht=True,
                                              stochastic_rounding=False)[3:]
    else:
        data, scale, amax = fn.quantize_nvfp4(x, rowwise=True, columnwise=False, block_2d=False, rht=False, stochastic_rounding=False)[:3]
    return data, scale, amax, ref.dequantize_nvfp4(data, scale, amax, torch.float32)


def _assert_gemm_close(d, expected, a_dq, b_dq):
    """|d - expected| <= (2 K + 8) 2^-24 (|A| @ |B|^T) + 2^-23 |expected|, plus one ulp of a 16-bit d.

    Both sides sum K products in float32, each within (K - 1) 2^-24 sum |a b| of the exact sum (the
    standard bound); the reference also rounds each dequantized element (3 roundings) and each product,
    this kernel the per-tensor factor once: (2 K + 8) 2^-24 covers both. The bias / out additions are
    the same float32 operations on values this close (2^-23 |D|); a bfloat16 / float16 result may then round
    to the neighbouring value (eps relative, eps * tiny among the subnormals).
    """
    k = a_dq.shape[1]
    assert d.dtype == expected.dtype and d.shape == expected.shape
    out = torch.finfo(d.dtype)
    d, expected = d.double().cpu(), expected.double().cpu()
    bound = (2 * k + 8) * 2.0**-24 * (a_dq.abs().double().cpu() @ b_dq.abs().double().cpu().t()) + 2.0**-23 * expected.abs()
    if out.bits == 16:
        bound = bound + out.eps * (expected.abs() + out.tiny)
    finite = torch.isfinite(expected)  # a float16 D overflows alike (the bound covers |D| up to the rounding)
    assert torch.equal(d[~finite], expected[~finite])
    error = (d - expected).abs()[finite]
    assert bool((error <= bound[finite]).all()), f"max error {error.max()}"


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_gemm_within_float32_accumulation_error(out_dtype, device):
    a, a_s, a_amax, a_dq = _operand(40, 96, device)
    b, b_s, b_amax, b_dq = _operand(24, 96, device)
    bias = torch.randn(24, device=device)
    for args in ((), (bias,), (bias.bfloat16(),)):
        d = fg.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, out_dtype, *args)
        _assert_gemm_close(d, ref.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, out_dtype, *args), a_dq, b_dq)


def test_gemm_accumulates_into_strided_out(device):
    # wgrad shape: both operands the RHT'd column-wise copies (K = 64 tokens), D accumulated into out^T's view
    a, a_s, a_amax, a_dq = _operand(48, 64, device, columnwise=True)
    b, b_s, b_amax, b_dq = _operand(32, 64, device, columnwise=True)
    out = torch.randn(32, 48, device=device).t()
    expected = ref.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, torch.float32, None, out.clone(), accumulate=True)
    d = fg.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, torch.float32, None, out, accumulate=True)
    assert d is out
    _assert_gemm_close(d, expected, a_dq, b_dq)


def test_gemm_nan_scales_and_empty_dims(device):
    (a, a_s), (b, b_s) = _every_code(16, 64, device), _every_code(8, 64, device)
    amax = torch.tensor([3.0], device=device)
    d = fg.gemm_nvfp4(a, b, a_s, b_s, amax, amax, torch.float32)
    expected = ref.gemm_nvfp4(a, b, a_s, b_s, amax, amax, torch.float32)
    nan = torch.isnan(expected)
    assert nan.any() and torch.equal(torch.isnan(d), nan)  # a NaN scale poisons its row / column
    a_dq, b_dq = ref.dequantize_nvfp4(a, a_s, amax, torch.float32), ref.dequantize_nvfp4(b, b_s, amax, torch.float32)
    finite_rows, finite_cols = ~torch.isnan(a_dq).any(1), ~torch.isnan(b_dq).any(1)
    _assert_gemm_close(d[finite_rows][:, finite_cols], expected[finite_rows][:, finite_cols], a_dq[finite_rows], b_dq[finite_cols])
    (a0, a0_s), bias = _every_code(2, 0, device), torch.randn(3, device=device)
    b0, b0_s = _every_code(3, 0, device)
    assert torch.equal(fg.gemm_nvfp4(a0, b0, a0_s, b0_s, amax, amax, torch.float32, bias), bias.expand(2, 3))
    assert fg.gemm_nvfp4(a[:0], b, a_s[:0], b_s, amax, amax, torch.bfloat16).shape == (0, 8)


# -- errors and declines ---------------------------------------------------------------------------
def _raise_alike(call, *args):
    """Both backends raise the same exception type with the same message for ``args``."""
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(ref, call)(*args)
    with pytest.raises(expected.type) as actual:
        getattr(fn if call == "quantize_nvfp4" else fg, call)(*args)
    assert str(actual.value) == str(expected.value)


def test_errors_match_the_reference(device):
    x = torch.randn(32, 32, device=device)
    for args in ((x.double(), True, True, False, False, False), (torch.randn(2, 16, 16), True, True, False, False, False),
                 (x, False, False, False, False, False), (x, 1, True, False, False, False),
                 (x[:, :24], True, False, False, False, False), (x[:8], False, True, False, False, False),
                 (x, True, True, False, False, True, None), (x, True, True, False, False, False, torch.tensor([1])),
                 (x, True, True, False, False, True, torch.tensor([1.0]))):
        _raise_alike("quantize_nvfp4", *args)
    q, s, a, _, _, _ = fn.quantize_nvfp4(x, rowwise=True, columnwise=False, block_2d=False, rht=False, stochastic_rounding=False)
    for args in ((q, s.float(), a, torch.float32), (q, s[:, :1], a, torch.float32), (q, s, a.double(), torch.float32),
                 (q, s, a, torch.float8_e4m3fn)):
        _raise_alike("dequantize_nvfp4", *args)
    b, b_s, b_a, _, _, _ = fn.quantize_nvfp4(torch.randn(16, 64, device=device), rowwise=True, columnwise=False, block_2d=False, rht=False,
                                             stochastic_rounding=False)
    out = torch.empty(32, 32, device=device)
    for args in ((q, b, s, b_s, a, b_a, torch.float32), (q, q, s, s, a, a, torch.float32, None, None, True),
                 (q, q, s, s, a, a, torch.bfloat16, None, out), (q, q, s, s, a, a, torch.float32, torch.randn(3)),
                 (q, q, s, s, a, a, torch.float32, None, out[:3])):
        _raise_alike("gemm_nvfp4", *args)


def test_supports_declines_tensors_on_another_device():
    x, meta = torch.randn(32, 32), torch.device("meta")
    assert fn.SUPPORTS["quantize_nvfp4"](x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True,
                                         seed=torch.tensor([1]))
    verdict = fn.SUPPORTS["quantize_nvfp4"](x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=True,
                                            seed=torch.tensor([1], device=meta))
    assert not verdict and "seed is on meta" in verdict.reason
    q, s, a = torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), torch.ones(1)
    assert fg.SUPPORTS["dequantize_nvfp4"](q, s, a, torch.float32)
    assert not fg.SUPPORTS["dequantize_nvfp4"](q, s, a.to(meta), torch.float32)
    assert fg.SUPPORTS["gemm_nvfp4"](q, q, s, s, a, a, torch.float32)
    assert not fg.SUPPORTS["gemm_nvfp4"](q, q, s, s, a, a, torch.float32, torch.zeros(4, device=meta))


def test_dispatch_runs_flagos_and_explains_a_decline(monkeypatch, device):
    manager = flagos_and_reference(monkeypatch, device)
    x = torch.randn(32, 32, device=device)
    args = (x, True, True, False, True, True, torch.tensor([9], device=device))
    out, impl = manager.dispatcher("quantize_nvfp4").traced(*args)
    assert impl.impl_id == "flagos.triton"
    assert_outputs_identical(out, ref.quantize_nvfp4(*args))
    meta_seed = (*args[:-1], torch.tensor([9], device="meta"))
    declined = [d for d in manager.explain("quantize_nvfp4", *meta_seed) if d.impl_id == "flagos.triton"]
    assert declined[0].status == "rejected" and "seed" in declined[0].reason


def test_4over6_and_the_bound_256_are_declined_and_run_on_the_reference(monkeypatch, device):
    """The kernels do not implement 4over6: SUPPORTS declines it (and the bound 256) with the reason, a direct call
    raises NotImplementedError, and the dispatcher gives the call to the reference backend."""
    x = torch.randn(32, 32, device=device)
    verdict = fn.SUPPORTS["quantize_nvfp4"](x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False,
                                            seed=None, four_over_six="MAE", e4m3_max=256)
    assert not verdict and "four_over_six='MAE'" in verdict.reason and "reference" in verdict.reason
    with pytest.raises(NotImplementedError, match="4over6"):
        fn.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False, seed=None,
                          four_over_six="MSE")
    manager = flagos_and_reference(monkeypatch, device)
    args = (x, True, True, True, False, False, None)
    out, impl = manager.dispatcher("quantize_nvfp4").traced(*args, four_over_six="MSE", e4m3_max=256)
    assert impl.impl_id == "reference.torch"
    assert_outputs_identical(out, ref.quantize_nvfp4(*args, four_over_six="MSE", e4m3_max=256))
    q, s, a = out[:3]
    assert not fg.SUPPORTS["dequantize_nvfp4"](q, s, a, torch.float32, e4m3_max=256)
    assert "e4m3_max=256" in fg.SUPPORTS["dequantize_nvfp4"](q, s, a, torch.float32, e4m3_max=256).reason
    assert not fg.SUPPORTS["gemm_nvfp4"](q, q, s, s, a, a, torch.float32, b_e4m3_max=256)
    with pytest.raises(NotImplementedError, match="a_e4m3_max=256"):
        fg.gemm_nvfp4(q, q, s, s, a, a, torch.float32, a_e4m3_max=256)
    d, impl = manager.dispatcher("gemm_nvfp4").traced(q, q, s, s, a, a, torch.float32, a_e4m3_max=256, b_e4m3_max=256)
    assert impl.impl_id == "reference.torch"
    assert torch.equal(d, ref.gemm_nvfp4(q, q, s, s, a, a, torch.float32, a_e4m3_max=256, b_e4m3_max=256))
    assert fn.SUPPORTS["quantize_nvfp4"](x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False,
                                         seed=None)  # the defaults still run here


# -- GPU: larger shapes ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_gpu_quantize_large_bit_exact(dtype):
    x = (torch.randn(512, 1024, device="cuda") * 10.0 ** (torch.rand(512, 1, device="cuda") * 8 - 4)).to(dtype)
    x[3, 7] = NAN
    for block_2d, rht, sr in OPTIONS:
        _check_quantize(x, rowwise=True, columnwise=True, block_2d=block_2d, rht=rht, sr=sr)
    _check_quantize(x[:400], rowwise=True, columnwise=False, block_2d=False, rht=False, sr=True)


@pytest.mark.gpu
def test_gpu_gemm_large():
    a, a_s, a_amax, a_dq = _operand(384, 2048, "cuda")
    b, b_s, b_amax, b_dq = _operand(256, 2048, "cuda")
    bias = torch.randn(256, device="cuda")
    for out_dtype in (torch.float32, torch.bfloat16):
        d = fg.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, out_dtype, bias)
        _assert_gemm_close(d, ref.gemm_nvfp4(a, b, a_s, b_s, a_amax, b_amax, out_dtype, bias), a_dq, b_dq)
