"""Loading backends: the in-tree ones, entry-point plugins and ``TE_FL_PLUGIN_MODULES``.

A plugin is a callable ``hook(registry)`` or an object (usually a module) with ``te_fl_register`` or
``register``. The hook receives a staging registry: what it registers is committed atomically
when it returns, and nothing at all if it raises. Every load is recorded in a
:class:`PluginRecord`, with the error when it failed; no failure escapes to the caller, so a broken
plugin can never break ``import transformer_engine``.

An optional ``TE_FL_PLUGIN_API_VERSION`` attribute on the plugin is checked against
:data:`PLUGIN_API_VERSION` (same major version required).
"""

from __future__ import annotations

import importlib
import logging
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, List, Optional, Tuple

from .config import load_env

__all__ = ["PluginRecord", "load_plugins", "load_builtin_backends", "load_hook", "ENTRY_POINT_GROUP", "PLUGIN_API_VERSION", "BUILTIN_BACKENDS"]

logger = logging.getLogger("transformer_engine.plugin")

ENTRY_POINT_GROUP = "te_fl.plugin"
_SOURCE_NAMES = {"env": "TE_FL_PLUGIN_MODULES", "entry_point": "entry-point"}
_TRACEBACK_HINT = "Set TE_FL_LOG_LEVEL=DEBUG to log the traceback; `te-fl info` lists every plugin's status"
PLUGIN_API_VERSION = (1, 0)
BUILTIN_BACKENDS: Tuple[str, ...] = (
    "transformer_engine.plugin.backends.reference",
    "transformer_engine.plugin.backends.flagos",
    "transformer_engine.plugin.backends.vendor.cuda",
)


@dataclass
class PluginRecord:
    """What happened when one backend or plugin was loaded."""

    name: str
    source: str  # "builtin", "entry_point" or "env"
    ok: bool
    error: Optional[str] = None
    impl_ids: List[str] = field(default_factory=list)
    ops: int = 0


class _StagingRegistry:
    """Collects a hook's registrations so they can be committed atomically."""

    def __init__(self, target):
        self._target = target
        self.staged: List[Any] = []

    def register(self, impl, *, override: bool = False) -> bool:
        self.staged.append((impl, override))
        return True

    def register_impl(self, impl, *, override: bool = False) -> bool:
        """Upstream TE-FL's name: an upstream-style impl is adapted first (or skipped with a warning)."""
        from .registry import translate_upstream

        impl = translate_upstream(impl)
        return False if impl is None else self.register(impl, override=override)

    def register_many(self, impls, *, override: bool = False) -> int:
        impls = list(impls)
        self.staged += [(impl, override) for impl in impls]
        return len(impls)

    _QUERIES = frozenset({"get_implementations", "get_implementation", "list_operators", "impl_ids", "epoch"})

    def __getattr__(self, name):
        # queries read the real registry; anything that mutates it would bypass the atomic commit
        if name in self._QUERIES:
            return getattr(self._target, name)
        raise AttributeError(f"a plugin hook may only register impls; registry.{name} is not available during registration")


def load_hook(registry, hook: Any, name: str, source: str) -> PluginRecord:
    """Run one plugin hook against ``registry`` atomically and record the outcome."""
    try:
        _check_api_version(hook, name)
        fn = hook if callable(hook) and not isinstance(hook, type) else None
        if fn is None:
            fn = getattr(hook, "te_fl_register", None) or getattr(hook, "register", None)
        if fn is None:
            raise TypeError(f"plugin {name!r} is neither callable nor has te_fl_register/register")
        staging = _StagingRegistry(registry)
        fn(staging)
        registry._register_pairs(staging.staged)  # all of the hook's impls, or none
        impls = [impl for impl, _override in staging.staged]
        record = PluginRecord(name, source, ok=True, error=None, impl_ids=sorted({i.impl_id for i in impls}), ops=len(impls))
        logger.info("TE-FL: loaded %s %s (%d impls)", source, name, len(impls))
        return record
    except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, never raised
        # a built-in backend whose dependency is absent here (no triton, no GPU) is normal: INFO
        if source == "builtin":
            logger.info("TE-FL: builtin backend %s failed to load: %s: %s", name, type(exc).__name__, exc)
        else:
            logger.warning("TE-FL: %s plugin %s failed to register, so its ops will not run: %s: %s. %s",
                           _SOURCE_NAMES.get(source, source), name, type(exc).__name__, exc, _TRACEBACK_HINT)
        logger.debug("%s", traceback.format_exc())
        return PluginRecord(name, source, ok=False, error=f"{type(exc).__name__}: {exc}")


