"""vendor.cuda GEMM (cuBLAS / cuBLASLt through PyTorch) against the reference backend's gemm.

On CPU: registration, what the SUPPORTS predicate declines and why (pure shape / dtype logic on
"meta" tensors), and the TN-layout helpers (which operand gets a transposed copy). On a GPU: every
dtype mix, bias, transposes, out / accumulate, against the reference gemm on the same values.

Tolerances: both sides accumulate in fp32 and differ only in summation order, so the result agrees
to the output dtype's rounding (DTYPE_TOLS: a bf16 ulp is below its rtol; fp16 gets 2 ulps, see
_tols) plus, for fp32 outputs, ~sqrt(K) fp32 ulps of the terms (atol 2e-6 sqrt(K), as the
reference test). Fast FP8
accumulation (use_split_accumulator=False) keeps fewer bits: there an SQNR floor of 40 dB.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.utils import dtype_tols, randn, sqnr
from transformer_engine.plugin.backends._registration import impls_from_modules
from transformer_engine.plugin.backends.reference import gemm as reference
from transformer_engine.plugin.backends.vendor import cuda
from transformer_engine.plugin.backends.vendor.cuda import gemm as vendor_gemm
from transformer_engine.plugin.core import BackendImplKind, Capabilities, OpManager, OpRegistry

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRANSPOSES = list(itertools.product((False, True), repeat=2))


def _tols(dtype, k):
    """DTYPE_TOLS; fp32 atol grows as sqrt(K); fp16 rtol 2 ulps, as cuBLAS may round a split-K partial
    sum to fp16 (PyTorch's allow_fp16_reduced_precision_reduction is on by default)."""
    tols = dtype_tols(dtype)
    if dtype == torch.float32:
        tols["atol"] = max(tols["atol"], 2e-6 * k**0.5)
    if dtype == torch.float16:
        tols["rtol"] = 2e-3
    return tols


def _fp8_tols(dtype, expected):
    """Tolerance for an FP8 tensor-core product against the float32 reference.

    Hopper's FP8 MMA keeps only about 14 mantissa bits in its accumulator before cuBLAS promotes
    partial sums to float32 (DeepSeek-V3 report, section 3.3.2), so each output carries an error of
    a few 2^-12 of the output magnitude: atol = 2^-9 * max|expected|, plus the output dtype's rtol.
    """
    tols = dtype_tols(dtype)
    return dict(rtol=max(tols["rtol"], 2.0**-9), atol=2.0**-9 * expected.abs().max().item())


def _fp8(shape, fp8_dtype, device="cuda"):
    """(q, scale_inv): x ~ N(0, 1) cast with scale = fp8_max / amax (non-trivial scale_inv)."""
    x = randn(*shape, device=device)
    scale = torch.finfo(fp8_dtype).max / x.abs().max()
    q = (x * scale).clamp(-torch.finfo(fp8_dtype).max, torch.finfo(fp8_dtype).max).to(fp8_dtype)
    return q, (1.0 / scale).reshape(1).float()


def _shape(rows, cols, trans):
    return (cols, rows) if trans else (rows, cols)


# -- CPU: registration, predicate, layouts --------------------------------------------------------
def test_register_adds_vendor_cuda_impls():
    registry = OpRegistry()
    cuda.register(registry)
    impl = registry.get_implementation("gemm", "vendor.cuda")
    assert impl.kind is BackendImplKind.VENDOR and impl.vendor == "cuda" and impl.priority == 100
    assert impl.capabilities == Capabilities(device_types={"cuda"}) and impl.supports is not None
    # the dispatcher calls the unchecked body: it has run impl.supports itself (a direct call of gemm checks again)
    assert impl.fn is vendor_gemm.DISPATCHED["gemm"] and impl.supports is vendor_gemm.SUPPORTS["gemm"]
    assert registry.get_implementation("gemm_blockwise", "vendor.cuda").fn is vendor_gemm.DISPATCHED["gemm_blockwise"]


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


SCALES = (_meta((1,), torch.float32), _meta((1,), torch.float32))


@pytest.mark.parametrize(
    "x, y, scales, out_dtype, capability, words",
    [
        ((32, 64, E5M2), (64, 48, E5M2), SCALES, torch.bfloat16, (9, 0), "E5M2 x E5M2"),
        ((32, 64, E4M3), (64, 48, E4M3), SCALES, torch.bfloat16, (8, 6), "compute capability >= 8.9"),
        ((32, 24, E4M3), (24, 48, E4M3), SCALES, torch.bfloat16, (9, 0), "K=24"),
        ((32, 64, E4M3), (64, 40, E4M3), SCALES, torch.bfloat16, (9, 0), "N=40"),
        ((32, 64, E4M3), (64, 48, E4M3), (None, SCALES[1]), torch.bfloat16, (9, 0), "scale_inv"),
        ((32, 64, E4M3), (64, 48, E4M3), (_meta((32,), torch.float32), SCALES[1]), torch.bfloat16, (9, 0), "one-element"),
        ((32, 64, E4M3), (64, 48, E4M3), SCALES, E4M3, (9, 0), "out_dtype"),
        ((32, 64, E4M3), (64, 48, E4M3), SCALES, None, (9, 0), "out_dtype"),
        ((32, 64, E4M3), (64, 48, torch.bfloat16), SCALES, torch.bfloat16, (9, 0), "two FP8 operands"),
    ],
)
def test_fp8_reason_declines(x, y, scales, out_dtype, capability, words):
    reason = vendor_gemm._fp8_reason((x[2], y[2]), y[:2], None, scales, out_dtype, capability)
    assert reason is not None and words in reason


@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_reason_accepts(pair, capability):
    # op(a) [7, 32] @ op(b) [32, 16]: M = 7, only K and N need alignment
    assert vendor_gemm._fp8_reason(pair, (32, 16), _meta((16,), torch.float32), SCALES, torch.bfloat16, capability) is None


def test_hp_and_shape_reasons():
    bf16, x, y = (torch.bfloat16, torch.bfloat16), (5, 7), (7, 3)
    assert vendor_gemm._hp_reason(bf16, None, torch.bfloat16) is None
    assert vendor_gemm._hp_reason(bf16, _meta((3,), torch.float32), torch.float32) is None
    assert "share one dtype" in vendor_gemm._hp_reason((torch.bfloat16, torch.float16), None, torch.bfloat16)
    assert "share one dtype" in vendor_gemm._hp_reason((torch.int8, torch.int8), None, torch.int8)
    assert "inner dimensions" in vendor_gemm._shape_reason(x, (6, 3), None, None, accumulate=False)
    assert "bias" in vendor_gemm._shape_reason(x, y, _meta((4,), torch.bfloat16), None, accumulate=False)
    assert "needs out" in vendor_gemm._shape_reason(x, y, None, None, accumulate=True)
    assert "out has shape" in vendor_gemm._shape_reason(x, y, None, _meta((3, 5), torch.bfloat16), accumulate=False)


class _CudaLooking(torch.Tensor):
    """A meta tensor whose ``is_cuda`` says True: the whole predicate runs on CPU (no data is read)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = property(lambda self: True)


def _cuda_meta(shape, dtype):
    return torch.Tensor._make_subclass(_CudaLooking, _meta(shape, dtype))


def _verdict(a, b, **kwargs):
    """The predicate on ``_cuda_meta`` operands ((shape, dtype) each), FP8 scales when a is FP8, CC 9.0."""
    (a_shape, a_dtype), (b_shape, b_dtype) = a, b
    if a_dtype in (E4M3, E5M2):
        kwargs.update(a_scale_inv=SCALES[0], b_scale_inv=SCALES[1])
    return vendor_gemm._supports_gemm(_cuda_meta(a_shape, a_dtype), _cuda_meta(b_shape, b_dtype), **kwargs)


@pytest.mark.parametrize(
    "a, b, trans_a, trans_b, words",
    [
        ((32, 64), (48, 64), False, True, None),  # fprop: x [M, K], W [N, K]
        ((64, 32), (64, 48), True, False, None),  # wgrad: dy [T, M], x [T, N]
        ((64, 32), (48, 64), True, True, None),
        ((32, 64), (48, 64), False, False, "inner dimensions"),
        ((32, 64), (64, 48), True, False, "inner dimensions"),
        ((32, 64), (40, 64), False, True, "N=40"),  # N = b's rows under trans_b
        ((40, 24), (48, 40), True, True, "K=40"),  # op(a) [24, 40], op(b) [40, 48]
    ],
)
def test_supports_reads_the_shapes_of_op_a_and_op_b(a, b, trans_a, trans_b, words, monkeypatch):
    monkeypatch.setattr(vendor_gemm, "_capability_of", lambda index: (9, 0))
    verdict = _verdict((a, E4M3), (b, E4M3), trans_a=trans_a, trans_b=trans_b, out_dtype=torch.bfloat16)
    assert verdict is True if words is None else (not verdict and words in verdict.reason)


def test_supports_checks_bias_out_dims_dtypes_and_capability(monkeypatch):
    monkeypatch.setattr(vendor_gemm, "_capability_of", lambda index: (9, 0))
    x, w = ((32, 64), E4M3), ((48, 64), E4M3)
    fprop = dict(trans_b=True, out_dtype=torch.bfloat16)
    assert _verdict(x, w, bias=_meta((48,), torch.bfloat16), **fprop) is True
    assert "bias has shape (32,), expected [48]" in _verdict(x, w, bias=_meta((32,), torch.bfloat16), **fprop).reason
    assert "out has dtype" in _verdict(x, w, out=_meta((32, 48), torch.float32), **fprop).reason
    assert "out has shape (48, 32), expected [32, 48]" in _verdict(x, w, out=_meta((48, 32), torch.bfloat16), **fprop).reason
    wgrad = dict(trans_a=True, out=_meta((32, 48), torch.float32), accumulate=True, out_dtype=torch.float32)
    assert _verdict(((64, 32), E5M2), ((64, 48), E4M3), **wgrad) is True
    assert "2-D" in _verdict(((2, 32, 64), torch.bfloat16), ((64, 48), torch.bfloat16)).reason
    assert "share one dtype" in _verdict(((32, 64), torch.bfloat16), ((64, 48), torch.float16)).reason
    monkeypatch.setattr(vendor_gemm, "_capability_of", lambda index: (8, 0))
    assert "compute capability" in _verdict(x, w, **fprop).reason
    assert _verdict(((32, 64), torch.bfloat16), ((48, 64), torch.bfloat16), trans_b=True) is True


def test_supports_declines_cpu_tensors():
    verdict = vendor_gemm.SUPPORTS["gemm"](randn(4, 4), randn(4, 4))
    assert not verdict and "CUDA" in verdict.reason
    with pytest.raises(NotImplementedError, match="CUDA"):
        vendor_gemm.gemm(randn(4, 4), randn(4, 4))


@pytest.mark.parametrize("trans_a, trans_b", TRANSPOSES)
def test_tn_layout_copies_only_what_is_not_in_place(trans_a, trans_b):
    """op(a) must be row-major, op(b) column-major: a copy exactly when trans_a / not trans_b."""
    a = torch.zeros(_shape(48, 32, trans_a), dtype=torch.uint8)
    b = torch.zeros(_shape(32, 64, trans_b), dtype=torch.uint8)
    x, y = vendor_gemm._operands(a, b, trans_a, trans_b)
    mat1, mat2 = vendor_gemm._as_row_major(x), vendor_gemm._as_col_major(y)
    assert (mat1.data_ptr() == a.data_ptr()) == (not trans_a)
    assert (mat2.data_ptr() == b.data_ptr()) == trans_b
    assert mat1.stride(1) == 1 and mat2.stride(0) == 1 and torch.equal(mat1, x) and torch.equal(mat2, y)


def test_tn_layout_copies_misaligned_leading_dimension():
    a = torch.zeros(48, 40, dtype=torch.uint8)[:, :32]  # row-major but ld 40 is not a multiple of 16
    assert vendor_gemm._as_row_major(a).stride() == (32, 1)
    assert vendor_gemm._as_row_major(torch.zeros(48, 48, dtype=torch.uint8)[:, :32]).stride() == (48, 1)


# -- GPU: numerics against the reference ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("trans_a, trans_b", TRANSPOSES)
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 7, 3), (17, 31, 29), (128, 96, 80)])
def test_high_precision_matches_reference(m, k, n, dtype, bias_dtype, trans_a, trans_b):
    a = randn(*_shape(m, k, trans_a), dtype=dtype, device="cuda")
    b = randn(*_shape(k, n, trans_b), dtype=dtype, device="cuda")
    bias = None if bias_dtype is None else randn(n, dtype=dtype if bias_dtype == "same" else bias_dtype, device="cuda")
    d = vendor_gemm.gemm(a, b, bias=bias, trans_a=trans_a, trans_b=trans_b)
    expected = reference.gemm(a, b, bias=bias, trans_a=trans_a, trans_b=trans_b)
    assert d.dtype == dtype and d.shape == (m, n)
    torch.testing.assert_close(d.float(), expected.float(), **_tols(dtype, k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype",
                         [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_high_precision_out_dtype(dtype, out_dtype):
    """wgrad into fp32 (cuBLAS writes fp32 from bf16 inputs, no bf16 rounding first)."""
    a, b, bias = randn(64, 33, dtype=dtype, device="cuda"), randn(64, 48, dtype=dtype, device="cuda"), randn(48, device="cuda")
    d = vendor_gemm.gemm(a, b, bias=bias, trans_a=True, out_dtype=out_dtype)
    expected = reference.gemm(a, b, bias=bias, trans_a=True, out_dtype=out_dtype)
    assert d.dtype == out_dtype
    torch.testing.assert_close(d, expected, **_tols(out_dtype, 64))


FP8_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a, trans_b", TRANSPOSES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("pair", FP8_PAIRS)
def test_fp8_matches_reference(pair, out_dtype, trans_a, trans_b):
    m, k, n = 40, 64, 48
    a, a_scale_inv = _fp8(_shape(m, k, trans_a), pair[0])
    b, b_scale_inv = _fp8(_shape(k, n, trans_b), pair[1])
    args = dict(a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype)
    d = vendor_gemm.gemm(a, b, **args)
    expected = reference.gemm(a, b, **args)
    assert d.dtype == out_dtype and d.shape == (m, n)
    torch.testing.assert_close(d, expected, **_fp8_tols(out_dtype, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype, out_dtype",
                         [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                          (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_fp8_bias(bias_dtype, out_dtype):
    """Epilogue bias (bias dtype == out dtype) and the fp32 tail for the rest."""
    a, a_scale_inv = _fp8((33, 32), E4M3)
    b, b_scale_inv = _fp8((16, 32), E4M3)
    bias = randn(16, dtype=bias_dtype, device="cuda")
    args = dict(bias=bias, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, trans_b=True, out_dtype=out_dtype)
    expected = reference.gemm(a, b, **args)
    torch.testing.assert_close(vendor_gemm.gemm(a, b, **args), expected, **_fp8_tols(out_dtype, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_accumulate_and_out(fp8, out_dtype):
    """wgrad-style dW += dy^T x into ``out`` (fp32 main_grad or bf16), and plain ``out=``."""
    if fp8:
        (dy, dy_si), (x, x_si) = _fp8((64, 48), E5M2), _fp8((64, 32), E4M3)
    else:
        (dy, dy_si), (x, x_si) = (randn(64, 48, dtype=torch.bfloat16, device="cuda"),
                                  None), (randn(64, 32, dtype=torch.bfloat16, device="cuda"), None)
    args = dict(a_scale_inv=dy_si, b_scale_inv=x_si, trans_a=True, out_dtype=out_dtype)
    start = randn(48, 32, dtype=out_dtype, device="cuda")
    out, expected = start.clone(), start.clone()
    result = vendor_gemm.gemm(dy, x, out=out, accumulate=True, **args)
    reference.gemm(dy, x, out=expected, accumulate=True, **args)
    assert result is out
    tols = (lambda ref: _fp8_tols(out_dtype, ref)) if fp8 else (lambda ref: _tols(out_dtype, 64))
    torch.testing.assert_close(out, expected, **tols(expected))
    fresh = torch.empty_like(start)
    assert vendor_gemm.gemm(dy, x, out=fresh, **args) is fresh
    product = reference.gemm(dy, x, **args)
    torch.testing.assert_close(fresh, product, **tols(product))


@pytest.mark.gpu
def test_fp8_fast_accumulation():
    a, a_scale_inv = _fp8((256, 1024), E4M3)
    b, b_scale_inv = _fp8((128, 1024), E4M3)
    args = dict(a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, trans_b=True, out_dtype=torch.float32)
    fast = vendor_gemm.gemm(a, b, use_split_accumulator=False, **args)
    assert sqnr(reference.gemm(a, b, **args), fast) >= 40.0


@pytest.mark.gpu
def test_dispatch_declines_e5m2_pair_to_reference():
    registry = OpRegistry()
    cuda.register(registry)
    registry.register_many(impls_from_modules([reference], "reference.torch", BackendImplKind.REFERENCE, Capabilities()))
    manager = OpManager(registry, load_builtins=False, discover=False)
    (a, a_si), (b, b_si) = _fp8((32, 32), E5M2), _fp8((32, 32), E5M2)
    args = (a, b, None, a_si, b_si, False, True, torch.bfloat16)
    assert manager.select("gemm", *args).impl_id == "reference.torch"
    (a, a_si) = _fp8((32, 32), E4M3)
    assert manager.select("gemm", a, b, None, a_si, b_si, trans_a=False, trans_b=True, out_dtype=torch.bfloat16).impl_id == "vendor.cuda"


# -- block-scaled FP8 (Float8BlockScaling) -----------------------------------------------------
def _block_fp8(rows, cols, block, column_major_scales):
    """(q, scale_inv) from the reference block cast on the GPU, scales in either layout."""
    from transformer_engine.plugin.backends.reference.quantization import quantize_blockwise

    q, scale_inv = quantize_blockwise(randn(rows, cols, device="cuda"), E4M3, block[0], block[1], power_2_scale=True, amax_epsilon=0.0)
    return q, (scale_inv.t().contiguous().t() if column_major_scales else scale_inv.contiguous())


BLOCK_PAIRS = [((1, 128), (128, 128)), ((128, 128), (1, 128)), ((1, 128), (1, 128))]


def test_blockwise_declines_cpu_tensors():
    a = torch.zeros(128, 128).to(E4M3)
    verdict = vendor_gemm.SUPPORTS["gemm_blockwise"](a, a, torch.ones(128, 1), torch.ones(128, 1), (1, 128), (1, 128), torch.bfloat16)
    assert not verdict and "CUDA" in verdict.reason


@pytest.mark.gpu
@pytest.mark.parametrize("column_major_scales", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("a_block, b_block", BLOCK_PAIRS)
def test_blockwise_matches_reference(a_block, b_block, out_dtype, column_major_scales):
    m, n, k = 256, 384, 1024 if (128, 128) in (a_block, b_block) else 640
    (a, sa), (b, sb) = _block_fp8(m, k, a_block, column_major_scales), _block_fp8(n, k, b_block, column_major_scales)
    d = vendor_gemm.gemm_blockwise(a, b, sa, sb, a_block, b_block, out_dtype)
    expected = reference.gemm_blockwise(a, b, sa, sb, a_block, b_block, out_dtype)
    assert d.dtype == out_dtype and d.shape == (m, n)
    torch.testing.assert_close(d, expected, **_fp8_tols(out_dtype, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_blockwise_bias_and_accumulate(bias_dtype, out_dtype):
    (a, sa), (b, sb) = _block_fp8(128, 512, (1, 128), column_major_scales=True), _block_fp8(256, 512, (128, 128), column_major_scales=False)
    bias = randn(256, dtype=bias_dtype, device="cuda")
    args = (a, b, sa, sb, (1, 128), (128, 128), out_dtype)
    expected = reference.gemm_blockwise(*args, bias=bias)
    torch.testing.assert_close(vendor_gemm.gemm_blockwise(*args, bias=bias), expected, **_fp8_tols(out_dtype, expected))
    out, ref_out = (randn(128, 256, device="cuda") for _ in range(2))
    ref_out.copy_(out)
    fp32_args = args[:-1] + (torch.float32,)
    assert vendor_gemm.gemm_blockwise(*fp32_args, out=out, accumulate=True) is out
    reference.gemm_blockwise(*fp32_args, out=ref_out, accumulate=True)
    torch.testing.assert_close(out, ref_out, **_fp8_tols(torch.float32, ref_out))


@pytest.mark.gpu
def test_blockwise_declines_what_cublaslt_cannot_do():
    supports = vendor_gemm.SUPPORTS["gemm_blockwise"]
    (a, sa), (b, sb) = _block_fp8(128, 512, (1, 128), column_major_scales=True), _block_fp8(256, 512, (128, 128), column_major_scales=False)
    assert supports(a, b, sa, sb, (1, 128), (128, 128), torch.bfloat16) is True
    (c, sc), (d, sd) = _block_fp8(128, 640, (1, 128), column_major_scales=True), _block_fp8(256, 640, (128, 128), column_major_scales=False)
    assert "multiple of 512" in supports(c, d, sc, sd, (1, 128), (128, 128), torch.bfloat16).reason
    assert "E4M3 operands only" in supports(a.view(E5M2), b, sa, sb, (1, 128), (128, 128), torch.bfloat16).reason
    assert "at most one 2-D" in supports(a, b, sb[:1], sb, (128, 128), (128, 128), torch.bfloat16).reason
    (c, sc), (d, sd) = _block_fp8(128, 320, (1, 128), column_major_scales=True), _block_fp8(256, 320, (1, 128), column_major_scales=True)
    assert "multiple of 128" in supports(c, d, sc, sd, (1, 128), (1, 128), torch.bfloat16).reason
    assert "a_scale_inv must be float32 [128, 4]" in supports(a, b, sa[:, :1], sb, (1, 128), (128, 128), torch.bfloat16).reason


@pytest.mark.gpu
def test_blockwise_default_dispatch_is_cublaslt():
    from transformer_engine.plugin import ops

    (a, sa), (b, sb) = _block_fp8(128, 512, (1, 128), column_major_scales=True), _block_fp8(256, 512, (128, 128), column_major_scales=False)
    _, impl = ops.gemm_blockwise.traced(a, b, sa, sb, (1, 128), (128, 128), torch.bfloat16)
    assert impl.impl_id == "vendor.cuda"
