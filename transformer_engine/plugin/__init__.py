"""The operator dispatch layer: every numeric kernel of TE-FL is an op of one catalog.

- :mod:`.core` (no torch): catalog, registry, policy, manager, plugin discovery;
- :mod:`.catalog`: the built-in op declarations with their math;
- :mod:`.backends`: ``reference`` (pure PyTorch), ``flagos`` (Triton), ``vendor.cuda``;
- :data:`ops`: one dispatcher per op, bound to the default manager.
"""

from types import SimpleNamespace

from . import core
from ._ops import OpNamespace
from .core import (
    BackendImplKind,
    Capabilities,
    OpImpl,
    OpManager,
    OpRegistry,
    SelectionPolicy,
    get_default_manager,
    reset_default_manager,
)

ops = OpNamespace()


def explain(op_name: str, *args, **kwargs):
    """Which implementation the default manager runs for this call, and why not the others."""
    return get_default_manager().explain(op_name, *args, **kwargs)


def runs_as_aten(op_name: str, device, dtype) -> bool:
    """True when the default manager's first choice for ``op_name`` on a key argument of ``device`` and ``dtype`` is
    exactly PyTorch's own operator (see :meth:`OpManager.runs_as_aten`). Under ``torch.compile`` a constant of the
    trace: a later change of policy reaches compiled code once it is traced again."""
    return get_default_manager().runs_as_aten(op_name, SimpleNamespace(device=device, dtype=dtype))


# what torch._dynamo.assume_constant_result sets, without importing Dynamo for eager users
runs_as_aten._dynamo_marked_constant = True


def describe(device_type: str = "cpu", dtype=None):
    """Static dispatch table of the default manager for a device type (see OpManager.describe)."""
    return get_default_manager().describe(device_type, dtype)


__all__ = [
    "BackendImplKind",
    "Capabilities",
    "OpImpl",
    "OpManager",
    "OpRegistry",
    "SelectionPolicy",
    "core",
    "describe",
    "explain",
    "get_default_manager",
    "ops",
    "reset_default_manager",
    "runs_as_aten",
]
