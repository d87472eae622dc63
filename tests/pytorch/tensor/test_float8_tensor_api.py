"""The public Float8Tensor API (transformer_engine.pytorch.tensor): construction, casts, dispatch, state."""

import io
import math

import pytest
import torch

from tests.utils import dtype_tols
from transformer_engine.pytorch.tensor import (
    DType,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    QuantizedTensor,
)

FP8 = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}
FP8_MAX = {DType.kFloat8E4M3: 448.0, DType.kFloat8E5M2: 57344.0}
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(), (1,), (311,), (7, 11), (7, 5, 3), (2, 3, 5, 3)]


def _delayed(fp8_dtype=DType.kFloat8E4M3, scale=3.5, **usage):
    return Float8Quantizer(torch.full([1], scale), torch.zeros(1), fp8_dtype, **usage)


def _uniform(shape, dtype=torch.float32):
    """Values in [-1, 1): scaled by 3.5 they stay well inside the E4M3 range."""
    return (2 * torch.rand(shape) - 1).to(dtype)


def _tols(fp8_dtype):
    return dtype_tols(FP8[fp8_dtype])


# ---- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", list(FP8))
def test_constructor_from_uint8_bytes_reinterprets_them(fp8_dtype):
    values = torch.tensor([1.0, -2.0, 0.5])
    data = values.to(FP8[fp8_dtype]).view(torch.uint8)
    x = Float8Tensor(shape=[3], dtype=torch.bfloat16, data=data, fp8_scale_inv=torch.full([1], 0.375),
                     fp8_dtype=fp8_dtype)
    assert isinstance(x, Float8Tensor) and isinstance(x, QuantizedTensor) and isinstance(x, torch.Tensor)
    assert x.shape == (3,) and x.dtype == torch.bfloat16 and x.device.type == "cpu"
    assert x._data.dtype == torch.uint8 and x._fp8_dtype == fp8_dtype and x._quantizer is None  # TE's storage: the bytes
    assert torch.equal(x._data.view(torch.uint8), data)
    torch.testing.assert_close(x.dequantize(dtype=torch.float32), values * 0.375, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(data=None), ValueError, "needs data, data_transpose or both"),
    (dict(data=torch.zeros(4, dtype=torch.uint8)), ValueError, r"data has shape \(4,\).*\(2, 3\)"),
    (dict(data=torch.zeros(2, 3, dtype=torch.float8_e5m2)), TypeError, "needs uint8 or torch.float8_e4m3fn"),
    (dict(data_transpose=torch.zeros(2, 3, dtype=torch.uint8)), ValueError, r"needs \(3, 2\)"),
    (dict(fp8_scale_inv=torch.ones(2)), ValueError, "one-element float32"),
    (dict(fp8_dtype=DType.kBFloat16), ValueError, "not a per-tensor FP8 format"),
])
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    args = dict(shape=(2, 3), dtype=torch.float32, data=torch.zeros(2, 3, dtype=torch.uint8),
                fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(error, match=match):
        Float8Tensor(**{**args, **kwargs})


def test_quantizer_arguments_are_checked():
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        Float8Quantizer(torch.ones(2), torch.zeros(1), DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="not a per-tensor FP8 format"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat32)
    with pytest.raises(ValueError, match=r"amax_epsilon=-1.0 must be a finite float >= 0"):
        Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 tensor, got torch.int64"):
        _delayed()(torch.arange(3))
    quantizer = _delayed()
    quantizer.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="rowwise=False and columnwise=False"):
        quantizer(torch.ones(2))


def test_dtype_enum_values_and_mapping():
    assert (int(DType.kFloat32), int(DType.kBFloat16), int(DType.kFloat8E4M3), int(DType.kFloat8E5M2)) == (4, 6, 7, 8)
    assert DType.cast(torch.float8_e4m3fn) is DType.kFloat8E4M3 and DType.cast(8) is DType.kFloat8E5M2
    with pytest.raises(ValueError, match="has no TE DType"):
        DType.cast(torch.float64)


