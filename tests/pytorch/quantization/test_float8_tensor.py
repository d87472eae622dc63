"""Float8Tensor: the transposed copy (with_transpose / transpose_only), shape and dequantize in both layouts."""

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin import ops
from transformer_engine.pytorch.quantization import Float8Tensor

E4M3 = torch.float8_e4m3fn


def _fp8(rows, cols):
    q, scale_inv, _ = ops.quantize(randn(rows, cols, scale=3.0), torch.tensor(16.0), E4M3)
    return Float8Tensor(q, scale_inv)


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 16)])
def test_with_transpose_and_transpose_only_keep_the_values(shape):
    t = _fp8(*shape)
    both = t.with_transpose()
    assert both.with_transpose() is both  # made once
    assert torch.equal(both.data_t.view(torch.uint8), t.data.t().contiguous().view(torch.uint8))
    assert both.data_t.is_contiguous()
    only = both.transpose_only()
    assert only.data is None and only.data_t is both.data_t
    assert only.shape == t.shape == both.shape and only.fp8_dtype == E4M3 and only.device == t.device
    assert torch.equal(only.dequantize(torch.float32), t.dequantize(torch.float32))
    assert torch.equal(t.transpose_only().data_t.view(torch.uint8), both.data_t.view(torch.uint8))


def test_needs_some_data():
    with pytest.raises(ValueError, match="needs data, data_t or both"):
        Float8Tensor(None, torch.tensor(1.0))
