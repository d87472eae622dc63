"""Pure-PyTorch references of the TE modules (TE's test_numerics.py approach), independent of the catalog ops.

Norms compute in float32 and cast back to the input dtype, as TE's references do; activations follow
the catalog's formulas written with torch primitives. ``copy_params`` copies a TE module's parameters
into a reference by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def srelu(x):
    return torch.relu(x) ** 2


_PLAIN = {"gelu": gelu_tanh, "qgelu": qgelu, "relu": torch.relu, "srelu": srelu, "silu": F.silu}
_GATES = {"glu": torch.sigmoid, "geglu": gelu_tanh, "qgeglu": qgelu, "reglu": torch.relu, "sreglu": srelu, "swiglu": F.silu}


def activation(name: str, x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """TE's activations on x (gated ones split the last dim in halves [a, b])."""
    if name in _PLAIN:
        return _PLAIN[name](x)
    a, b = x.chunk(2, dim=-1)
    if name == "clamped_swiglu":
        a, b = a.clamp(max=limit), b.clamp(-limit, limit)
        return a * torch.sigmoid(alpha * a) * (b + 1.0)
    return _GATES[name](a) * b


class TorchNorm(torch.nn.Module):
    """LayerNorm / RMSNorm in float32, cast back to the input dtype."""

    def __init__(self, kind: str, hidden: int, eps: float, zero_centered_gamma: bool = False, dtype=torch.float32):
        super().__init__()
        self.kind, self.eps, self.zcg = kind, eps, zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype)) if kind == "LayerNorm" else None

    def forward(self, x):
        x32 = x.float()
        gamma = self.weight.float() + (1.0 if self.zcg else 0.0)
        if self.kind == "LayerNorm":
            y = F.layer_norm(x32, x32.shape[-1:], gamma, self.bias.float(), self.eps)
        else:
            y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
        return y.to(x.dtype)


class TorchLayerNormLinear(torch.nn.Module):
    """norm -> nn.Linear."""

    def __init__(self, kind, in_features, out_features, eps, zero_centered_gamma=False, bias=True, dtype=torch.float32):
        super().__init__()
        self.norm = TorchNorm(kind, in_features, eps, zero_centered_gamma, dtype)
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.linear(self.norm(x))


class TorchLayerNormMLP(torch.nn.Module):
    """norm -> fc1 -> activation -> fc2."""

    def __init__(self, kind, hidden, ffn, act, eps=1e-5, bias=True, dtype=torch.float32, limit=7.0, alpha=1.702):
        super().__init__()
        gated = act in _GATES or act == "clamped_swiglu"
        self.norm = TorchNorm(kind, hidden, eps, zero_centered_gamma=False, dtype=dtype)
        self.fc1 = torch.nn.Linear(hidden, ffn * (2 if gated else 1), bias=bias, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=bias, dtype=dtype)
        self.act, self.limit, self.alpha = act, limit, alpha

    def forward(self, x):
        return self.fc2(activation(self.act, self.fc1(self.norm(x)), self.limit, self.alpha))


_NAMES = {
    "layer_norm_weight": "norm.weight", "layer_norm_bias": "norm.bias",
    "fc1_weight": "fc1.weight", "fc1_bias": "fc1.bias", "fc2_weight": "fc2.weight", "fc2_bias": "fc2.bias",
}


def copy_params(te_module: torch.nn.Module, ref: torch.nn.Module, linear_prefix: str = "") -> None:
    """Copy each TE parameter into the reference parameter of the matching name."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in te_module.named_parameters():
            target = _NAMES.get(name, f"{linear_prefix}{name}")
            ref_params[target].copy_(p)


def grads_by_te_name(ref: torch.nn.Module, te_module: torch.nn.Module, linear_prefix: str = ""):
    """{TE parameter name: the reference's gradient of the matching parameter}."""
    ref_params = dict(ref.named_parameters())
    return {name: ref_params[_NAMES.get(name, f"{linear_prefix}{name}")].grad for name, _ in te_module.named_parameters()}


def forward_backward(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, **kwargs):
    """(output, input grad, {parameter name: grad}) of one forward and backward with output grad ``dy``."""
    x = x.detach().clone().requires_grad_(requires_grad=True)
    out = module(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}
