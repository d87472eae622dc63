"""The flagos backend: portable Triton kernels (kind DEFAULT, priority 150).

Runs on CUDA GPUs; with ``TRITON_INTERPRET=1`` set when it registers (and when its kernels were
imported) it also accepts CPU tensors, through Triton's interpreter, which is how the tests run
the kernels without a GPU. Importing it without triton raises ImportError, which discovery
records as "backend not loaded" (``import transformer_engine`` is never affected).

Ops it declines for given arguments say why through their ``SUPPORTS`` predicates (e.g. rows
wider than one Triton block, packed RoPE, block-scaled casts with tiles other than 1 x B and
B x B); the dispatcher then runs the next backend. Not implemented here (the reference or vendor
backend runs them): gemm, dequantize_blockwise and multi_tensor_sgd.

Under ``torch.compile`` a call that would run a flagos kernel traces the reference backend's tensor
ops instead (``under_compile="reference"``): Inductor writes the Triton kernel itself, fused with the
neighbouring ops, and launches it without the Python launcher. The dropout kernels and the cast with
its bias gradient, which Inductor's own kernels did not match, are traced as they are
(``under_compile="trace"``): Dynamo records their Triton kernels, which Inductor then launches from
its generated code (the launch path of ``_launch`` steps aside while Dynamo traces).
"""

import importlib.util
import logging

import triton  # noqa: F401  (ImportError here disables the backend, by design)

from transformer_engine.plugin.backends._registration import impls_from_modules, register_torch_capability_probe
from transformer_engine.plugin.core.config import triton_interpret
from transformer_engine.plugin.core.types import BackendImplKind, Capabilities

from . import activation, delayed_scaling, misc, mxfp8, normalization, nvfp4, nvfp4_gemm, optimizer, quantization, \
    quantization_blockwise, quantization_grouped, rope, softmax

IMPL_ID = "flagos.triton"

__all__ = ["register", "IMPL_ID", "capabilities"]


def _modules():
    """The kernel modules to register; attention joins when its module exists."""
    modules = [activation, delayed_scaling, misc, mxfp8, normalization, nvfp4, nvfp4_gemm, optimizer, quantization, quantization_blockwise,
               quantization_grouped, rope, softmax]
    if importlib.util.find_spec(f"{__name__}.attention") is not None:
        try:
            modules.append(importlib.import_module(f"{__name__}.attention"))
        except Exception as exc:  # noqa: BLE001 - the other families stay usable; the reason is logged
            logging.getLogger("transformer_engine.plugin").warning("TE-FL: flagos attention not loaded: %s: %s", type(exc).__name__, exc)
    return modules


def capabilities() -> Capabilities:
    """{"cuda"}, plus "cpu" when TRITON_INTERPRET is on (kernels run in Triton's interpreter)."""
    devices = {"cuda"}
    if triton_interpret():
        devices.add("cpu")
    return Capabilities(device_types=frozenset(devices))


def register(registry) -> None:
    """Register every flagos op with the default device capabilities (module CAPABILITIES win)."""
    register_torch_capability_probe()
    registry.register_many(
        impls_from_modules(_modules(), IMPL_ID, BackendImplKind.DEFAULT, capabilities(), description="Triton kernels",
                           under_compile="reference")
    )