# ---- quantize / dequantize -----------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", list(FP8))
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_round_trip_within_fp8_tolerance(fp8_dtype, dtype, shape, current):
    x = _uniform(shape, dtype)
    quantizer = Float8CurrentScalingQuantizer(fp8_dtype, "cpu") if current else _delayed(fp8_dtype)
    x_fp8 = quantizer(x)
    y = x_fp8.dequantize()
    assert isinstance(x_fp8, Float8Tensor) and x_fp8.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, x, **_tols(fp8_dtype))
    if x.abs().max() > 0.2:  # guards against a trivial pass (a sign flip is caught)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(y, -x, **_tols(fp8_dtype))


def test_delayed_scaling_uses_the_given_scale_and_accumulates_amax():
    quantizer = _delayed(scale=2.0)
    x = torch.tensor([0.3, -1.5, 0.7])
    x_fp8 = quantizer(x)
    assert torch.equal(x_fp8._data, (x * 2.0).to(torch.float8_e4m3fn).view(torch.uint8))
    assert x_fp8._scale_inv.item() == 0.5 and quantizer.amax.item() == 1.5
    quantizer(torch.tensor([0.25]))
    assert quantizer.amax.item() == 1.5  # amax = max(amax, max|x|)


@pytest.mark.parametrize("fp8_dtype", list(FP8))
@pytest.mark.parametrize("force_pow_2_scales", [False, True])
@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-6, 10.0])
def test_current_scaling_scale_rule(fp8_dtype, force_pow_2_scales, amax_epsilon):
    x = _uniform((7, 11)) * 3
    x_fp8 = Float8CurrentScalingQuantizer(fp8_dtype, "cpu", force_pow_2_scales=force_pow_2_scales,
                                          amax_epsilon=amax_epsilon)(x)
    amax = max(x.abs().max().item(), amax_epsilon)
    scale = torch.tensor(FP8_MAX[fp8_dtype]) / torch.tensor(amax)  # float32 division, as the op
    if force_pow_2_scales:
        scale = torch.tensor(2.0 ** math.floor(math.log2(scale.item())))
    assert x_fp8._scale_inv.item() == torch.reciprocal(scale).item()
    assert torch.equal(x_fp8._data, (x * scale).clamp(-FP8_MAX[fp8_dtype], FP8_MAX[fp8_dtype]).to(FP8[fp8_dtype]).view(torch.uint8))


def test_current_scaling_all_zero_tensor_uses_scale_one():
    x_fp8 = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(torch.zeros(4))
    assert x_fp8._scale_inv.item() == 1.0 and torch.equal(x_fp8.dequantize(), torch.zeros(4))


# ---- usages and transposed data ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (6, 4), (2, 3, 4)])
def test_columnwise_data_is_the_transpose(shape):
    x = _uniform(shape)
    x_fp8 = _delayed()(x)
    assert x_fp8.get_usages() == {"rowwise": True, "columnwise": True}
    lead_first = x_fp8._data if len(shape) == 0 else x_fp8._data.movedim(-1, 0)
    assert torch.equal(x_fp8._transpose.view(torch.uint8), lead_first.view(torch.uint8))
    x_fp8.update_usage(rowwise_usage=False)
    assert x_fp8._data is None and x_fp8.shape == shape
    torch.testing.assert_close(x_fp8.dequantize(), x, **_tols(DType.kFloat8E4M3))
    with pytest.raises(RuntimeError, match="only holds its transposed data"):
        x_fp8.update_usage(rowwise_usage=True)


def test_set_usage_controls_what_the_quantizer_makes():
    quantizer = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    quantizer.set_usage(rowwise=True, columnwise=False)
    x = _uniform((8, 3))
    row = quantizer(x)
    assert row._transpose is None and quantizer.get_usages() == {"rowwise": True, "columnwise": False}
    row.update_usage(columnwise_usage=True)
    quantizer.set_usage(rowwise=False, columnwise=True)
    col = quantizer(x)
    assert col._data is None and torch.equal(col._transpose, row._transpose)
    assert torch.equal(col.dequantize(), row.dequantize())


