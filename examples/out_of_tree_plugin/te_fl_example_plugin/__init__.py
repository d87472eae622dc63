"""A toy out-of-tree TE-FL backend: ``gelu`` and ``dgelu`` in plain PyTorch, counting its calls.

It shows the whole plugin contract in one file:

- a ``register(registry)`` hook, found through the entry point group ``te_fl.plugin`` (see this
  package's pyproject.toml) or through ``TE_FL_PLUGIN_MODULES=te_fl_example_plugin``;
- functions whose signatures equal the catalog's (``gelu(x)``, ``dgelu(dy, x)``,
  transformer_engine/plugin/catalog/activation.py), registered as vendor ``"example"``;
- ``TE_FL_PLUGIN_API_VERSION``, checked against the plugin API of the installed TE-FL;
- a ``supports`` predicate that declines with a :class:`Reject` reason (shown by ``te-fl info``
  and ``transformer_engine.plugin.explain``).

The backend is *opt-in*: it runs an op only when the selection policy names it for that op, e.g.
``TE_FL_PER_OP="gelu=vendor:example;dgelu=vendor:example"``. Installing it therefore never changes
what runs by default. Math (tanh approximation, as the catalog):
gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi).

Try it (from the repository root)::

    pip install -e examples/out_of_tree_plugin
    TE_FL_PER_OP="gelu=vendor:example" python -c "
    import torch, te_fl_example_plugin as p
    from transformer_engine.plugin import ops
    ops.gelu(torch.randn(4)); print(p.CALLS)"
"""

import math
from collections import Counter

import torch

from transformer_engine.plugin.core import BackendImplKind, OpImpl, Reject, get_policy

__all__ = ["CALLS", "IMPL_ID", "TE_FL_PLUGIN_API_VERSION", "VENDOR", "dgelu", "gelu", "register"]

TE_FL_PLUGIN_API_VERSION = "1.0"
VENDOR = "example"
IMPL_ID = "vendor.example"

CALLS: Counter = Counter()
"""How many times each op of this backend ran in this process (``CALLS["gelu"]``)."""

_K = math.sqrt(2.0 / math.pi)  # k of the tanh approximation
_C = 0.044715  # cubic coefficient of the tanh approximation


def gelu(x):
    """y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), computed in float32, returned in x's dtype.

    Args:
        x: input tensor of any shape.

    Returns:
        gelu(x), same shape and dtype as ``x``.
    """
    CALLS["gelu"] += 1
    x32 = x.float()
    y = 0.5 * x32 * (1.0 + torch.tanh(_K * (x32 + _C * x32**3)))
    return y.to(x.dtype)


def dgelu(dy, x):
    """dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2)), t = tanh(k (x + 0.044715 x^3)).

    Args:
        dy: gradient of the output, shape of ``x``.
        x: the forward input.

    Returns:
        dx, same shape and dtype as ``x``.
    """
    CALLS["dgelu"] += 1
    x32 = x.float()
    t = torch.tanh(_K * (x32 + _C * x32**3))
    dgelu_dx = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * x32 * x32)
    return (dy.float() * dgelu_dx).to(x.dtype)


def _opt_in(op_name):
    """A ``supports`` predicate: accept only when the policy names this backend for ``op_name``."""
    wanted = {f"vendor:{VENDOR}", f"impl:{IMPL_ID}"}
    reason = f"opt-in backend: select it with TE_FL_PER_OP='{op_name}=vendor:{VENDOR}'"

    def supports(*args, **kwargs):
        named = dict(get_policy().per_op_order).get(op_name, ())
        return True if wanted.intersection(named) else Reject(reason)

    return supports


def register(registry):
    """The plugin hook: register this backend's ops (TE-FL commits them all or none)."""
    for fn in (gelu, dgelu):
        registry.register(
            OpImpl(
                op_name=fn.__name__,
                impl_id=IMPL_ID,
                kind=BackendImplKind.VENDOR,
                vendor=VENDOR,
                fn=fn,
                supports=_opt_in(fn.__name__),
                description="toy plain-PyTorch example plugin (counts its calls)",
            )
        )
