"""The quantized tensors as torch.compile sees them: __tensor_flatten__ / __tensor_unflatten__ rebuild each tensor."""

import pytest
import torch

from transformer_engine.pytorch.tensor import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

QUANTIZERS = {
    "Float8Tensor": lambda: Float8CurrentScalingQuantizer(DType.kFloat8E4M3),
    "Float8Tensor_rowwise": lambda: Float8CurrentScalingQuantizer(DType.kFloat8E4M3, columnwise=False),
    "Float8BlockwiseQTensor": lambda: Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    "Float8BlockwiseQTensor_compact": lambda: Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                                                   block_scaling_dim=1, all_gather_usage=True),
    "MXFP8Tensor": lambda: MXFP8Quantizer(DType.kFloat8E4M3),
    "NVFP4Tensor": lambda: NVFP4Quantizer(),
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_unflatten_of_flatten_is_the_same_tensor(name):
    """The inner tensors are the buffers the tensor holds (a dropped copy is not among them); the context holds
    no tensor; unflattening them gives a tensor of the class, shape, dtype, format and values."""
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    t = QUANTIZERS[name]()(x)
    assert is_traceable_wrapper_subclass(t)
    names, context = t.__tensor_flatten__()
    assert all(isinstance(getattr(t, n), torch.Tensor) for n in names)
    assert not any(isinstance(value, torch.Tensor) for _, value in context[1])
    rebuilt = type(t).__tensor_unflatten__({n: getattr(t, n) for n in names}, context, t.shape, t.stride())
    assert type(rebuilt) is type(t) and rebuilt.shape == t.shape and rebuilt.dtype == t.dtype
    assert rebuilt.__tensor_flatten__() == (names, context)
    assert torch.equal(rebuilt.dequantize(), t.dequantize())
    if name == "Float8Tensor_rowwise":
        assert "_transpose" not in names


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_repr_of_a_traced_tensor_reads_no_values(name):
    """While torch.compile traces a quantized tensor its buffers are fake; compile's logging prints it. The repr must
    neither read a scalar (``.item()`` leaves an unbacked symbol that fails Inductor's compilation) nor run a kernel
    (a GPU kernel cannot take a fake tensor), and a real tensor's repr still shows its values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    t = QUANTIZERS[name]()(torch.randn(64, 128, dtype=torch.bfloat16))
    names, context = t.__tensor_flatten__()
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env) as mode:
        fake = type(t).__tensor_unflatten__({n: mode.from_tensor(getattr(t, n)) for n in names}, context, t.shape, t.stride())
        text = repr(fake)
    assert "traced" in text and not shape_env.pending_fresh_unbacked_symbols
    assert "traced" not in repr(t) and "data=tensor(" in repr(t)
