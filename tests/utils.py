"""Helpers shared by the tests: tolerances per dtype, SQNR, random inputs.

Tolerances (rtol, atol) follow NVIDIA TE's test-suite table (reference/te_pytorch_api.md, section 5):
they are a few units in the last place of each format, so a correct kernel that rounds differently
(another summation order, fp32 vs fp64 accumulation) passes and a wrong one does not.
"""

from __future__ import annotations

import math

import torch

DTYPE_TOLS = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float8_e4m3fn: dict(rtol=0.125, atol=0.0675),
    torch.float8_e5m2: dict(rtol=0.25, atol=0.125),
}


def dtype_tols(dtype: torch.dtype) -> dict:
    """(rtol, atol) for comparing results computed in ``dtype`` against a higher-precision oracle."""
    return dict(DTYPE_TOLS[dtype])


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - actual||)."""
    ref = reference.double()
    noise = (ref - actual.double()).norm()
    if noise == 0:
        return math.inf
    return 20.0 * math.log10(ref.norm().item() / noise.item())


def rel_err(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """||ref - actual|| / ||ref|| computed in float64."""
    ref = reference.double()
    return ((ref - actual.double()).norm() / ref.norm().clamp_min(1e-300)).item()


def randn(*shape, dtype=torch.float32, device="cpu", scale: float = 1.0, generator=None) -> torch.Tensor:
    """Fresh non-zero normal random values (never zeros: they hide unwritten outputs)."""
    out = torch.randn(*shape, dtype=torch.float32, device=device, generator=generator) * scale
    return out.to(dtype)


def autograd_node_names(y: torch.Tensor) -> set:
    """The class names of every autograd node behind ``y`` (``y.grad_fn`` and all it reaches)."""
    names, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack += [fn for fn, _ in node.next_functions]
    return names
