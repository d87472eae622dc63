"""The public block-scaled FP8 tensor (Float8BlockwiseQTensor, Float8BlockQuantizer): casts, copies, dispatch, state."""

import io

import pytest
import torch

from transformer_engine.plugin import ops
from transformer_engine.pytorch.tensor import DType, Float8BlockQuantizer, Float8BlockwiseQTensor, QuantizedTensor
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockScaleTensorFormat

FP8 = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}


def _quantizer(dim=2, fp8_dtype=DType.kFloat8E4M3, **usage):
    usage = {"rowwise": True, "columnwise": True, **usage}
    return Float8BlockQuantizer(fp8_dtype, block_scaling_dim=dim, **usage)


def _x(shape, dtype=torch.float32):
    """Values whose tiles differ in magnitude by powers of ten (each tile gets a scale of its own)."""
    x = torch.randn(shape, dtype=torch.float32)
    rows = torch.arange(x.reshape(-1, shape[-1]).shape[0]).reshape(-1, 1)
    return (x.reshape(-1, shape[-1]) * 10.0 ** ((rows // 128) % 3)).reshape(shape).to(dtype)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", list(FP8))
@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (2, 96, 256)])
def test_values_and_scales_are_the_catalog_casts(dim, fp8_dtype, shape):
    """Row-wise data and scales are ops.quantize_blockwise of the matrix [prod(lead), last] in the quantizer's tiles."""
    x = _x(shape, torch.bfloat16)
    x_q = _quantizer(dim, fp8_dtype)(x)
    q, scale_inv = ops.quantize_blockwise(x.reshape(-1, shape[-1]), FP8[fp8_dtype], block_rows=128 if dim == 2 else 1,
                                          block_cols=128, power_2_scale=True, amax_epsilon=0.0)
    assert isinstance(x_q, Float8BlockwiseQTensor) and isinstance(x_q, QuantizedTensor)
    assert x_q.shape == shape and x_q.dtype == torch.bfloat16 and x_q._rowwise_data.shape == shape
    assert torch.equal(x_q._rowwise_data.reshape(q.shape).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(x_q._rowwise_scale_inv, scale_inv)
    expected = ops.dequantize_blockwise(q, scale_inv, 128 if dim == 2 else 1, 128, torch.bfloat16).reshape(shape)
    assert torch.equal(x_q.dequantize(), expected)
    # half an ulp of the format, relative; absolute: the subnormal quantum of the coarsest tile
    e5m2 = fp8_dtype is DType.kFloat8E5M2
    atol = scale_inv.max().item() * 2.0 ** (-16 if e5m2 else -9)
    torch.testing.assert_close(x_q.dequantize().float(), x.float(), rtol=0.13 if e5m2 else 0.07, atol=atol)


def test_columnwise_copy_is_the_transpose_for_2d_tiles_and_a_cast_of_x_t_for_1d():
    x = _x((256, 384))
    two_d, one_d = _quantizer(2)(x), _quantizer(1)(x)
    assert torch.equal(two_d._columnwise_data.view(torch.uint8), two_d._rowwise_data.view(torch.uint8).t())
    assert torch.equal(two_d._columnwise_scale_inv, two_d._rowwise_scale_inv.t())
    q_t, scale_inv_t = ops.quantize_blockwise(x.t(), torch.float8_e4m3fn, block_rows=1, block_cols=128, power_2_scale=True,
                                              amax_epsilon=0.0)
    assert torch.equal(one_d._columnwise_data.view(torch.uint8), q_t.view(torch.uint8))
    assert torch.equal(one_d._columnwise_scale_inv, scale_inv_t)


def test_update_usage_makes_or_drops_the_copies_it_can():
    x = _x((256, 128))
    two_d = _quantizer(2, columnwise=False)(x)
    two_d.update_usage(columnwise_usage=True)
    assert torch.equal(two_d._columnwise_data.view(torch.uint8), two_d._rowwise_data.view(torch.uint8).t())
    two_d.update_usage(rowwise_usage=False)
    assert two_d.get_usages() == {"rowwise": False, "columnwise": True}
    torch.testing.assert_close(two_d.dequantize(), _quantizer(2)(x).dequantize(), rtol=0, atol=0)
    one_d = _quantizer(1, columnwise=False)(x)
    with pytest.raises(RuntimeError, match="quantization of x\\^T"):
        one_d.update_usage(columnwise_usage=True)
    with pytest.raises(RuntimeError, match="without data"):
        one_d.update_usage(rowwise_usage=False, columnwise_usage=False)


@pytest.mark.parametrize("method", ["view", "reshape"])
def test_shapes_that_keep_the_last_dimension_share_the_buffers(method):
    x_q = _quantizer(1)(_x((2, 128, 256))).requires_grad_()
    y = getattr(x_q, method)(256, 256)
    assert isinstance(y, Float8BlockwiseQTensor) and y.shape == (256, 256)
    assert y._rowwise_data.data_ptr() == x_q._rowwise_data.data_ptr()
    assert torch.equal(y.dequantize(), x_q.dequantize().reshape(256, 256))
    y.dequantize().sum().backward()
    assert x_q.grad.shape == (2, 128, 256)
    with pytest.raises(NotImplementedError, match="last dimension"):
        x_q.view(-1)


def test_copies_clones_and_in_place_updates():
    quantizer = _quantizer(2)
    x, y = _x((256, 256)), _x((256, 256)) * 3
    a, b = quantizer(x), quantizer(y)
    a.copy_(b)  # same layout: the bytes and scales
    assert torch.equal(a._rowwise_data.view(torch.uint8), b._rowwise_data.view(torch.uint8)) and a._rowwise_data is not b._rowwise_data
    a.copy_(x)  # high precision: re-quantized in place
    assert torch.equal(a.dequantize(), quantizer(x).dequantize())
    a.add_(1.0)  # an in-place op runs on the dequantized values and re-quantizes
    assert torch.equal(a.dequantize(), quantizer(quantizer(x).dequantize() + 1.0).dequantize())
    clone = a.clone()
    assert clone._rowwise_data.data_ptr() != a._rowwise_data.data_ptr() and torch.equal(clone.dequantize(), a.dequantize())
    assert a.detach()._rowwise_data is a._rowwise_data
    assert type(a + 1) is torch.Tensor  # out-of-place ops compute in high precision


@pytest.mark.parametrize("weights_only", [False, True])
def test_save_load_round_trip(weights_only):
    x_q = _quantizer(1)(_x((128, 256), torch.bfloat16))
    expected = x_q.dequantize()
    buffer = io.BytesIO()
    torch.save(x_q, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=weights_only)
    assert isinstance(loaded, Float8BlockwiseQTensor) and loaded.shape == (128, 256) and not loaded._is_2D_scaled
    assert torch.equal(loaded.dequantize(), expected) and loaded.get_usages() == x_q.get_usages()


def test_make_empty():
    empty = _quantizer(2, columnwise=False).make_empty((300, 256), dtype=torch.bfloat16, device="cpu")
    assert isinstance(empty, Float8BlockwiseQTensor) and empty.shape == (300, 256) and empty.dtype == torch.bfloat16
    assert empty._rowwise_scale_inv.shape == (3, 2) and empty._columnwise_data is None
    empty.copy_(torch.ones(300, 256))
    assert torch.equal(empty.dequantize(), torch.ones(300, 256, dtype=torch.bfloat16))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_scaling_dim=3"):
        Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon=-1"):
        Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="all_gather_usage=True.*block_scaling_dim=1"):
        Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False, all_gather_usage=True)
    with pytest.raises(ValueError, match="rowwise=False and columnwise=False"):
        _quantizer(2, rowwise=False, columnwise=False)(torch.ones(128, 128))
    data = torch.zeros(128, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv must be float32 of shape \(1, 2\)"):
        Float8BlockwiseQTensor((128, 256), torch.float32, rowwise_data=data, rowwise_scale_inv=torch.ones(1, 1),
                               fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="needs rowwise_data, columnwise_data or both"):
        Float8BlockwiseQTensor((128, 256), torch.float32, rowwise_data=None, rowwise_scale_inv=None, fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="holds 2-D tiles"):
        _quantizer(1).update_quantized(torch.ones(128, 128), _quantizer(2)(torch.ones(128, 128)))


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(256, 384), (250, 500), (7, 5, 3), (311,)])
def test_scale_and_columnwise_shapes_are_those_of_the_casts(dim, shape):
    """TE's quantizer helpers: the shapes a constructor needs, equal to what a cast makes."""
    quantizer = _quantizer(dim)
    x_q = quantizer(_x(shape))
    assert quantizer.get_scale_shape(shape, columnwise=False) == tuple(x_q._rowwise_scale_inv.shape)
    assert quantizer.get_scale_shape(shape, columnwise=True) == tuple(x_q._columnwise_scale_inv.shape)
    assert quantizer.get_columnwise_shape(shape) == x_q._columnwise_data.shape


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (2, 96, 256)])
def test_compact_format_holds_the_gemm_ready_values_untransposed(shape):
    """all_gather_usage=True (1 x 128 tiles): the row-wise copy as GEMM_READY's, the column-wise copy untransposed
    (data of the tensor's shape, scales [ceil(M / 128), K], one per 128 x 1 block) holding the same values; the
    shapes are the quantizer's; dequantization, the GEMM operand and a pickle agree with GEMM_READY's."""
    x = _x(shape, torch.bfloat16)
    compact_q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1, all_gather_usage=True)
    compact, ready = compact_q(x), _quantizer(1)(x)
    m, k = x.numel() // shape[-1], shape[-1]
    assert compact._data_format is Float8BlockScaleTensorFormat.COMPACT and ready._data_format is Float8BlockScaleTensorFormat.GEMM_READY
    assert compact._columnwise_data.shape == shape == compact_q.get_columnwise_shape(shape)
    assert compact._columnwise_scale_inv.shape == ((m + 127) // 128, k) == compact_q.get_scale_shape(shape, columnwise=True)
    assert compact._rowwise_scale_inv.shape == compact_q.get_scale_shape(shape, columnwise=False)
    assert torch.equal(compact._rowwise_data, ready._rowwise_data) and torch.equal(compact._rowwise_scale_inv, ready._rowwise_scale_inv)
    assert torch.equal(compact._columnwise_data.reshape(m, k), ready._columnwise_data.reshape(k, m).t())
    assert torch.equal(compact._columnwise_scale_inv, ready._columnwise_scale_inv.t())
    assert torch.equal(compact.dequantize(), ready.dequantize())
    compact_operand, ready_operand = compact.operand(), ready.operand()
    assert torch.equal(compact_operand.data_t.view(torch.uint8), ready_operand.data_t.view(torch.uint8))
    assert torch.equal(compact_operand.scale_inv_t, ready_operand.scale_inv_t)
    compact.update_usage(rowwise_usage=False)  # the column-wise copy alone dequantizes to the same values
    ready.update_usage(rowwise_usage=False)
    assert torch.equal(compact.dequantize(), ready.dequantize())
    buffer = io.BytesIO()
    torch.save(compact, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded._data_format is Float8BlockScaleTensorFormat.COMPACT and torch.equal(loaded.dequantize(), compact.dequantize())


def test_compact_tensors_reshape_copy_and_update_in_their_format():
    """Shapes that keep the last dimension, clone, make_empty and in-place updates keep the COMPACT format; a copy_
    between the formats re-quantizes the source (the same values)."""
    q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1, all_gather_usage=True)
    x = _x((2, 128, 256))
    compact = q(x)
    flat = compact.view(256, 256)
    assert flat._data_format is Float8BlockScaleTensorFormat.COMPACT and torch.equal(flat.dequantize(), compact.dequantize().view(256, 256))
    assert compact.clone()._data_format is Float8BlockScaleTensorFormat.COMPACT
    empty = q.make_empty((2, 128, 256), device="cpu")
    assert empty._data_format is Float8BlockScaleTensorFormat.COMPACT and empty._columnwise_data.shape == (2, 128, 256)
    q.update_quantized(x, empty)
    assert torch.equal(empty._columnwise_data, compact._columnwise_data) and torch.equal(empty.dequantize(), compact.dequantize())
    ready = _quantizer(1)(torch.zeros(2, 128, 256))
    ready.copy_(compact)
    assert ready._data_format is Float8BlockScaleTensorFormat.GEMM_READY and torch.equal(ready.dequantize(), compact.dequantize())
    with pytest.raises(ValueError, match="COMPACT Float8BlockwiseQTensor holds 1 x 128 tiles"):
        Float8BlockwiseQTensor((128, 128), torch.float32, rowwise_data=torch.zeros(128, 128, dtype=torch.uint8),
                               rowwise_scale_inv=torch.ones(1, 1), fp8_dtype=DType.kFloat8E4M3,
                               data_format=Float8BlockScaleTensorFormat.COMPACT)
