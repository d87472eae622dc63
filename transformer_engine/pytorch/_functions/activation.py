"""The twelve activations of ``LayerNormMLP`` (TE's list), forward (with fused FP8 cast) and backward.

Gated ones ("GLU" variants) take fc1's output [.., 2F] = [a, b] and return act(a) * b, so FC1 has 2F
rows; ``clamped_swiglu`` (GPT-OSS) reads ``activation_params`` {limit, alpha, glu_linear_offset}.
The math of each op is in ``plugin/catalog/activation.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from transformer_engine.plugin import ops

__all__ = ["ACTIVATIONS", "ActivationConfig"]

# name -> gated
ACTIVATIONS: Dict[str, bool] = {
    "gelu": False, "geglu": True, "glu": True, "qgelu": False, "qgeglu": True, "relu": False,
    "reglu": True, "srelu": False, "sreglu": True, "silu": False, "swiglu": True, "clamped_swiglu": True,
}
#: activations that are exactly one PyTorch operator (the catalog's math; see plugin/backends/vendor/cuda/activation.py)
_TORCH_OPERATORS = {"gelu": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}
_CLAMPED = "clamped_swiglu"
_CLAMPED_PARAMS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}


@dataclass(frozen=True)
class ActivationConfig:
    """One activation and its parameters (``limit``, ``alpha``: clamped_swiglu only)."""

    name: str
    limit: float = 7.0
    alpha: float = 1.702

    @staticmethod
    def create(activation: str, activation_params: Optional[dict] = None) -> "ActivationConfig":
        """Validate TE's ``activation`` / ``activation_params`` arguments."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; choose one of {sorted(ACTIVATIONS)}")
        params = dict(activation_params or {})
        if params and activation != _CLAMPED:
            raise ValueError(f"activation_params are only used by {_CLAMPED!r}, got {params} for {activation!r}")
        unknown = sorted(set(params) - set(_CLAMPED_PARAMS))
        if unknown:
            raise ValueError(f"unknown activation_params {unknown}; {_CLAMPED} takes {sorted(_CLAMPED_PARAMS)}")
        merged = {**_CLAMPED_PARAMS, **params}
        if merged["glu_linear_offset"] != 1.0:
            raise ValueError(f"glu_linear_offset={merged['glu_linear_offset']} is not supported; the kernels use 1.0")
        return ActivationConfig(activation, float(merged["limit"]), float(merged["alpha"]))

    @property
    def gated(self) -> bool:
        """True for the GLU variants (FC1 produces 2F features)."""
        return ACTIVATIONS[self.name]

    @property
    def torch_operator(self):
        """PyTorch's own function computing this activation (``gelu``: ``F.gelu`` with the tanh approximation, ``silu``:
        ``F.silu``), or None where there is none; it runs in place of the catalog's op and its derivative when the policy
        puts first an implementation that declares itself that operator (see ``activation_function.apply_activation``)."""
        return _TORCH_OPERATORS.get(self.name)

    def _kwargs(self) -> dict:
        return {"limit": self.limit, "alpha": self.alpha} if self.name == _CLAMPED else {}

    def producer(self, h: torch.Tensor):
        """A ``run(fp8_scale, fp8_dtype, amax_out)`` for ``Quantizer.produce``: act(h), quantized by the fused op when asked."""

        def run(fp8_scale, fp8_dtype, amax_out):
            if fp8_scale is None:
                return getattr(ops, self.name)(h, **self._kwargs()), None, None, None
            q, scale_inv, amax = ops.activation_quantize(h, self.name, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, limit=self.limit,
                                                         alpha=self.alpha, amax_out=amax_out)
            return q, scale_inv, amax, None

        return run

    def backward(self, dy: torch.Tensor, h: torch.Tensor, overwrite_h: bool = False) -> torch.Tensor:
        """dh = dy * act'(h) (for gated ops: the gradient of both halves); with ``overwrite_h`` written
        over h (``ops.dactivation_``), which must then be contiguous and unused afterwards."""
        if overwrite_h:
            return ops.dactivation_(dy, h, self.name, limit=self.limit, alpha=self.alpha)
        name = "clamped_dswiglu" if self.name == _CLAMPED else f"d{self.name}"
        return getattr(ops, name)(dy, h, **self._kwargs())
