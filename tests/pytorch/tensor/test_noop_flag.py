"""QuantizedTensor.quantize_ / Quantizer.update_quantized with NVIDIA TE's noop_flag, for every public quantizer."""

import pytest
import torch

from transformer_engine.pytorch.tensor import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer


@pytest.mark.parametrize("quantizer", [Float8CurrentScalingQuantizer(DType.kFloat8E4M3),
                                       Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True),
                                       MXFP8Quantizer(DType.kFloat8E4M3)], ids=["fp8", "block", "mxfp8"])
@pytest.mark.parametrize("noop", [0.0, 1.0])
def test_noop_flag_keeps_the_tensor_where_set(quantizer, noop):
    """NVIDIA TE's quantize_(x, noop_flag=...): a nonzero flag leaves every buffer as it was."""
    x = quantizer(torch.randn(64, 128))
    before = {k: v.clone() for k, v in x.get_metadata().items() if isinstance(v, torch.Tensor)}
    y = torch.randn(64, 128) * 3
    x.quantize_(y, noop_flag=torch.tensor([noop]))
    if noop:
        assert all(torch.equal(x.get_metadata()[k], v) for k, v in before.items())
    else:
        assert torch.equal(x.dequantize(), quantizer(y).dequantize())


def test_noop_flag_also_keeps_the_delayed_amax():
    from transformer_engine.pytorch.tensor import Float8Quantizer

    quantizer = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)
    x = quantizer(torch.ones(4, 4))
    assert quantizer.amax.item() == 1.0
    x.quantize_(torch.full((4, 4), 5.0), noop_flag=torch.ones(1))
    assert quantizer.amax.item() == 1.0 and torch.equal(x.dequantize(), torch.ones(4, 4))
    x.quantize_(torch.full((4, 4), 5.0), noop_flag=torch.zeros(1))
    assert quantizer.amax.item() == 5.0 and torch.equal(x.dequantize(), torch.full((4, 4), 5.0))
    with pytest.raises(ValueError, match="one-element"):
        x.quantize_(torch.ones(4, 4), noop_flag=torch.zeros(2))
