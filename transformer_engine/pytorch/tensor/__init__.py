"""TE's public quantized-tensor API: ``QuantizedTensor``, ``Quantizer``, ``Float8Tensor`` and its quantizers,
``Float8BlockwiseQTensor`` and ``Float8BlockQuantizer``, ``MXFP8Tensor`` and ``MXFP8Quantizer``, ``NVFP4Tensor`` and
``NVFP4Quantizer``, ``DType``.

These are the user-facing classes of NVIDIA TE's ``transformer_engine.pytorch.tensor``: ``torch.Tensor``
subclasses that behave like high-precision tensors (ops they have no rule for dequantize and run in
high precision) and can be saved, loaded, viewed, copied into and re-quantized in place.

They are not the classes of the same names in :mod:`transformer_engine.pytorch.quantization`: those
are plain containers the modules build per GEMM (no subclassing, no dispatch, minimal host cost). Both
cast through the same catalog ops and hold the same values: a public ``Float8Tensor`` ``x`` has the
FP8 bytes ``x._data`` (uint8, TE's storage), its transpose ``x._transpose`` and ``x._scale_inv``; viewed in
the FP8 dtype (``x.operand()``) they are the internal container's ``data``, ``data_t`` and ``scale_inv``.
"""

from .dtype import DType
from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from .nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from .quantized_tensor import QuantizedTensor, Quantizer

__all__ = [
    "DType",
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
]
