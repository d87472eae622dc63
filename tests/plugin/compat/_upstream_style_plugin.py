"""A test fixture: a minimal out-of-tree plugin written the way upstream TE-FL's examples are.

Upstream-style on purpose: upstream op names and signatures (``rmsnorm_fwd(input, weight, eps=1e-5,
**kwargs) -> (output, rsigma)``, ``gelu(input, quantizer)``, ``dgelu(grad, fwd_input, quantizer)``),
``register_impl`` with ``supported_dtypes``, an ``fn._is_available`` probe, and one op TE-FL does not
have (``get_cudnn_version``). Every function counts its calls in ``CALLS``.
"""

import math
from collections import Counter

import torch

from transformer_engine.plugin.core import BackendImplKind, OpImpl

CALLS = Counter()
_K = math.sqrt(2.0 / math.pi)


def my_rmsnorm_fwd(input, weight, eps=1e-5, **kwargs):
    CALLS["rmsnorm_fwd"] += 1
    x = input.float()
    rsigma = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * rsigma * weight.float()).to(input.dtype), rsigma


my_rmsnorm_fwd._is_available = lambda: True


def my_gelu(input, quantizer):
    CALLS["gelu"] += 1
    x = input.float()
    return (0.5 * x * (1.0 + torch.tanh(_K * (x + 0.044715 * x**3)))).to(input.dtype)


def my_dgelu(grad, fwd_input, quantizer):
    CALLS["dgelu"] += 1
    x = fwd_input.float()
    t = torch.tanh(_K * (x + 0.044715 * x**3))
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K * (1.0 + 3 * 0.044715 * x * x)
    return (grad.float() * d).to(fwd_input.dtype)


def my_cudnn_version():
    return 90000


def register(registry):
    for op, fn in (("rmsnorm_fwd", my_rmsnorm_fwd), ("gelu", my_gelu), ("dgelu", my_dgelu),
                   ("get_cudnn_version", my_cudnn_version)):
        registry.register_impl(OpImpl(
            op_name=op,
            impl_id="vendor.upstreamstyle",
            kind=BackendImplKind.VENDOR,
            vendor="upstreamstyle",
            fn=fn,
            priority=200,
            supported_dtypes={"float32", "bfloat16"},
        ))