# ---- ops -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", list(FP8))
def test_exact_ops_are_bit_exact(fp8_dtype):
    x_fp8 = _delayed(fp8_dtype)(_uniform((23,)))
    x_ref = x_fp8.dequantize()
    for out, ref in ((-x_fp8, -x_ref), (x_fp8.abs(), x_ref.abs())):
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_arithmetic_falls_back_to_high_precision():
    x_hp, y_hp = _uniform((23,)), _uniform((23,))
    x_fp8, y_fp8 = _delayed()(x_hp), _delayed()(y_hp)
    x_ref, y_ref = x_fp8.dequantize(), y_fp8.dequantize()
    tols = _tols(DType.kFloat8E4M3)
    for out, ref in ((x_fp8 + y_fp8, x_ref + y_ref), (x_fp8 - y_fp8, x_ref - y_ref),
                     (x_fp8 * y_fp8, x_ref * y_ref), (x_fp8 + y_ref, x_ref + y_ref),
                     (x_ref + y_fp8, x_ref + y_ref), (torch.sin(x_fp8), torch.sin(x_ref))):
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, ref, **tols)
    with pytest.raises(AssertionError):  # the check is not trivial
        torch.testing.assert_close(x_fp8 + y_fp8, x_ref - y_ref, **tols)


def test_inplace_ops_requantize_with_the_tensors_quantizer():
    x_fp8, y_fp8 = _delayed()(_uniform((23,))), _delayed()(_uniform((23,)))
    x_ref, y_ref = x_fp8.dequantize(), y_fp8.dequantize()
    tols = _tols(DType.kFloat8E4M3)
    data = x_fp8._data
    for op in (lambda t, y: t.add_(y), lambda t, y: t.sub_(y), lambda t, y: t.mul_(2)):
        out = op(x_fp8, y_fp8)
        x_ref = op(x_ref, y_ref)
        assert out is x_fp8 and isinstance(x_fp8, Float8Tensor)
        assert torch.equal(x_fp8._data, (x_ref * 3.5).to(torch.float8_e4m3fn).view(torch.uint8))  # the quantizer's scale
        torch.testing.assert_close(x_fp8.dequantize(), x_ref, **tols)
        x_ref = x_fp8.dequantize()
    assert x_fp8._data is data  # written in place
    x_fp8 += 1.0
    assert isinstance(x_fp8, Float8Tensor)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(x_fp8.dequantize(), x_ref, **tols)


def test_copy_and_quantize_requantize_in_place():
    x_fp8 = _delayed()(_uniform((4, 6)))
    views = x_fp8.view(24)
    new = _uniform((4, 6), torch.bfloat16)
    x_fp8.copy_(new)
    expected = _delayed()(new)
    assert torch.equal(x_fp8._data, expected._data) and torch.equal(x_fp8._transpose, expected._transpose)
    assert torch.equal(views.dequantize(), x_fp8.dequantize().view(24))  # views share the buffers
    x_fp8.quantize_(torch.zeros(4, 6))
    assert torch.equal(x_fp8.dequantize(), torch.zeros(4, 6))
    plain = torch.empty(4, 6)
    plain.copy_(expected)
    assert torch.equal(plain, expected.dequantize())
    with pytest.raises(ValueError, match=r"shape \(3,\) into a Float8Tensor of shape \(4, 6\)"):
        x_fp8.quantize_(torch.zeros(3))
    bare = Float8Tensor(shape=(2,), dtype=torch.float32, data=torch.zeros(2, dtype=torch.uint8),
                        fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="has no quantizer"):
        bare.copy_(torch.ones(2))


