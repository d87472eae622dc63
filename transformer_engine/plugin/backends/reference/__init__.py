"""The reference backend: every catalog op in plain PyTorch, on any device (CPU included).

It is the numerical oracle that faster backends are tested against and the last fallback.
FP8 uses torch's float8 dtypes with clip-then-cast saturation; FP8 GEMMs compute in float32 from
the dequantized operands. Under ``torch.compile`` its tensor ops are traced (``under_compile="trace"``):
Inductor compiles them, fused with their neighbours.
"""

from transformer_engine.plugin.backends._registration import impls_from_modules, register_torch_capability_probe
from transformer_engine.plugin.core.types import BackendImplKind, Capabilities

from . import (activation, attention, attention_block, attention_fp8, gemm, grouped, misc, mxfp8, normalization, nvfp4, optimizer,
               quantization, rope, softmax)

IMPL_ID = "reference.torch"
_MODULES = (activation, attention, attention_block, attention_fp8, gemm, grouped, misc, mxfp8, normalization, nvfp4, optimizer,
            quantization, rope, softmax)

__all__ = ["register", "IMPL_ID"]


def register(registry) -> None:
    """Register every reference op (any device, any dtype)."""
    register_torch_capability_probe()
    registry.register_many(
        impls_from_modules(_MODULES, IMPL_ID, BackendImplKind.REFERENCE, Capabilities(), description="pure PyTorch", under_compile="trace")
    )
