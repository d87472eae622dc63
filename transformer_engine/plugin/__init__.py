"""The operator dispatch layer: every numeric kernel of TE-FL is an op of one catalog.

- :mod:`.core` (no torch): catalog, registry, policy, manager, plugin discovery;
- :mod:`.catalog`: the built-in op declarations with their math;
- :mod:`.backends`: ``reference`` (pure PyTorch), ``flagos`` (Triton), ``vendor.cuda``;
- :data:`ops`: one dispatcher per op, bound to the default manager.
"""

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
]