def test_transpose_op_gives_the_dequantized_transpose():
    x_fp8 = _delayed()(_uniform((3, 5)))
    for out in (x_fp8.t(), x_fp8.transpose(0, 1)):
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, x_fp8.dequantize().t(), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["view", "reshape", "torch.reshape"])
def test_view_and_reshape_keep_the_byte_buffers(method):
    x_fp8 = _delayed()(_uniform((2, 3, 4))).requires_grad_()
    reshape = {"view": Float8Tensor.view, "reshape": Float8Tensor.reshape, "torch.reshape": torch.reshape}[method]
    y = reshape(x_fp8, (6, 4))
    assert isinstance(y, Float8Tensor) and y.shape == (6, 4)
    assert y._data.data_ptr() == x_fp8._data.data_ptr() and y._transpose.shape == (4, 6)
    assert torch.equal(y.dequantize(), x_fp8.dequantize().reshape(6, 4))
    flat = reshape(x_fp8, (-1,))
    assert flat.shape == (24,) and flat._transpose is None  # the last dimension changed
    y.dequantize().sum().backward()
    assert x_fp8.grad.shape == (2, 3, 4)


def test_clone_detach_and_device_moves():
    x_fp8 = _delayed()(_uniform((3, 4))).requires_grad_()
    copy = x_fp8.clone()
    assert isinstance(copy, Float8Tensor) and copy._data.data_ptr() != x_fp8._data.data_ptr()
    assert torch.equal(copy.dequantize(), x_fp8.dequantize()) and copy.requires_grad
    detached = x_fp8.detach()
    assert isinstance(detached, Float8Tensor) and detached._data is x_fp8._data and not detached.requires_grad
    moved = x_fp8.cpu()
    assert isinstance(moved, Float8Tensor) and torch.equal(moved.dequantize(), x_fp8.dequantize())
    assert x_fp8.to(torch.float64).dtype == torch.float64 and type(x_fp8.float()) is torch.Tensor


def test_quantize_and_dequantize_pass_gradients_straight_through():
    x = _uniform((5, 4)).requires_grad_()
    x_fp8 = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(x)
    assert x_fp8.requires_grad and x_fp8.grad_fn is not None
    (x_fp8.dequantize() * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((5, 4), 3.0))


# ---- serialization and .data ---------------------------------------------------------------------


@pytest.mark.parametrize("weights_only", [False, True])
def test_save_load_round_trip(weights_only):
    x_fp8 = _delayed(scale=0.5)(_uniform((2, 3, 5)))
    x_ref = x_fp8.dequantize()
    buffer = io.BytesIO()
    torch.save(x_fp8, buffer)
    x_fp8._data.view(torch.uint8).zero_()
    x_fp8._scale_inv.zero_()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=weights_only)
    assert isinstance(loaded, Float8Tensor) and loaded.shape == (2, 3, 5) and loaded._fp8_dtype == DType.kFloat8E4M3
    torch.testing.assert_close(loaded.dequantize(), x_ref, rtol=0, atol=0)
    assert loaded._transpose is not None
    loaded._scale_inv.zero_()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(loaded.dequantize(), x_ref, rtol=0, atol=0)


def test_data_assignment():
    x = _delayed()(torch.zeros(4))
    x.data = torch.ones(3, 2, dtype=torch.float16)
    assert isinstance(x, Float8Tensor) and x.shape == (3, 2) and x.dtype == torch.float16
    assert x._data.shape == (3, 2) and torch.equal(x.dequantize(), torch.ones(3, 2, dtype=torch.float16))
    other = _delayed()(_uniform((4, 3, 1)))
    x.data = other
    assert x.shape == (4, 3, 1) and x.dtype == torch.float32
    assert x._data is other._data and x._scale_inv is other._scale_inv
    assert isinstance(x.data, Float8Tensor)


def test_legacy_import_path():
    from transformer_engine.pytorch.float8_tensor import Float8Tensor as Legacy
    assert Legacy is Float8Tensor


