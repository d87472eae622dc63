"""A toy out-of-tree backend written the way upstream TE-FL's plugin examples write one.

Nothing in this file knows about TE-FL's own catalog: it uses upstream TE-FL's
(flagos-ai/TransformerEngine-FL) registration API and upstream's op names and signatures, and
TE-FL's compatibility layer (``transformer_engine/plugin/compat/``) adapts it onto the catalog:

- ``registry.register_impl(OpImpl(...))`` with upstream's fields ``priority``, ``supported_dtypes``
  and ``min_arch``;
- an availability probe on every function, ``fn._is_available()``;
- upstream op signatures: ``rmsnorm_fwd(input, weight, eps=1e-5, **kwargs) -> (output, rsigma)``
  (as upstream's README), ``rmsnorm_bwd(dy, x, rsigma, gamma, sm_margin=0, zero_centered_gamma=False,
  eps=1e-5) -> (dx, dgamma)``, ``swiglu(input, quantizer)`` and ``dswiglu(grad, fwd_input, quantizer)``.

The math is plain PyTorch in float32, so the backend runs on the CPU. With a = x[..., :F], b = x[..., F:]:

    rmsnorm:  rsigma = 1 / sqrt(mean(x^2) + eps),  y = x * rsigma * gamma
              dx = rsigma * (g - x_hat * mean(g * x_hat)),  g = dy * gamma,  x_hat = x * rsigma,
              dgamma = sum_rows(dy * x_hat)
    swiglu:   y = silu(a) * b
              da = dy * b * sigmoid(a) * (1 + a (1 - sigmoid(a))),  db = dy * silu(a)

The probe stands in for a real device check (``torch_myvendor.is_available()``): it returns True only
when ``MYVENDOR_AVAILABLE=1``, so installing the example never changes what runs by default.
Every op counts its calls in :data:`CALLS`.
"""

import os
from collections import Counter

import torch

from transformer_engine.plugin.core import BackendImplKind, OpImpl

__all__ = ["AVAILABLE_ENV", "CALLS", "IMPL_ID", "VENDOR", "register"]

VENDOR = "myvendor"
IMPL_ID = "vendor.myvendor"
AVAILABLE_ENV = "MYVENDOR_AVAILABLE"

CALLS: Counter = Counter()
"""How many times each op of this backend ran in this process (``CALLS["rmsnorm_fwd"]``)."""


def _is_available():
    """Upstream's availability probe: can this backend run in this process?"""
    return os.environ.get(AVAILABLE_ENV, "0") == "1"


def my_rmsnorm_fwd(input, weight, eps=1e-5, **kwargs):
    """rsigma = 1 / sqrt(mean(x^2) + eps), y = x * rsigma * gamma, in float32.

    Args:
        input: [..., H] activations.
        weight: gamma, [H].
        eps: added to the mean square.
        **kwargs: upstream's other arguments (ln_out, quantizer, otype, ...), unused here.

    Returns:
        (output like ``input``, rsigma as float32 [..., 1]).
    """
    CALLS["rmsnorm_fwd"] += 1
    x = input.float()
    rsigma = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * rsigma * weight.float()).to(input.dtype), rsigma


def my_rmsnorm_bwd(dy, x, rsigma, gamma, sm_margin=0, zero_centered_gamma=False, eps=1e-5):
    """dx = rsigma * (g - x_hat * mean(g * x_hat)), dgamma = sum_rows(dy * x_hat), g = dy * gamma.

    Args:
        dy: gradient of the output, shape of ``x``.
        x: the forward input, [..., H].
        rsigma: the forward's 1 / rms, one per row (shape ``x.shape[:-1]``).
        gamma: the weight, [H]; the effective weight is ``1 + gamma`` when ``zero_centered_gamma``.
        sm_margin: SMs to leave free (a CUDA launch hint), unused here.
        zero_centered_gamma: whether gamma is stored as ``weight - 1``.
        eps: unused (rsigma already holds it); kept for upstream's signature.

    Returns:
        (dx like ``x``, dgamma like ``gamma``).
    """
    CALLS["rmsnorm_bwd"] += 1
    x32, dy32 = x.float(), dy.float()
    x_hat = x32 * rsigma.float().reshape(*x.shape[:-1], 1)
    g = dy32 * (gamma.float() + 1.0 if zero_centered_gamma else gamma.float())
    dx = rsigma.float().reshape(*x.shape[:-1], 1) * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dgamma = (dy32 * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def my_swiglu(input, quantizer):
    """y = silu(a) * b with [a, b] = input split in halves along the last dim.

    Args:
        input: [..., 2F].
        quantizer: upstream's output quantizer; this backend produces high precision only.

    Returns:
        [..., F], dtype of ``input``.
    """
    CALLS["swiglu"] += 1
    a, b = input.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def my_dswiglu(grad, fwd_input, quantizer):
    """[da, db] = [dy * b * sigmoid(a) * (1 + a (1 - sigmoid(a))), dy * silu(a)].

    Args:
        grad: dy, [..., F].
        fwd_input: the forward input [a, b], [..., 2F].
        quantizer: upstream's output quantizer, unused here.

    Returns:
        [..., 2F], dtype of ``fwd_input``.
    """
    CALLS["dswiglu"] += 1
    a, b = fwd_input.float().chunk(2, dim=-1)
    dy, s = grad.float(), torch.sigmoid(a)
    da = dy * b * s * (1.0 + a * (1.0 - s))
    db = dy * a * s
    return torch.cat([da, db], dim=-1).to(fwd_input.dtype)


_OPS = {
    "rmsnorm_fwd": my_rmsnorm_fwd,
    "rmsnorm_bwd": my_rmsnorm_bwd,
    "swiglu": my_swiglu,
    "dswiglu": my_dswiglu,
}
for _fn in _OPS.values():
    _fn._is_available = _is_available


def register(registry):
    """The plugin hook TE-FL calls (entry point ``te_fl.plugin`` or ``TE_FL_PLUGIN_MODULES``)."""
    for op_name, fn in _OPS.items():
        registry.register_impl(OpImpl(
            op_name=op_name,
            impl_id=IMPL_ID,
            kind=BackendImplKind.VENDOR,
            vendor=VENDOR,
            fn=fn,
            priority=200,
            supported_dtypes={"float32", "bfloat16"},
            min_arch="sm_80",
        ))
