"""The public MXFP8 tensor (MXFP8Tensor, MXFP8Quantizer): casts, usages, views, copies, dispatch, pickling."""

import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.plugin import ops
from transformer_engine.pytorch.tensor import DType, MXFP8Quantizer, MXFP8Tensor, QuantizedTensor

FP8 = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}


def _x(shape, dtype=torch.float32):
    """Values whose 32-element blocks differ in magnitude by powers of ten (each block gets a scale of its own)."""
    x = torch.randn(shape, dtype=torch.float32)
    cols = torch.arange(shape[-1])
    return (x * 10.0 ** ((cols // 32) % 3 - 1)).to(dtype)


def _bytes(t):
    return None if t is None else t.view(torch.uint8)


@pytest.mark.parametrize("fp8_dtype", list(FP8))
@pytest.mark.parametrize("shape", [(64, 96), (2, 32, 64)])
def test_copies_are_the_catalog_casts_in_tes_layout(fp8_dtype, shape):
    """Row-wise: ops.quantize_mxfp8's data and scales of the matrix [M, K]; column-wise: its x^T copy transposed
    back, so both data buffers have x's shape and the scales are [M, K / 32] and [M / 32, K]."""
    x = _x(shape, torch.bfloat16)
    x_q = MXFP8Quantizer(fp8_dtype)(x)
    data, scale, data_t, scale_t = ops.quantize_mxfp8(x.reshape(-1, shape[-1]), FP8[fp8_dtype], rowwise=True, columnwise=True)
    assert isinstance(x_q, MXFP8Tensor) and isinstance(x_q, QuantizedTensor) and x_q.shape == shape and x_q.dtype == torch.bfloat16
    assert x_q._rowwise_data.shape == shape and x_q._columnwise_data.shape == shape
    assert torch.equal(_bytes(x_q._rowwise_data).reshape(data.shape), _bytes(data)) and torch.equal(x_q._rowwise_scale_inv, scale)
    assert torch.equal(_bytes(x_q._columnwise_data).reshape(data.shape), _bytes(data_t).t())
    assert torch.equal(x_q._columnwise_scale_inv, scale_t.t())
    assert torch.equal(x_q.dequantize(), ops.dequantize_mxfp8(data, scale, torch.bfloat16).reshape(shape))
    columnwise = ops.dequantize_mxfp8(data_t, scale_t, torch.float32).t().reshape(shape)
    x_q.update_usage(rowwise_usage=False)
    assert torch.equal(x_q.dequantize(dtype=torch.float32), columnwise)  # read from the column-wise copy alone
    # power-of-two scales rounded up: no value saturates; error at most half an ulp of the format, relative
    torch.testing.assert_close(columnwise, x.float(), rtol=0.13 if fp8_dtype is DType.kFloat8E5M2 else 0.07, atol=1e-30)


def test_shapes_that_blocks_do_not_divide_raise_and_is_quantizable_says_so():
    q = MXFP8Quantizer(DType.kFloat8E4M3)
    assert q.is_quantizable(torch.zeros(64, 32)) and q.is_quantizable(torch.zeros(2, 16, 32))
    assert not q.is_quantizable(torch.zeros(48, 32)) and not q.is_quantizable(torch.zeros(64, 40)) and not q.is_quantizable(torch.zeros(64))
    with pytest.raises(ValueError, match="32"):
        q(torch.randn(48, 32))
    with pytest.raises(ValueError, match=r"last dim \(40\) is not a multiple of 32"):
        q.make_empty((64, 40))
    q.set_usage(rowwise=True, columnwise=False)
    assert q(torch.randn(48, 32)).get_usages() == {"rowwise": True, "columnwise": False}  # the row-wise copy needs K % 32 only


def test_update_usage_drops_copies_and_cannot_make_one_from_the_other():
    x = _x((64, 64))
    x_q = MXFP8Quantizer(DType.kFloat8E4M3, columnwise=False)(x)
    with pytest.raises(RuntimeError, match="quantization of its own"):
        x_q.update_usage(columnwise_usage=True)
    both = MXFP8Quantizer(DType.kFloat8E4M3)(x)
    both.update_usage(columnwise_usage=False)
    assert both.get_usages() == {"rowwise": True, "columnwise": False} and both._columnwise_scale_inv is None
    with pytest.raises(RuntimeError, match="without data"):
        both.update_usage(rowwise_usage=False)
    only_t = MXFP8Quantizer(DType.kFloat8E4M3, rowwise=False)(x)
    with pytest.raises(RuntimeError, match="only holds its column-wise copy"):
        only_t.update_usage(rowwise_usage=True)


def test_views_keep_the_last_dim_and_share_the_buffers():
    x = _x((4, 32, 64))
    x_q = MXFP8Quantizer(DType.kFloat8E4M3)(x)
    flat = x_q.view(128, 64)
    assert isinstance(flat, MXFP8Tensor) and flat.shape == (128, 64)
    assert flat._rowwise_data.data_ptr() == x_q._rowwise_data.data_ptr()
    assert flat._columnwise_data.data_ptr() == x_q._columnwise_data.data_ptr()
    assert torch.equal(flat.dequantize(), x_q.dequantize().view(128, 64))
    assert torch.equal(x_q.reshape(2, 64, 64).dequantize(), x_q.dequantize().reshape(2, 64, 64))
    with pytest.raises(NotImplementedError, match="last dimension"):
        x_q.view(4, 64, 32)


def test_copy_between_tensors_of_one_layout_copies_bytes_and_from_high_precision_requantizes():
    q = MXFP8Quantizer(DType.kFloat8E4M3)
    src, dst = q(_x((64, 64))), q(torch.zeros(64, 64))
    dst.copy_(src)
    for key in ("_rowwise_data", "_columnwise_data"):
        assert torch.equal(_bytes(getattr(dst, key)), _bytes(getattr(src, key)))
    assert torch.equal(dst._rowwise_scale_inv, src._rowwise_scale_inv) and torch.equal(dst._columnwise_scale_inv, src._columnwise_scale_inv)
    y = _x((64, 64))
    buffer = dst._rowwise_data
    dst.copy_(y)  # a high-precision source: dst = Q(y), written into dst's own buffers
    assert dst._rowwise_data is buffer and torch.equal(dst.dequantize(), q(y).dequantize())
    dst.add_(1.0)  # in-place ops run in high precision and quantize again
    assert torch.equal(dst.dequantize(), q(q(y).dequantize() + 1.0).dequantize())


def test_high_precision_ops_run_on_the_dequantized_values():
    x_q = MXFP8Quantizer(DType.kFloat8E4M3)(_x((64, 32), torch.bfloat16))
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(torch.matmul(x_q, w), torch.matmul(x_q.dequantize(), w))
    assert torch.equal(x_q * 2, x_q.dequantize() * 2)


def test_make_empty_has_unit_scales_and_update_quantized_fills_it():
    q = MXFP8Quantizer(DType.kFloat8E5M2)
    empty = q.make_empty((2, 32, 64), dtype=torch.bfloat16)
    assert empty.dtype == torch.bfloat16 and empty._rowwise_data.dtype == torch.uint8 and empty._fp8_dtype == DType.kFloat8E5M2
    assert empty._rowwise_scale_inv.shape == (64, 2) and empty._columnwise_scale_inv.shape == (2, 64)
    assert (empty._rowwise_scale_inv == 127).all() and (empty._columnwise_scale_inv == 127).all()
    x = _x((2, 32, 64))
    q.update_quantized(x, empty)
    assert torch.equal(empty.dequantize(dtype=torch.float32), q(x).dequantize(dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        q.update_quantized(torch.zeros(64, 64), empty)


def test_weights_only_pickling_round_trip():
    x_q = MXFP8Quantizer(DType.kFloat8E4M3)(_x((64, 96), torch.bfloat16))
    buffer = io.BytesIO()
    torch.save({"w": x_q}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is MXFP8Tensor and loaded.dtype == torch.bfloat16 and loaded.shape == x_q.shape
    assert torch.equal(_bytes(loaded._columnwise_data), _bytes(x_q._columnwise_data))
    assert torch.equal(loaded.dequantize(), x_q.dequantize())


def test_constructor_checks_the_buffers():
    data = torch.zeros(64, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="neither"):
        MXFP8Tensor((64, 64), torch.float32, rowwise_data=None, rowwise_scale_inv=None, fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv must be uint8 E8M0 codes of shape \(64, 2\)"):
        MXFP8Tensor((64, 64), torch.float32, rowwise_data=data, rowwise_scale_inv=torch.ones(64, 2), fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="columnwise_data has shape"):
        MXFP8Tensor((64, 64), torch.float32, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=data.t()[:32],
                    columnwise_scale_inv=torch.zeros(2, 64, dtype=torch.uint8), fp8_dtype=DType.kFloat8E4M3)
    t = MXFP8Tensor((64, 64), torch.float32, rowwise_data=data, rowwise_scale_inv=torch.full((64, 2), 127, dtype=torch.uint8),
                    fp8_dtype=DType.kFloat8E4M3)
    assert torch.equal(t.dequantize(), torch.zeros(64, 64))


def test_exported_at_tes_paths():
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer as by_module

    assert te.MXFP8Quantizer is MXFP8Quantizer is by_module and te.MXFP8Tensor is MXFP8Tensor