def test_make_empty():
    quantizer = Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu")
    x = quantizer.make_empty((3, 8), dtype=torch.bfloat16, device="cpu")
    assert x.shape == (3, 8) and x.dtype == torch.bfloat16 and x._data.dtype == torch.uint8 and x._fp8_dtype == DType.kFloat8E5M2
    assert x._transpose.shape == (8, 3)
    x.copy_(torch.ones(3, 8))
    assert torch.equal(x.dequantize(), torch.ones(3, 8, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_on_gpu_same_codes_as_the_cpu(current):
    """The GPU casts (flagos) give the CPU reference's FP8 codes and scales, and the ops keep the device."""
    x = _uniform((64, 48), torch.bfloat16)
    quantizers = [Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device) if current
                  else Float8Quantizer(torch.full((1,), 3.0, device=device), torch.zeros(1, device=device), torch.float8_e4m3fn)
                  for device in ("cpu", "cuda")]
    on_cpu, on_gpu = quantizers[0](x), quantizers[1](x.cuda())
    assert on_gpu.device.type == "cuda" and on_gpu._data.is_cuda
    assert torch.equal(on_gpu._data.cpu().view(torch.uint8), on_cpu._data.view(torch.uint8))
    assert torch.equal(on_gpu._scale_inv.cpu(), on_cpu._scale_inv)
    torch.testing.assert_close((on_gpu * 2).cpu(), on_cpu * 2, rtol=0, atol=0)


def test_copy_between_float8_tensors_copies_the_bytes():
    """TE's rule: dst.copy_(src) of two Float8Tensors copies src's FP8 data and scale_inv (a checkpoint loads
    bit for bit) instead of re-quantizing with dst's quantizer; dst's transpose is made from the copied bytes."""
    src = _delayed(scale=2.0)(_uniform((4, 6)))
    dst = _delayed(scale=5.0)(torch.zeros(4, 6))
    data = dst._data
    dst.copy_(src)
    assert dst._data is data and torch.equal(dst._data.view(torch.uint8), src._data.view(torch.uint8))
    assert torch.equal(dst._scale_inv, src._scale_inv) and torch.equal(dst._transpose, src._data.t())
    rowwise_only = _delayed(scale=5.0, columnwise=False)(torch.zeros(4, 6))
    rowwise_only.copy_(src)
    assert rowwise_only._transpose is None and torch.equal(rowwise_only.dequantize(), src.dequantize())
    other_shape = _delayed()(torch.zeros(6, 4))
    with pytest.raises(ValueError, match="shape"):
        other_shape.copy_(src)


def test_foreach_inplace_ops_requantize_each_quantized_element():
    x_fp8 = _delayed()(torch.zeros(4, 6))
    plain = torch.zeros(3)
    torch._foreach_add_([x_fp8, plain], 0.5)
    assert isinstance(x_fp8, Float8Tensor) and torch.equal(x_fp8.dequantize(), torch.full((4, 6), 0.5))
    assert torch.equal(plain, torch.full((3,), 0.5))


def test_current_scaling_quantizers_keep_their_own_scale_and_amax_of_the_last_cast():
    """TE's per-quantizer buffers: distinct per instance, shared by ``copy``, written by each cast, kept by a skipped
    update (``noop_flag``)."""
    q1, q2 = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu"), Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    assert q1.scale.data_ptr() != q2.scale.data_ptr() and q1.amax.data_ptr() != q2.amax.data_ptr()
    assert q1.scale.tolist() == [1.0] and q1.amax.tolist() == [0.0]
    q1.scale.fill_(123.0)
    assert q2.scale.tolist() == [1.0]
    x = q1(torch.tensor([1.0, -4.0]))
    assert q1.amax.tolist() == [4.0] and q1.scale.tolist() == [112.0]  # 448 / 4
    assert torch.equal(x._scale_inv, 1 / q1.scale) and q1.copy().scale is q1.scale
    q1.update_quantized(torch.tensor([8.0, 0.0]), x, noop_flag=torch.ones(1))
    assert q1.amax.tolist() == [4.0] and q1.scale.tolist() == [112.0]
