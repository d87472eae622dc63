"""The ``cuda`` vendor backend: what NVIDIA's libraries do best, reached through PyTorch.

- ``gemm``: cuBLASLt FP8 GEMM (``torch._scaled_mm``) and cuBLAS for bf16 / fp16 / fp32;
- ``gemm_grouped`` / ``gemm_grouped_wgrad``: the G GEMMs of a grouped linear layer (CUTLASS or cuBLASLt per split);
- ``fused_attn_fwd`` / ``fused_attn_bwd``: PyTorch SDPA (cuDNN / flash), when its module is present;
- ``attention_block_fwd`` / ``attention_block_bwd``: the same kernels as blocks of blockwise (ring) attention;
- ``fused_attn_fp8_fwd`` / ``fused_attn_fp8_bwd``: cuDNN's FP8 attention graphs, through the optional cudnn-frontend package;
- ``gelu`` / ``dgelu`` / ``silu`` / ``dsilu``: PyTorch's own activations (modules then run them as PyTorch's autograd nodes).

Every op runs on CUDA devices only (``Capabilities(device_types={"cuda"})``); what a vendor op cannot
do (an FP8 GEMM before compute capability 8.9, misaligned shapes, ...) its ``SUPPORTS`` predicate
declines, so the next backend in the policy order runs the call.
"""

import dataclasses
import importlib
from importlib.util import find_spec

from transformer_engine.plugin.backends._registration import impls_from_modules, register_torch_capability_probe
from transformer_engine.plugin.core.types import BackendImplKind, Capabilities

IMPL_ID = "vendor.cuda"
VENDOR = "cuda"
PRIORITY = 100
_FAMILIES = ("gemm", "gemm_grouped", "attention", "attention_block", "attention_fp8", "activation")

#: Ops where this backend was measured faster than the flagos kernel (attention, H200), or as fast on the GPU and
#: cheaper on the host (the activations, H100; docs/performance.md):
#: under the default preference the policy tries the vendor kind first for them (then the default order).
#: The plugin loader stores it with this backend's impls (core/discovery.py); an entry of TE_FL_PER_OP,
#: or TE_FL_PREFER=vendor/reference, replaces it.
TE_FL_MEASURED_PER_OP = {
    "fused_attn_fwd": ("vendor",),  # fwd+bwd cuDNN 403 TFLOP/s vs flagos 301 (b4 s2048 h32 d128 causal, H200)
    "fused_attn_bwd": ("vendor",),
    # the kernels as fast as flagos' ([8192, 4096] bf16, H100: gelu 46.5 / 47.3 us, dgelu 67.9 / 68.0, silu 46.4 / 46.7,
    # dsilu 68.1 / 68.4), and a high-precision module's activation then runs as PyTorch's C++ autograd node, not a Python one
    "gelu": ("vendor",),
    "dgelu": ("vendor",),
    "silu": ("vendor",),
    "dsilu": ("vendor",),
}

__all__ = ["register", "IMPL_ID", "VENDOR", "TE_FL_MEASURED_PER_OP"]


def _family_modules():
    """The op-family modules of this package that exist in this tree (a family may be absent)."""
    names = (f"{__name__}.{family}" for family in _FAMILIES)
    return [importlib.import_module(name) for name in names if find_spec(name) is not None]


def register(registry) -> None:
    """Register the cuda vendor ops (CUDA devices only).

    Raises:
        RuntimeError: PyTorch is a ROCm build, whose "cuda" devices are not NVIDIA GPUs.
    """
    import torch

    if torch.version.hip is not None:
        raise RuntimeError("vendor.cuda needs a CUDA build of PyTorch; this one is a ROCm (HIP) build")
    register_torch_capability_probe()
    impls = impls_from_modules(
        _family_modules(),
        IMPL_ID,
        BackendImplKind.VENDOR,
        Capabilities(device_types={"cuda"}),
        vendor=VENDOR,
        description="cuBLASLt / cuDNN through PyTorch",
        under_compile="trace",  # torch._scaled_mm, torch.mm and SDPA: Inductor knows them
    )
    registry.register_many([dataclasses.replace(impl, priority=PRIORITY) for impl in impls])