def _check_api_version(hook: Any, name: str) -> None:
    version = getattr(hook, "TE_FL_PLUGIN_API_VERSION", None)
    if version is None:
        return
    major = int(str(version).split(".")[0]) if not isinstance(version, tuple) else int(version[0])
    if major != PLUGIN_API_VERSION[0]:
        raise RuntimeError(f"plugin {name!r} targets plugin API {version}, this TE-FL provides {PLUGIN_API_VERSION[0]}.x")


def _import_and_load(registry, module_name: str, source: str) -> PluginRecord:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001
        if source == "builtin":  # a dependency absent here (no triton, no GPU) is normal: INFO
            logger.info("TE-FL: builtin backend %s not loaded: %s: %s", module_name, type(exc).__name__, exc)
        else:  # the user asked for this plugin: say that it will not run, and why
            logger.warning("TE-FL: %s plugin %s failed to import, so its ops will not run: %s: %s. %s",
                           _SOURCE_NAMES.get(source, source), module_name, type(exc).__name__, exc, _TRACEBACK_HINT)
        logger.debug("%s", traceback.format_exc())
        return PluginRecord(module_name, source, ok=False, error=f"{type(exc).__name__}: {exc}")
    return load_hook(registry, module, module_name, source)


_CUDA_BACKEND = "transformer_engine.plugin.backends.vendor.cuda"


def load_builtin_backends(registry, skip_cuda: bool = False) -> List[PluginRecord]:
    """Register the in-tree backends; one that cannot load (no torch, no triton) is recorded.

    With ``skip_cuda`` (``TE_FL_SKIP_CUDA=1``) the CUDA vendor backend is not loaded and its record says so.
    """
    records = []
    for name in BUILTIN_BACKENDS:
        if skip_cuda and name == _CUDA_BACKEND:
            logger.info("TE-FL: builtin backend %s skipped: TE_FL_SKIP_CUDA=1", name)
            records.append(PluginRecord(name, "builtin", ok=False, error="skipped: TE_FL_SKIP_CUDA=1"))
            continue
        records.append(_import_and_load(registry, name, "builtin"))
    return records


def load_plugins(registry, env_modules: Optional[Tuple[str, ...]] = None) -> List[PluginRecord]:
    """Load entry points of group ``te_fl.plugin``, then the modules in ``TE_FL_PLUGIN_MODULES``."""
    records: List[PluginRecord] = []
    try:
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # noqa: BLE001
        entry_points = []
        records.append(PluginRecord(ENTRY_POINT_GROUP, "entry_point", ok=False, error=f"listing entry points failed: {exc}"))
    for ep in sorted(entry_points, key=lambda e: e.name):
        try:
            hook = ep.load()
        except Exception as exc:  # noqa: BLE001
            logger.warning("TE-FL: entry point %s failed to import, so its ops will not run: %s: %s. %s",
                           ep.name, type(exc).__name__, exc, _TRACEBACK_HINT)
            logger.debug("%s", traceback.format_exc())
            records.append(PluginRecord(ep.name, "entry_point", ok=False, error=f"{type(exc).__name__}: {exc}"))
            continue
        records.append(load_hook(registry, hook, ep.name, "entry_point"))
    modules = load_env().plugin_modules if env_modules is None else env_modules
    records += [_import_and_load(registry, name, "env") for name in modules]
    return records
