"""The torch-free core of the dispatch layer: types, catalog, registry, policy, manager, discovery.

Example (an in-tree or out-of-tree backend registering one op)::

    from transformer_engine.plugin.core import OpRegistry, OpManager, OpImpl, BackendImplKind

    def my_gelu(x): ...
    registry = OpRegistry()
    registry.register(OpImpl(op_name="gelu", impl_id="vendor.x", kind=BackendImplKind.VENDOR,
                             fn=my_gelu, vendor="x"))
    manager = OpManager(registry, load_builtins=False, discover=False)
"""

from .catalog import CatalogError, OpSpec, declare, get_spec, list_specs
from .config import EnvConfig, PolicyConfigWarning, load_env
from .devices import arg_key, compute_capability, register_capability_probe
from .discovery import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, PluginRecord
from .manager import (
    Decision,
    FallbackWarning,
    NoImplementationError,
    OpManager,
    Reject,
    get_default_manager,
    reset_default_manager,
)
from .policy import (
    SelectionPolicy,
    get_policy,
    policy_context,
    reset_global_policy,
    set_global_policy,
    with_allowed_vendors,
    with_denied_vendors,
    with_preference,
    with_strict_mode,
)
from .registry import OpRegistry, RegistrationError
from .types import ArgKey, BackendImplKind, Capabilities, OpImpl

__all__ = [
    "ArgKey",
    "BackendImplKind",
    "Capabilities",
    "CatalogError",
    "Decision",
    "ENTRY_POINT_GROUP",
    "EnvConfig",
    "FallbackWarning",
    "NoImplementationError",
    "OpImpl",
    "OpManager",
    "OpRegistry",
    "OpSpec",
    "PLUGIN_API_VERSION",
    "PluginRecord",
    "PolicyConfigWarning",
    "RegistrationError",
    "Reject",
    "SelectionPolicy",
    "arg_key",
    "compute_capability",
    "declare",
    "get_default_manager",
    "get_policy",
    "get_spec",
    "list_specs",
    "load_env",
    "policy_context",
    "register_capability_probe",
    "reset_default_manager",
    "reset_global_policy",
    "set_global_policy",
    "with_allowed_vendors",
    "with_denied_vendors",
    "with_preference",
    "with_strict_mode",
]

_UPSTREAM_NAMES = frozenset({
    "get_manager", "get_registry", "reset_registry", "policy_from_env", "get_policy_epoch", "bump_policy_epoch",
    "match_token", "discover_plugin", "get_discovered_plugin", "clear_discovered_plugin", "PLUGIN_GROUP",
    "PLUGIN_MODULES_ENV", "PREFER_DEFAULT", "PREFER_VENDOR", "PREFER_REFERENCE", "VALID_PREFER_VALUES",
    "UpstreamCompatWarning",
})


def __getattr__(name):
    """Upstream TE-FL's names (``get_manager``, ``get_registry``, ...), served by :mod:`transformer_engine.plugin.compat`."""
    if name in _UPSTREAM_NAMES:
        from .. import compat

        return getattr(compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
