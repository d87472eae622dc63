"""Compatibility with plugins and scripts written for upstream TE-FL (flagos-ai/TransformerEngine-FL).

What an upstream plugin uses, and what it means here:

- ``OpRegistry.register_impl(OpImpl(...))``: an impl under an upstream op name and signature is
  adapted onto the catalog op (:mod:`._adapters`) or, for an op TE-FL lacks, skipped with an
  :class:`UpstreamCompatWarning` naming what is missing (:mod:`._missing`); the rest of the plugin
  still registers. ``OpImpl(supported_dtypes=..., min_arch=...)`` and ``fn._is_available`` are
  honoured by the core (calls outside them go to the next backend, with the reason in ``explain``).
- ``get_manager()`` / ``get_registry()`` / ``reset_registry()``: the default manager (as an
  :class:`UpstreamManager`, whose ``call`` runs an upstream-style impl with the caller's arguments
  exactly as upstream does) and its registry.
- policy helpers upstream exports beside ours: ``policy_from_env``, ``get_policy_epoch``,
  ``bump_policy_epoch``, ``PREFER_DEFAULT`` / ``PREFER_VENDOR`` / ``PREFER_REFERENCE``,
  ``VALID_PREFER_VALUES``, ``match_token``; discovery: ``discover_plugin``,
  ``get_discovered_plugin``, ``clear_discovered_plugin``, ``PLUGIN_GROUP``, ``PLUGIN_MODULES_ENV``.
- ``TE_FL_PREFER_VENDOR`` and ``TE_FL_SKIP_CUDA`` are declared in ``core/envvars.py`` and read by
  ``core/config.py``.

All of these names are also importable from :mod:`transformer_engine.plugin.core`, where upstream
plugins import them. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core import discovery as _discovery
from ..core import policy as _policy
from ..core.devices import arg_key
from ..core.manager import OpManager, get_default_manager
from ..core.registry import OpRegistry
from ..core.types import BackendImplKind, OpImpl
from ._adapters import ADAPTERS, Adapter
from ._missing import MISSING
from ._translate import UpstreamCompatWarning, translate, upstream_function

__all__ = [
    "ADAPTERS",
    "MISSING",
    "PLUGIN_GROUP",
    "PLUGIN_MODULES_ENV",
    "PREFER_DEFAULT",
    "PREFER_REFERENCE",
    "PREFER_VENDOR",
    "UPSTREAM_NAMES",
    "UpstreamCompatWarning",
    "UpstreamManager",
    "VALID_PREFER_VALUES",
    "bump_policy_epoch",
    "clear_discovered_plugin",
    "discover_plugin",
    "get_discovered_plugin",
    "get_manager",
    "get_policy_epoch",
    "get_registry",
    "match_token",
    "policy_from_env",
    "porting_table",
    "reset_registry",
    "translate",
    "upstream_function",
]

PREFER_DEFAULT = "flagos"
PREFER_VENDOR = "vendor"
PREFER_REFERENCE = "reference"
VALID_PREFER_VALUES = frozenset({PREFER_DEFAULT, PREFER_VENDOR, PREFER_REFERENCE})
PLUGIN_GROUP = _discovery.ENTRY_POINT_GROUP
PLUGIN_MODULES_ENV = "TE_FL_PLUGIN_MODULES"


# -- manager and registry ----------------------------------------------------------------------------
class UpstreamManager:
    """The default :class:`OpManager` seen through upstream TE-FL's ``OpManager`` API.

    Every attribute is the wrapped manager's, except :meth:`call`: when the implementation the
    policy selects was registered upstream-style, it runs with the caller's arguments as given and
    its result is returned unchanged (upstream's behaviour); otherwise the catalog op runs.
    """

    def __init__(self, manager: OpManager):
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def call(self, op_name: str, *args, **kwargs) -> Any:
        """Run ``op_name`` (an upstream or catalog op name) through the selection policy."""
        adapter = ADAPTERS.get(op_name)
        ours = adapter.ours if adapter else op_name
        raw = self._upstream_head(ours, args, kwargs) if args else None
        if raw is not None:
            return raw(*args, **kwargs)
        return self._manager.call(ours, *args, **kwargs)

    def _upstream_head(self, op_name: str, args: tuple, kwargs: dict) -> Optional[Callable]:
        """The raw upstream function of the first candidate, when that candidate is upstream-style."""
        try:
            candidates, _ = self._manager.rank(op_name, arg_key(args[0]))
        except KeyError:
            return None
        return upstream_function(candidates[0].fn) if candidates else None

    def get_selected_impl_id(self, op_name: str, *args, **kwargs) -> str:
        """Upstream's name: the impl id :meth:`OpManager.select` picks for these (catalog-style) arguments."""
        return self._manager.select(op_name, *args, **kwargs).impl_id


def get_manager() -> UpstreamManager:
    """Upstream's ``get_manager()``: the process-wide manager (initialised on first use)."""
    return UpstreamManager(get_default_manager())


def get_registry() -> OpRegistry:
    """Upstream's ``get_registry()``: the default manager's registry, built-ins and plugins loaded."""
    manager = get_default_manager()
    manager.ensure_initialized()
    return manager.registry


def reset_registry() -> None:
    """Upstream's ``reset_registry()``: forget everything registered; reload built-ins and plugins on next use."""
    get_default_manager().reload()


# -- policy helpers ------------------------------------------------------------------------------------
_policy_epoch = 0


def policy_from_env() -> _policy.SelectionPolicy:
    """Upstream's name for :meth:`SelectionPolicy.from_env`."""
    return _policy.SelectionPolicy.from_env()


def get_policy_epoch() -> int:
    """Upstream's policy epoch. Caches here key on the policy itself, so only :func:`bump_policy_epoch` moves it."""
    return _policy_epoch


def bump_policy_epoch() -> int:
    """Upstream's "policy changed" signal: re-read the environment and drop the default manager's plans."""
    global _policy_epoch
    _policy_epoch += 1
    _policy.reset_global_policy()
    get_default_manager().clear_cache()
    return _policy_epoch


def match_token(impl: OpImpl, token: str) -> bool:
    """Upstream's ``match_token``: does selection token ``token`` (``flagos``, ``vendor:x``, ``impl:id``) name ``impl``?"""
    from ..core.config import parse_token

    token = parse_token(token)
    if token is None:
        return False
    if token.startswith("vendor:"):
        return impl.kind is BackendImplKind.VENDOR and impl.vendor == token[len("vendor:"):]
    if token.startswith("impl:"):
        return impl.impl_id == token[len("impl:"):]
    return impl.kind.value == token


# -- discovery --------------------------------------------------------------------------------------------
def discover_plugin(registry: OpRegistry) -> int:
    """Upstream's ``discover_plugin(registry)``: load entry points and ``TE_FL_PLUGIN_MODULES`` into ``registry``.

    Returns how many plugins loaded.
    """
    records = _discovery.load_plugins(registry)
    get_default_manager().plugin_records.extend(records)
    return sum(r.ok for r in records)


def get_discovered_plugin() -> List[Tuple[str, str, bool]]:
    """Upstream's ``(name, source, ok)`` records of the default manager's plugins."""
    manager = get_default_manager()
    manager.ensure_initialized()
    return [(r.name, r.source, r.ok) for r in manager.plugin_records if r.source != "builtin"]


def clear_discovered_plugin() -> None:
    """Forget the default manager's plugin records (its registrations stay)."""
    manager = get_default_manager()
    manager.plugin_records = [r for r in manager.plugin_records if r.source == "builtin"]


# -- the porting table --------------------------------------------------------------------------------------
def porting_table() -> List[Dict[str, str]]:
    """One row per upstream op: ``upstream``, ``ours`` (or ""), ``status`` (same/adapted/missing), ``note``."""
    rows = []
    for name, adapter in sorted(ADAPTERS.items()):
        status = "same" if _same_signature(adapter) else "adapted"
        rows.append({"upstream": name, "ours": adapter.ours, "status": status, "note": ""})
    for name, why in sorted(MISSING.items()):
        rows.append({"upstream": name, "ours": "", "status": "missing", "note": why})
    return sorted(rows, key=lambda r: r["upstream"])


def _same_signature(adapter: Adapter) -> bool:
    from ..core.catalog import get_spec

    return tuple(get_spec(adapter.ours).signature.parameters) == adapter.params and adapter.upstream == adapter.ours


UPSTREAM_NAMES = ("get_manager", "get_registry", "reset_registry", "policy_from_env", "get_policy_epoch",
                  "bump_policy_epoch", "match_token", "discover_plugin", "get_discovered_plugin",
                  "clear_discovered_plugin", "PLUGIN_GROUP", "PLUGIN_MODULES_ENV", "PREFER_DEFAULT", "PREFER_VENDOR",
                  "PREFER_REFERENCE", "VALID_PREFER_VALUES", "UpstreamCompatWarning")
"""The names :mod:`transformer_engine.plugin.core` re-exports from here (lazily)."""
