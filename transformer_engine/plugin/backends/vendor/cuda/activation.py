"""PyTorch's own element-wise activations as the catalog's ``gelu`` / ``silu`` and their derivatives.

    gelu(x)  = F.gelu(x, approximate="tanh")      dgelu(dy, x) = aten.gelu_backward(dy, x, approximate="tanh")
    silu(x)  = F.silu(x)                          dsilu(dy, x) = aten.silu_backward(dy, x)

The math is the catalog's (plugin/catalog/activation.py: float32 inside, one rounding to x's dtype), and the
kernels run as fast as the flagos ones (docs/performance.md). What they add is on the host: where the policy puts
them first, a high-precision activation in a module runs as PyTorch's own autograd node (``ATEN_DTYPES``: the
modules call ``F.gelu`` / ``F.silu`` themselves, see ``pytorch/_functions/activation_function.py``) instead of a
Python ``autograd.Function``. ReLU is not here: PyTorch's backward passes dy where x is NaN (``threshold_backward``),
the catalog's ``drelu`` gives 0 there. A backward whose dy and x differ in dtype is declined (PyTorch would promote
the result to float32; the catalog returns x's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer_engine.plugin.backends._checks import check_activation_dy, check_activation_input
from transformer_engine.plugin.core import Reject

__all__ = ["gelu", "dgelu", "silu", "dsilu"]

_FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})


def gelu(x):
    """y = gelu_tanh(x), a new contiguous tensor of x's dtype."""
    check_activation_input(x, "gelu", gated=False)
    return F.gelu(x.contiguous(), approximate="tanh")


def dgelu(dy, x):
    """dx = dy * gelu_tanh'(x), a new contiguous tensor of x's dtype."""
    check_activation_input(x, "gelu", gated=False)
    check_activation_dy(dy, x, "gelu", gated=False)
    return torch.ops.aten.gelu_backward(dy.contiguous(), x.contiguous(), approximate="tanh")


def silu(x):
    """y = x * sigmoid(x), a new contiguous tensor of x's dtype."""
    check_activation_input(x, "silu", gated=False)
    return F.silu(x.contiguous())


def dsilu(dy, x):
    """dx = dy * (s + x s (1 - s)), s = sigmoid(x), a new contiguous tensor of x's dtype."""
    check_activation_input(x, "silu", gated=False)
    check_activation_dy(dy, x, "silu", gated=False)
    return torch.ops.aten.silu_backward(dy.contiguous(), x.contiguous())


def _same_dtype(dy, x):
    """True, or a Reject when dy and x differ in dtype (PyTorch's backward would return float32)."""
    if getattr(dy, "dtype", None) != getattr(x, "dtype", None):
        return Reject(f"dy ({getattr(dy, 'dtype', None)}) and x ({getattr(x, 'dtype', None)}) differ in dtype")
    return True


SUPPORTS = {"dgelu": _same_dtype, "dsilu": _same_dtype}
ATEN_DTYPES = {name: _FLOATS for name in __all__}
