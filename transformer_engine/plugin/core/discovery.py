"""Loading backends: the host's built-in ones, entry-point plugins and ``TE_FL_PLUGIN_MODULES``.

The core names no backend: the built-in ones are those the bootstrap hook lists (:func:`builtin_provider`:
the ``builtin`` module beside the core package, or a provider registered with :func:`set_builtin_provider`).

A plugin is a callable ``hook(registry)`` or an object (usually a module) with ``te_fl_register`` or
``register``. The hook receives a staging registry: what it registers is committed atomically
when it returns, and nothing at all if it raises. Every load is recorded in a
:class:`PluginRecord`, with the error when it failed; no failure escapes to the caller, so a broken
plugin can never break ``import transformer_engine``.

An optional ``TE_FL_PLUGIN_API_VERSION`` attribute on the plugin is checked against
:data:`PLUGIN_API_VERSION` (same major version required). An optional ``TE_FL_MEASURED_PER_OP``
attribute (:data:`MEASURED_PER_OP_ATTR`), ``{op: tokens}``, declares the ops for which the plugin's
backend was measured faster than the default kind: it is stored with the plugin's impls (per registry,
:func:`measured_per_op`), and under the default preference the policy tries those tokens first
(:meth:`~.policy.SelectionPolicy.order_for`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

from .config import EnvConfig, load_env
from .policy import check_measured_per_op

__all__ = [
    "PluginRecord",
    "load_plugins",
    "load_builtin_backends",
    "load_hook",
    "builtin_provider",
    "set_builtin_provider",
    "measured_per_op",
    "forget_measured_per_op",
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "BOOTSTRAP_HOOK",
    "MEASURED_PER_OP_ATTR",
]

logger = logging.getLogger("transformer_engine.plugin")

ENTRY_POINT_GROUP = "te_fl.plugin"
_SOURCE_NAMES = {"env": "TE_FL_PLUGIN_MODULES", "entry_point": "entry-point"}
_TRACEBACK_HINT = "Set TE_FL_LOG_LEVEL=DEBUG to log the traceback; `te-fl info` lists every plugin's status"
PLUGIN_API_VERSION = (1, 0)
#: The bootstrap hook: the module beside the core package (``<package of the core>.builtin``) whose
#: ``builtin_backends(cfg)`` lists the host's built-in backends (see :func:`builtin_provider`).
BOOTSTRAP_HOOK = "builtin"
#: The plugin attribute that declares measured per-op orders (see the module docstring).
MEASURED_PER_OP_ATTR = "TE_FL_MEASURED_PER_OP"

#: A provider of built-in backends: ``provider(cfg) -> ((module, why skipped or None), ...)``.
BuiltinProvider = Callable[[EnvConfig], Iterable[Tuple[str, Optional[str]]]]
_builtin_provider: Optional[BuiltinProvider] = None
_NO_ORDERS: Mapping[str, Tuple[str, ...]] = MappingProxyType({})
_measured: "weakref.WeakKeyDictionary[Any, Mapping[str, Tuple[str, ...]]]" = weakref.WeakKeyDictionary()
_measured_lock = threading.Lock()


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
        declared = _declared_orders(hook, name)  # checked before anything is registered
        staging = _StagingRegistry(registry)
        fn(staging)
        # the orders first, so that a plan built for the new impls sees them; both, or neither
        previous = _add_measured(registry, declared) if declared else None
        try:
            registry._register_pairs(staging.staged)  # all of the hook's impls, or none
        except Exception:
            if declared:
                _restore_measured(registry, previous)
            raise
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


def _declared_orders(hook: Any, name: str) -> Mapping[str, Tuple[str, ...]]:
    table = getattr(hook, MEASURED_PER_OP_ATTR, None)
    if table is None:
        return _NO_ORDERS
    try:
        return check_measured_per_op(table)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"plugin {name!r}: {MEASURED_PER_OP_ATTR}: {exc}") from None


def _add_measured(registry, declared: Mapping[str, Tuple[str, ...]]) -> Optional[Mapping[str, Tuple[str, ...]]]:
    """Merge ``declared`` into ``registry``'s orders (a later declaration of an op wins); returns the old ones."""
    with _measured_lock:
        previous = _measured.get(registry)
        _measured[registry] = MappingProxyType({**(previous or {}), **declared})  # replaced whole, never mutated
        return previous


def _restore_measured(registry, previous: Optional[Mapping[str, Tuple[str, ...]]]) -> None:
    with _measured_lock:
        if previous is None:
            _measured.pop(registry, None)
        else:
            _measured[registry] = previous


def measured_per_op(registry) -> Mapping[str, Tuple[str, ...]]:
    """``{op: tokens}`` that the plugins loaded into ``registry`` declared in ``TE_FL_MEASURED_PER_OP`` (read-only)."""
    try:
        return _measured.get(registry, _NO_ORDERS)
    except TypeError:  # a registry that cannot be weakly referenced never had orders stored
        return _NO_ORDERS


def forget_measured_per_op(registry) -> None:
    """Drop ``registry``'s declared orders (its impls were cleared)."""
    _restore_measured(registry, None)


def _reinit_lock_after_fork() -> None:
    global _measured_lock
    _measured_lock = threading.Lock()


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


def set_builtin_provider(provider: Optional[BuiltinProvider]) -> Optional[BuiltinProvider]:
    """Make ``provider`` list the built-in backends (None: the bootstrap hook again); returns the previous one.

    ``provider(cfg)`` gets the validated environment (:class:`~.config.EnvConfig`) and returns
    ``((module, why it is skipped, or None), ...)``, in load order.
    """
    global _builtin_provider
    previous, _builtin_provider = _builtin_provider, provider
    return previous


def builtin_provider() -> BuiltinProvider:
    """The provider of the built-in backends: the one set by :func:`set_builtin_provider`, else the bootstrap
    hook's ``builtin_backends`` (module :data:`BOOTSTRAP_HOOK` beside the core package).

    Raises:
        ImportError, AttributeError: no provider was set and the hook is missing.
    """
    provider = _builtin_provider
    if provider is None:
        provider = importlib.import_module(f"..{BOOTSTRAP_HOOK}", __package__).builtin_backends
    return provider


def load_builtin_backends(registry, cfg: Optional[EnvConfig] = None, provider: Optional[BuiltinProvider] = None) -> List[PluginRecord]:
    """Register the built-in backends that ``provider`` (by default :func:`builtin_provider`) lists for the
    environment ``cfg`` (by default :func:`~.config.load_env`); one that cannot load (no torch, no triton),
    or that the provider skips (its record says why), is recorded, and so is a missing provider."""
    cfg = load_env() if cfg is None else cfg
    try:
        backends = list((provider or builtin_provider())(cfg))
    except Exception as exc:  # noqa: BLE001 - like a backend that cannot load: recorded, never raised
        name = f"{__package__.rpartition('.')[0]}.{BOOTSTRAP_HOOK}"
        logger.info("TE-FL: no builtin backends: %s: %s", type(exc).__name__, exc)
        return [PluginRecord(name, "builtin", ok=False, error=f"{type(exc).__name__}: {exc}")]
    records = []
    for name, skipped in backends:
        if skipped:
            logger.info("TE-FL: builtin backend %s skipped: %s", name, skipped)
            records.append(PluginRecord(name, "builtin", ok=False, error=f"skipped: {skipped}"))
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


def __getattr__(name: str):
    """``BUILTIN_BACKENDS``: the modules of the built-in backends, as the bootstrap hook lists them."""
    if name == "BUILTIN_BACKENDS":
        return tuple(module for module, _skipped in builtin_provider()(EnvConfig()))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
