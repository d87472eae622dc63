"""flagos MXFP8 kernels vs the reference backend: quantize and dequantize bit for bit, the emulated GEMM
within float32 accumulation error.

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py), at small shapes that
still cover several programs and ragged edges (a cast program takes 32 rows x 128 columns, a decode program
32 x 256), both FP8 formats, both copies and each alone, the three input dtypes, and the values that take
special paths: zero blocks, NaN, +-inf, -0, float32 / bfloat16 / float16 subnormals, the extremes of float32,
block maxima on the E8M0 rounding boundaries, every FP8 code under every E8M0 code.
"""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import FP8_DTYPES, HP_DTYPES, assert_outputs_identical, assert_same_bits, flagos_and_reference
from transformer_engine.plugin.backends.flagos import mxfp8 as fm
from transformer_engine.plugin.backends.reference import mxfp8 as ref

NAN, INF = float("nan"), float("inf")
E4M3, E5M2 = FP8_DTYPES
FP8_IDS = ["e4m3", "e5m2"]
FP32 = torch.finfo(torch.float32)


def _wide_range(shape, dtype, device):
    """Random signs, magnitudes 1e-8 .. 1e8 (float16: 1e-4 .. 1e4, past its range both ways), a zero 32 x 32
    block and a -0."""
    low, high = (-4, 4) if dtype is torch.float16 else (-8, 8)
    x = torch.randn(shape).sign() * 10.0 ** (torch.rand(shape) * (high - low) + low)
    x[:32, :32] = 0.0
    x[0, 1] = -0.0
    return x.to(dtype).to(device)


def _check_quantize(x, fp8_dtype, rowwise=True, columnwise=True):
    args = (x, fp8_dtype, rowwise, columnwise)
    assert_outputs_identical(fm.quantize_mxfp8(*args), ref.quantize_mxfp8(*args))


