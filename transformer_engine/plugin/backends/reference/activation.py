"""Reference (pure PyTorch) activations. See plugin/catalog/activation.py for the contract.

All math is float32, cast back to x's dtype. Plain ops: y = act(x), dx = dy act'(x). Gated ops split
x = [a, b] in halves along the last dim: y = act(a) b, dx = [dy b act'(a), dy act(a)].

    gelu(x)  = 0.5 x (1 + tanh(u)),  u = k (x + 0.044715 x^3),  k = sqrt(2 / pi)
    gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) k (1 + 3 * 0.044715 x^2)
    qgelu(x) = x s, s = sigmoid(1.702 x);  qgelu'(x) = s + 1.702 x s (1 - s)
    silu(x)  = x s, s = sigmoid(x);        silu'(x)  = s + x s (1 - s)
    relu(x)  = max(x, 0), relu' = [x > 0];  srelu(x) = relu(x)^2, srelu' = 2 relu(x)
    sigmoid' = s (1 - s)  (glu)
    clamped_swiglu: a' = min(a, limit), b' = clip(b, -limit, limit), s = sigmoid(alpha a'),
                    y = a' s (b' + 1),
                    dx = [dy (b' + 1)(s + alpha a' s (1 - s)) [a <= limit], dy a' s [|b| <= limit]]
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from transformer_engine.plugin.backends._activation_ops import ACTIVATION_OP_NAMES, activation_ops, check_in_place, module_getattr
from transformer_engine.plugin.backends._checks import check_activation_dy, check_activation_input, check_activation_quantize

from .._fp8 import check_high_precision, quantize_fp32

__all__ = [*ACTIVATION_OP_NAMES, "activation_quantize", "dactivation_"]

_K_GELU = math.sqrt(2.0 / math.pi)
_QGELU_ALPHA = 1.702


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(_K_GELU * (x + 0.044715 * x * x * x)))


def _gelu_grad(x):
    t = torch.tanh(_K_GELU * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K_GELU * (1.0 + 3.0 * 0.044715 * x * x)


def _sigmoid_grad(x):
    s = torch.sigmoid(x)
    return s * (1.0 - s)


def _silu_grad(x):
    s = torch.sigmoid(x)
    return s + x * s * (1.0 - s)


def _qgelu(x):
    return x * torch.sigmoid(_QGELU_ALPHA * x)


def _qgelu_grad(x):
    s = torch.sigmoid(_QGELU_ALPHA * x)
    return s + _QGELU_ALPHA * x * s * (1.0 - s)


def _relu_grad(x):
    return (x > 0).to(x.dtype)


def _srelu(x):
    return torch.relu(x).square()


def _srelu_grad(x):
    return 2.0 * torch.relu(x)


class _Act(NamedTuple):
    """An elementwise activation on float32: value and derivative."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor], torch.Tensor]


_GELU, _QGELU = _Act(_gelu, _gelu_grad), _Act(_qgelu, _qgelu_grad)
_RELU, _SRELU = _Act(torch.relu, _relu_grad), _Act(_srelu, _srelu_grad)
_SILU, _SIGMOID = _Act(torch.nn.functional.silu, _silu_grad), _Act(torch.sigmoid, _sigmoid_grad)

_PLAIN = {"gelu": _GELU, "qgelu": _QGELU, "relu": _RELU, "srelu": _SRELU, "silu": _SILU}
_GATED = {"glu": _SIGMOID, "geglu": _GELU, "qgeglu": _QGELU, "reglu": _RELU, "sreglu": _SRELU, "swiglu": _SILU}


def _halves(x: torch.Tensor):
    """(a, b): the two halves of x's last dim (checked even by ``check_activation_input``)."""
    return x.chunk(2, dim=-1)


def _clamped_parts(x_f32, limit, alpha):
    a, b = _halves(x_f32)
    a_c, b_c = a.clamp(max=limit), b.clamp(-limit, limit)
    return a, b, a_c, b_c, torch.sigmoid(alpha * a_c)


def _forward_f32(op: str, x_f32: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """y = act(x) in float32 for any of the twelve forward ops."""
    if op in _PLAIN:
        return _PLAIN[op].fn(x_f32)
    if op in _GATED:
        a, b = _halves(x_f32)
        return _GATED[op].fn(a) * b
    _, _, a_c, b_c, s = _clamped_parts(x_f32, limit, alpha)
    return a_c * s * (b_c + 1.0)


def _backward_f32(op: str, dy: torch.Tensor, x_f32: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """dx in float32 for any of the twelve backward ops (``dy`` already float32)."""
    if op in _PLAIN:
        return dy * _PLAIN[op].grad(x_f32)
    if op in _GATED:
        a, b = _halves(x_f32)
        act = _GATED[op]
        return torch.cat([dy * b * act.grad(a), dy * act.fn(a)], dim=-1)
    a, b, a_c, b_c, s = _clamped_parts(x_f32, limit, alpha)
    da = dy * (b_c + 1.0) * (s + alpha * a_c * s * (1.0 - s)) * (a <= limit)
    return torch.cat([da, dy * a_c * s * (b.abs() <= limit)], dim=-1)


def _forward(op: str, x, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    check_activation_input(x, op, op not in _PLAIN)
    return _forward_f32(op, x.float(), limit, alpha).to(x.dtype)


def _backward(op: str, dy, x, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    check_activation_input(x, op, op not in _PLAIN)
    check_activation_dy(dy, x, op, op not in _PLAIN)
    return _backward_f32(op, dy.float(), x.float(), limit, alpha).to(x.dtype)


# the 24 activation ops (gelu, dgelu, ..., clamped_dswiglu), served as module attributes
__getattr__ = module_getattr(activation_ops(_forward, _backward), __name__)


def activation_quantize(x, activation, fp8_scale, fp8_dtype, limit=7.0, alpha=1.702, amax_out=None):
    """(q, scale_inv, amax) = quantize(act(x), fp8_scale, fp8_dtype, amax_out), act one of the twelve forward ops.

    act(x) is evaluated in float32 and quantized directly, without rounding to x's dtype first (as
    TE's fused kernels); for float32 x this is exactly quantize(<activation>(x)).

    Raises:
        ValueError: unknown activation, bad scale or fp8_dtype, or the activation's own input errors.
    """
    check_activation_quantize(x, activation, activation not in _PLAIN, fp8_scale, fp8_dtype, limit, alpha, amax_out)
    return quantize_fp32(_forward_f32(activation, x.float(), limit, alpha), fp8_scale, fp8_dtype, amax_out)


def dactivation_(dy, x, activation, limit=7.0, alpha=1.702):
    """x <- d<activation>(dy, x), computed as the backward op and copied over x.

    Raises:
        ValueError: unknown activation, x not contiguous, or the backward op's own input errors.
    """
    check_high_precision(x)
    check_in_place(x, activation, limit, alpha)
    return x.copy_(_backward(activation, dy, x, limit, alpha))