# -- quantize --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_quantize_both_copies_bit_exact(dtype, fp8_dtype, device):
    # 96 x 160: 3 x 2 programs, the columns ragged; 16 decades of magnitudes: scales from tiny to saturating
    _check_quantize(_wide_range((96, 160), dtype, device), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_quantize_one_copy_bit_exact(fp8_dtype, device):
    # each copy alone leaves the other dim free: 37 (prime, below one tile) and 131 (past one)
    for other in (37, 131):
        _check_quantize(_wide_range((other, 96), torch.bfloat16, device), fp8_dtype, rowwise=True, columnwise=False)
        _check_quantize(_wide_range((96, other), torch.float32, device), fp8_dtype, rowwise=False, columnwise=True)


def _special_values(dtype):
    """[64, 96]: +-NaN (ignored by the amax), +-inf (scale 254, the block's finite values flushed), float32 max
    and tiny, subnormals of x's dtype, block maxima at fp8_max * 2^k and just above (E8M0 rounding boundaries)."""
    x = torch.randn(64, 96) * 3
    x[0, 5], x[1, 7], x[2, 33], x[40, 70], x[41, 3] = NAN, INF, -INF, NAN, -NAN  # -NaN: torch's cast keeps its sign
    x[3, :32] = FP32.max if dtype is torch.float32 else torch.finfo(dtype).max
    x[4, :32] = torch.finfo(dtype).tiny * torch.linspace(-1.0, 1.0, 32)  # subnormals of x's dtype, the block's amax tiny
    x[5, :32] = torch.finfo(dtype).tiny * 0.75  # one subnormal binade below the smallest normal
    for j, k in enumerate((-20, -3, 0, 5)):
        x[6 + j, 32:64] = torch.linspace(-1.0, 1.0, 32) * 2.0**k
        x[6 + j, 32], x[6 + j, 64] = 448.0 * 2.0**k, 57344.0 * 2.0**k * (1 + 2.0**-7)
    x[10:12, 64:] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_special_values(dtype, fp8_dtype, device):
    x = _special_values(dtype).to(device)
    _check_quantize(x, fp8_dtype)
    _check_quantize(x.t().contiguous(), fp8_dtype)  # each special in the other copy's blocks


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_every_e8m0_code(fp8_dtype, device):
    """Block maxima 2^e for every e from -149 to 127: every scale code finite float32 reaches (0 .. 246 for E4M3,
    0 .. 239 for E5M2; 254 comes from inf, in test_special_values)."""
    e = torch.arange(-149, 128, dtype=torch.float64)
    amax = torch.exp2(e).float()
    x = (torch.rand(e.numel(), 32) * amax[:, None]).float()
    x[:, 7] = amax
    _check_quantize(x.to(device), fp8_dtype, rowwise=True, columnwise=False)  # one block per row: 277 rows, 9 programs of 32
    _check_quantize(x.t().contiguous().to(device), fp8_dtype, rowwise=False, columnwise=True)  # one block per column


def test_zeros_empty_and_strided_inputs(device):
    _check_quantize(torch.zeros(64, 96, device=device), E4M3)
    _check_quantize(torch.zeros(0, 32, device=device), E4M3)
    _check_quantize(torch.zeros(32, 0, device=device), E4M3)
    wide = _wide_range((64, 200), torch.bfloat16, device)
    _check_quantize(wide[:, 3:163], E5M2)  # strided rows
    _check_quantize(wide[:, :32].t(), E4M3)  # a transposed view (copied)


# -- dequantize ------------------------------------------------------------------------------------
def _every_code(rows, k, fp8_dtype, device):
    """[rows, k] FP8 with every code, and E8M0 scales with every code (255: NaN) in a scrambled order."""
    q = torch.arange(rows * k).remainder(256).to(torch.uint8).reshape(rows, k).view(fp8_dtype)
    scale = (torch.randperm(rows * k // 32) * 37).remainder(256).to(torch.uint8).reshape(rows, k // 32)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_dequantize_every_code_bit_exact(fp8_dtype, device):
    q, scale = _every_code(64, 320, fp8_dtype, device)  # 640 blocks: every scale code with many FP8 codes
    for out_dtype in HP_DTYPES:
        assert_same_bits(fm.dequantize_mxfp8(q, scale, out_dtype), ref.dequantize_mxfp8(q, scale, out_dtype))
    args = (q[1:40, 32:96], scale[1:40, 1:3], torch.bfloat16)  # row-strided views
    assert_same_bits(fm.dequantize_mxfp8(*args), ref.dequantize_mxfp8(*args))


@pytest.mark.parametrize("fp8_dtype, exact_from", [(E4M3, 3), (E5M2, 10)], ids=FP8_IDS)
def test_gemm_operands_are_exact_in_bfloat16_from_the_documented_scale(fp8_dtype, exact_from, device):
    """The GEMM's bfloat16 decode equals the reference's float32 dequantize for every code once s >= 3 (E4M3) /
    10 (E5M2); below, bfloat16's subnormal step 2^-133 rounds V by at most 2^-134 (module docstring)."""
    q = torch.arange(256).remainder(256).to(torch.uint8).view(fp8_dtype).reshape(8, 32).to(device)
    for s in range(0, 255):
        scale = torch.full((8, 1), s, dtype=torch.uint8, device=device)
        v = fm._decode_mxfp8(q, scale, torch.bfloat16).double().cpu()
        expected = ref.dequantize_mxfp8(q, scale, torch.float32).double().cpu()
        finite = torch.isfinite(expected)
        assert torch.equal(v[~finite].isnan(), expected[~finite].isnan())
        error = (v - expected).abs()[finite]
        if s >= exact_from:
            assert bool((error == 0).all()), f"s = {s}: {int((error != 0).sum())} values differ"
        else:
            assert bool((error <= 2.0**-134).all()) and bool((error > 0).any()), f"s = {s}"  # the bound is tight


# -- GEMM ------------------------------------------------------------------------------------------
def _operand(rows, k, fp8_dtype, device):
    """(data, scale, float32 values of the quantized operand) of a random [rows, k] bfloat16 tensor, each row
    on its own scale (1e-2 .. 1e2)."""
    x = (torch.randn(rows, k) * 10.0 ** (torch.rand(rows, 1) * 4 - 2)).bfloat16().to(device)
    data, scale, _, _ = fm.quantize_mxfp8(x, fp8_dtype, rowwise=True, columnwise=False)
    return data, scale, ref.dequantize_mxfp8(data, scale, torch.float32)


def _assert_gemm_close(d, expected, a_dq, b_dq):
    """|d - expected| <= (2 K + 2) 2^-24 (|A| @ |B|^T) + 2^-23 |expected| + K 2^-149, plus one ulp of a 16-bit d.

    Both sides sum the same K exact products in float32 (the bfloat16 operands are the reference's float32 ones),
    each within gamma_K = K 2^-24 / (1 - K 2^-24) sum |a b| of the exact sum (the standard bound; the product
    roundings are in it), so the two differ by 2 gamma_K, under (2 K + 2) 2^-24 for K < 2^22. Products below
    float32's normal range add up to 2^-149 each (K 2^-149). The bias / out additions are the same float32
    operations on values this close (2^-23 |D|); a bfloat16 / float16 result may then round to the
    neighbouring value (eps relative, eps * tiny among the subnormals).
    """
    k = a_dq.shape[1]
    assert d.dtype == expected.dtype and d.shape == expected.shape
    out = torch.finfo(d.dtype)
    d, expected = d.double().cpu(), expected.double().cpu()
    magnitude = a_dq.abs().double().cpu() @ b_dq.abs().double().cpu().t()
    bound = (2 * k + 2) * 2.0**-24 * magnitude + 2.0**-23 * expected.abs() + k * 2.0**-149
    if out.bits == 16:
        bound = bound + out.eps * (expected.abs() + out.tiny)
    finite = torch.isfinite(expected)
    assert torch.equal(d[~finite], expected[~finite])
    error = (d - expected).abs()[finite]
    assert bool((error <= bound[finite]).all()), f"max error {error.max()}"


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_gemm_within_float32_accumulation_error(out_dtype, device):
    a, a_s, a_dq = _operand(40, 96, E4M3, device)
    b, b_s, b_dq = _operand(24, 96, E5M2, device)  # HYBRID's dgrad / wgrad: E5M2 gradients against E4M3
    bias = torch.randn(24, device=device)
    for extra in ((), (bias,), (bias.bfloat16(),)):
        d = fm.gemm_mxfp8(a, b, a_s, b_s, out_dtype, *extra)
        _assert_gemm_close(d, ref.gemm_mxfp8(a, b, a_s, b_s, out_dtype, *extra), a_dq, b_dq)


def test_gemm_accumulates_into_strided_out(device):
    # wgrad: dW^T [48, 32] accumulated into a transposed view, as a main_grad would be
    a, a_s, a_dq = _operand(48, 64, E4M3, device)
    b, b_s, b_dq = _operand(32, 64, E4M3, device)
    out = torch.randn(32, 48, device=device).t()
    expected = ref.gemm_mxfp8(a, b, a_s, b_s, torch.float32, None, out.clone(), accumulate=True)
    d = fm.gemm_mxfp8(a, b, a_s, b_s, torch.float32, None, out, accumulate=True)
    assert d is out
    _assert_gemm_close(d, expected, a_dq, b_dq)
    out16, bias = torch.randn(48, 32, device=device, dtype=torch.bfloat16), torch.randn(32, device=device)
    expected = ref.gemm_mxfp8(a, b, a_s, b_s, None, bias, out16.clone(), accumulate=True)  # out_dtype None: out's dtype
    _assert_gemm_close(fm.gemm_mxfp8(a, b, a_s, b_s, None, bias, out16, accumulate=True), expected, a_dq, b_dq)


def test_gemm_nan_scales_non_finite_and_empty_dims(device):
    (a, a_s), (b, b_s) = _every_code(16, 64, E4M3, device), _every_code(8, 64, E4M3, device)
    d = fm.gemm_mxfp8(a, b, a_s, b_s, torch.float32)
    expected = ref.gemm_mxfp8(a, b, a_s, b_s, torch.float32)
    nan = torch.isnan(expected)
    assert nan.any() and torch.equal(torch.isnan(d), nan)  # NaN codes and scale 255 poison their row / column
    a_dq, b_dq = ref.dequantize_mxfp8(a, a_s, torch.float32), ref.dequantize_mxfp8(b, b_s, torch.float32)
    finite_rows, finite_cols = torch.isfinite(a_dq).all(1), torch.isfinite(b_dq).all(1)
    _assert_gemm_close(d[finite_rows][:, finite_cols], expected[finite_rows][:, finite_cols], a_dq[finite_rows], b_dq[finite_cols])
    bias = torch.randn(3, device=device)
    a0, a0_s = _every_code(2, 0, E4M3, device)
    b0, b0_s = _every_code(3, 0, E4M3, device)
    assert torch.equal(fm.gemm_mxfp8(a0, b0, a0_s, b0_s, torch.float32, bias), bias.expand(2, 3))
    assert fm.gemm_mxfp8(a[:0], b, a_s[:0], b_s, torch.bfloat16).shape == (0, 8)


# -- errors and declines ---------------------------------------------------------------------------
def _raise_alike(call, *args):
    """Both backends raise the same exception type with the same message for ``args``."""
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(ref, call)(*args)
    with pytest.raises(expected.type) as actual:
        getattr(fm, call)(*args)
    assert str(actual.value) == str(expected.value)


def test_errors_match_the_reference(device):
    x = torch.randn(32, 64, device=device)
    for args in ((x.int(), E4M3, True, True), (torch.randn(2, 32, 32), E4M3, True, False), (x, torch.bfloat16, True, False),
                 (x, E4M3, False, False), (x, E4M3, 1, True), (x[:, :48], E4M3, True, False), (x[:16], E4M3, True, True)):
        _raise_alike("quantize_mxfp8", *args)
    q, s, _, _ = fm.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    for args in ((q, s.float(), torch.float32), (q, s[:, :1], torch.float32), (q.float(), s, torch.float32),
                 (q, s, torch.float8_e4m3fn), (q[0], s, torch.float32)):
        _raise_alike("dequantize_mxfp8", *args)
    b, b_s, _, _ = fm.quantize_mxfp8(torch.randn(16, 32, device=device), E4M3, rowwise=True, columnwise=False)
    out = torch.empty(32, 32, device=device)
    for args in ((q, b, s, b_s, torch.float32), (q, q, s, s, torch.float32, None, None, True),
                 (q, q, s, s, torch.bfloat16, None, out), (q, q, s, s, torch.float32, torch.randn(3)),
                 (q, q, s, s, torch.float32, None, out[:3]), (q, q, s, s, torch.int32)):
        _raise_alike("gemm_mxfp8", *args)


def test_supports_declines_tensors_on_another_device():
    q, s, meta = torch.zeros(4, 32).to(E4M3), torch.zeros(4, 1, dtype=torch.uint8), torch.device("meta")
    assert fm.SUPPORTS["dequantize_mxfp8"](q, s, torch.float32)
    verdict = fm.SUPPORTS["dequantize_mxfp8"](q, s.to(meta), torch.float32)
    assert not verdict and "scale_e8m0 is on meta" in verdict.reason
    assert fm.SUPPORTS["gemm_mxfp8"](q, q, s, s, torch.float32)
    assert not fm.SUPPORTS["gemm_mxfp8"](q, q, s, s, torch.float32, torch.zeros(4, device=meta))


def test_dispatch_runs_flagos_and_explains_a_decline(monkeypatch, device):
    manager = flagos_and_reference(monkeypatch, device)
    x = torch.randn(64, 32, device=device)
    out, impl = manager.dispatcher("quantize_mxfp8").traced(x, E4M3, rowwise=True, columnwise=True)
    assert impl.impl_id == "flagos.triton"
    assert_outputs_identical(out, ref.quantize_mxfp8(x, E4M3, rowwise=True, columnwise=True))
    declined = [d for d in manager.explain("dequantize_mxfp8", out[0], out[1].to("meta"), torch.float32) if d.impl_id == "flagos.triton"]
    assert declined[0].status == "rejected" and "scale_e8m0" in declined[0].reason


# -- GPU: larger shapes ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_gpu_quantize_large_bit_exact(dtype):
    x = (torch.randn(1024, 2048, device="cuda") * 10.0 ** (torch.rand(1024, 1, device="cuda") * 8 - 4)).to(dtype)
    x[3, 7], x[100, 1000], x[200, 33] = NAN, INF, -NAN
    for fp8_dtype in FP8_DTYPES:
        _check_quantize(x, fp8_dtype)
        _check_quantize(x[:1000, :2016], fp8_dtype, rowwise=True, columnwise=False)  # ragged rows, strided
        _check_quantize(x[:, :2000], fp8_dtype, rowwise=False, columnwise=True)  # the column-wise copy alone (a weight's W^T), N not % 32
        q, s, _, _ = fm.quantize_mxfp8(x, fp8_dtype, rowwise=True, columnwise=False)
        assert_same_bits(fm.dequantize_mxfp8(q, s, dtype), ref.dequantize_mxfp8(q, s, dtype))


@pytest.mark.gpu
def test_gpu_gemm_large():
    a, a_s, a_dq = _operand(384, 2048, E4M3, "cuda")
    b, b_s, b_dq = _operand(256, 2048, E5M2, "cuda")
    bias = torch.randn(256, device="cuda")
    for out_dtype in (torch.float32, torch.bfloat16):  # cuBLAS's own epilogue where it can (no bias, a bf16 one)
        for extra in ((), (bias,), (bias.bfloat16(),)):
            d = fm.gemm_mxfp8(a, b, a_s, b_s, out_dtype, *extra)
            _assert_gemm_close(d, ref.gemm_mxfp8(a, b, a_s, b_s, out_dtype, *extra), a_dq, b_dq)
    out = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16).t()  # a transposed view written in place
    assert fm.gemm_mxfp8(a, b, a_s, b_s, None, bias.bfloat16(), out) is out
    _assert_gemm_close(out, ref.gemm_mxfp8(a, b, a_s, b_s, torch.bfloat16, bias.bfloat16()), a_dq, b_dq)
