"""OpManager: picks, per call, the implementation that runs an op, and explains the choice.

Selection for one call of op ``o`` whose key argument has device/dtype ``k`` under policy ``p``:

1. candidates = impls of ``o`` that pass the vendor filter of ``p`` and whose static
   :class:`~.types.Capabilities` accept ``k`` (device type, dtype, compute capability);
2. ordered by ``p``'s token order for ``o`` (which reads the measured orders the loaded backends declared,
   :func:`.discovery.measured_per_op`), then priority (high first), then impl_id;
3. that ordered list is cached per (``p``'s fingerprint, registry epoch, device, dtype): a *plan*;
4. at call time the first candidate whose ``supports(*args, **kwargs)`` predicate accepts (or that
   has none) runs. If it raises and ``p.strict`` is off and the op is not in-place, the next
   candidate runs and a warning is issued once per (op, impl, exception type). The plan is never
   changed by a failure, so one bad call never demotes an op for later calls. One candidate runner
   (:meth:`OpManager._runner`) does this walk for every caller; a plan whose head has no predicate
   calls the head directly and the runner only after it raised.

The cached path (:mod:`._dispatch`) costs a policy read, an identity check and one dict lookup on
top of the impl call (see ``benchmarks/bench_dispatch.py`` and docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import catalog as _catalog
from . import devices as _devices
from . import discovery as _discovery
from . import policy as _policy
from ._dispatch import OpCache, Plan
from .catalog import OpSpec, get_spec, list_specs
from .config import KIND_TOKENS, load_env
from .envvars import closest_name, config_warning, configure_logging
from .devices import arg_key, compute_capability
from .discovery import PluginRecord, forget_measured_per_op, load_builtin_backends, load_plugins, measured_per_op
from .registry import OpRegistry
from .types import ArgKey, BackendImplKind, OpImpl

__all__ = [
    "OpManager",
    "Decision",
    "NoImplementationError",
    "FallbackWarning",
    "Reject",
    "get_default_manager",
    "reset_default_manager",
]

logger = logging.getLogger("transformer_engine.plugin")


class NoImplementationError(RuntimeError):
    """No registered implementation can run this call; the message says why each was passed over."""


class FallbackWarning(RuntimeWarning):
    """An implementation raised and the call was passed to the next candidate."""


class Reject:
    """A falsy answer a ``supports`` predicate may return to say *why* it declines a call.

    >>> bool(Reject("head_dim 96 is not supported"))
    False
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Reject({self.reason!r})"


@dataclass(frozen=True)
class Decision:
    """One line of an explanation: what the manager thinks of one impl for one call."""

    impl_id: str
    kind: str
    priority: int
    status: str  # "selected", "conditional", "fallback", "rejected"
    reason: str


class OpManager:
    """Dispatches catalog ops to registered implementations.

    Args:
        registry: the registry to read; a new one by default.
        load_builtins: register the built-in backends on first use (those the bootstrap hook lists, see
            :func:`.discovery.builtin_provider`).
        discover: load out-of-tree plugins (entry points ``te_fl.plugin`` and ``TE_FL_PLUGIN_MODULES``)
            on first use.
    """

    def __init__(self, registry: Optional[OpRegistry] = None, *, load_builtins: bool = True, discover: bool = True):
        self.registry = registry if registry is not None else OpRegistry()
        self._load_builtins = load_builtins
        self._discover = discover
        self._init_lock = threading.RLock()
        self._initialized = False
        self._caches: Dict[str, OpCache] = {}
        self._warned: set = set()
        self.plugin_records: List[PluginRecord] = []
        _live_managers.add(self)

    # -- initialisation -----------------------------------------------------------------------
    def ensure_initialized(self) -> None:
        """Register the built-in backends and discovered plugins, once per manager."""
        if self._initialized:
            return
        with self._init_lock:
            if self._initialized:
                return
            cfg = load_env()
            if cfg.log_level_set:  # unset: the application's logging setup decides
                configure_logging(cfg.log_level)
            records: List[PluginRecord] = []
            if self._load_builtins:
                records += load_builtin_backends(self.registry, cfg)
            if self._discover:
                records += load_plugins(self.registry, cfg.plugin_modules)
            self.plugin_records = records
            self._initialized = True
            self._warn_unknown_per_op_ops(_policy.get_policy())
            _warn_unknown_vendor_names(cfg, self.registry)
            logger.info("TE-FL dispatch ready: %d ops, backends %s", len(self.registry.list_operators()), self.registry.impl_ids())

    def reload(self) -> None:
        """Forget everything registered and discovered, then initialise again on next use."""
        with self._init_lock:
            self.registry.clear()
            forget_measured_per_op(self.registry)
            self._initialized = False
            self.plugin_records = []
            self.clear_cache()

    def clear_cache(self) -> None:
        """Drop every cached plan (they are rebuilt on the next call)."""
        for cache in list(self._caches.values()):
            cache.clear()  # the dispatchers stay; their plans are rebuilt
        self._warned.clear()

    def _warn_unknown_per_op_ops(self, policy: _policy.SelectionPolicy) -> None:
        known = {spec.name for spec in list_specs()}
        for op, _tokens in policy.per_op_order:
            if op not in known:
                guess = closest_name(op, known)
                hint = f"; did you mean {guess!r}?" if guess else ""
                config_warning(f"TE-FL: TE_FL_PER_OP names unknown op {op!r}; it is ignored{hint}", UserWarning)

    # -- selection ----------------------------------------------------------------------------
    def rank(self, op_name: str, key: ArgKey, policy: Optional[_policy.SelectionPolicy] = None) -> Tuple[List[OpImpl],
                                                                                                         List[Tuple[OpImpl, str]]]:
        """(candidates in call order, [(impl, reason)] passed over) for a key argument described by ``key``."""
        self.ensure_initialized()
        policy = policy or _policy.get_policy()
        cc = compute_capability(key.device_type, key.device_index)
        eligible, rejected = [], []
        for impl in self.registry.get_implementations(op_name):
            reason = policy.vendor_allowed(impl.vendor) if impl.kind is BackendImplKind.VENDOR else None
            reason = reason or impl.capabilities.reject_reason(key, cc)
            if not reason and not impl.is_available():
                reason = "not available here (its fn._is_available() returned False or raised)"
            (rejected.append((impl, reason)) if reason else eligible.append(impl))
        tokens, exclusive = policy.order_for(op_name, measured_per_op(self.registry))
        ordered: List[OpImpl] = []
        for token in tokens:
            group = [i for i in eligible if _matches(token, i) and i not in ordered]
            ordered += sorted(group, key=lambda i: (-i.priority, i.impl_id))
        for impl in eligible:
            if impl not in ordered:
                why = "not named by the exclusive per-op order" if exclusive else "matches no token of the order"
                rejected.append((impl, why))
        return ordered, rejected

    def _plan(self, spec: OpSpec, policy: _policy.SelectionPolicy, key: ArgKey) -> Plan:
        candidates, rejected = self.rank(spec.name, key, policy)
        strict = policy.strict or spec.inplace
        if not candidates:
            message = _no_impl_message(spec.name, key, rejected)
            return Plan((), strict, _raiser(NoImplementationError, message), None)
        candidates = tuple(candidates)
        head = candidates[0]
        aten = head.aten_dtypes is not None and key.dtype in head.aten_dtypes
        if head.supports is not None:  # each call asks the head's predicate: the candidate runner runs it
            return Plan(candidates, strict, self._runner(spec.name, candidates, strict, rejected), None, aten)
        if strict or len(candidates) == 1:
            return Plan(candidates, strict, head.fn, None, aten)
        rest = candidates[1:]

        def recover(exc: Exception, args: tuple, kwargs: dict) -> Any:
            self._note_failure(spec.name, head, exc, 4)
            # the error path: a runner of the other candidates that raises the head's error if none returns
            return self._runner(spec.name, rest, strict, rejected, first_error=exc, stacklevel=5)(*args, **kwargs)

        return Plan(candidates, strict, head.fn, recover, aten)

    def _runner(self, op_name: str, impls: Sequence[OpImpl], strict: bool, rejected=(), *, with_impl: bool = False,
                first_error: Optional[BaseException] = None, stacklevel: int = 4) -> Callable:
        """``run(*args, **kwargs)``: the manager's one candidate runner. It returns the result (``(result, impl)``
        ``with_impl``) of the first of ``impls`` whose predicate accepts the call and that returns.

        Unless ``strict``, an impl that raises is noted (a warning at ``stacklevel`` for the call's frame)
        and the next one tried; ``first_error`` (an earlier impl's exception, or None) or else the first such
        exception is raised when none returns; when none accepts, :class:`NoImplementationError` names the
        refusals (``rejected`` by the policy, then those of the predicates).

        A plan whose head has a predicate calls its runner on every call: the impls' predicates and
        functions are read once here, so the call costs the loop and the impl calls only.
        """
        steps = tuple([(impl, impl.supports, impl.fn) for impl in impls])
        note_failure = self._note_failure

        def run(*args, **kwargs):
            error, declined = first_error, None
            for impl, supports, fn in steps:
                if supports is not None:
                    verdict = supports(*args, **kwargs)
                    if not verdict:
                        declined = [] if declined is None else declined
                        declined.append((impl, _decline_reason(verdict)))
                        continue
                if strict:
                    result = fn(*args, **kwargs)
                else:
                    try:
                        result = fn(*args, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - fallback is the documented behaviour
                        note_failure(op_name, impl, exc, stacklevel)
                        error = error or exc
                        continue
                return (result, impl) if with_impl else result
            if error is not None:
                raise error
            raise NoImplementationError(_no_impl_message(op_name, None, list(rejected) + (declined or [])))

        return run

    def _note_failure(self, op_name: str, impl: OpImpl, exc: BaseException, stacklevel: int) -> None:
        key = (op_name, impl.impl_id, type(exc))
        if key in self._warned:
            return
        self._warned.add(key)
        message = (
            f"TE-FL: {impl.impl_id} failed on op {op_name!r} ({type(exc).__name__}: {exc}); "
            "trying the next implementation for this call. Set TE_FL_STRICT=1 to raise instead."
        )
        logger.warning(message)
        warnings.warn(message, FallbackWarning, stacklevel=stacklevel)

    def _plan_for(self, op_name: str, args: Sequence, kwargs: Dict) -> Plan:
        self.dispatcher(op_name)  # creates the op's cache on first use
        cache = self._caches[op_name]
        spec = cache.dispatcher.spec
        index = spec.key_index
        return cache.lookup(args[index] if len(args) > index else kwargs.get(spec.key_param))

    # -- calling ------------------------------------------------------------------------------
    def dispatcher(self, op_name: str) -> Callable:
        """The fast callable for ``op_name``: ``manager.dispatcher("gemm")(a, b, ...)``."""
        cache = self._caches.get(op_name)
        if cache is None:
            with self._init_lock:
                cache = self._caches.get(op_name)
                if cache is None:
                    cache = self._new_cache(get_spec(op_name))
                    self._caches[op_name] = cache
        return cache.dispatcher

    def _new_cache(self, spec: OpSpec) -> OpCache:
        cache = OpCache(self, spec)
        dispatch = cache.dispatcher
        dispatch.spec = spec
        dispatch.traced = lambda *args, **kwargs: self.call_traced(spec.name, *args, **kwargs)
        return cache

    def call(self, op_name: str, /, *args, **kwargs) -> Any:
        """Run ``op_name`` with the implementation the policy selects (with fallback unless strict)."""
        cache = self._caches.get(op_name)
        return (cache.dispatcher if cache is not None else self.dispatcher(op_name))(*args, **kwargs)

    def select(self, op_name: str, *args, **kwargs) -> OpImpl:
        """The impl that would run first for these arguments (supports predicates evaluated)."""
        for impl in self._plan_for(op_name, args, kwargs).candidates:
            if impl.supports is None or impl.supports(*args, **kwargs):
                return impl
        raise NoImplementationError(self._explain_text(op_name, args, kwargs))

    def runs_as_aten(self, op_name: str, key: Any) -> bool:
        """True when the implementation the policy puts first for ``op_name`` on a key argument like ``key`` (anything
        with the ``device`` and ``dtype`` of the call's key argument) declares that it computes exactly PyTorch's own
        operator for that dtype (:attr:`OpImpl.aten_dtypes`): the caller may then run that operator itself. The plan
        lookup of a call (the answer is kept with the plan), without calling anything."""
        self.dispatcher(op_name)  # creates the op's cache on first use
        return self._caches[op_name].lookup(key).runs_as_aten

    def resolve(self, op_name: str, *args, **kwargs) -> Callable:
        """Upstream name: the function :meth:`select` picks."""
        return self.select(op_name, *args, **kwargs).fn

    def call_traced(self, op_name: str, *args, **kwargs) -> Tuple[Any, OpImpl]:
        """Like :meth:`call`, also returning the impl that produced the result.

        Used for op pairs whose backward must run on the forward's backend (attention keeps an
        opaque, backend-specific context for its backward).
        """
        plan = self._plan_for(op_name, args, kwargs)
        return self._runner(op_name, plan.candidates, plan.strict, with_impl=True)(*args, **kwargs)

    def compiled_form(self, op_name: str, key: ArgKey) -> Tuple[Tuple[Optional[Callable], Callable], ...]:
        """What ``torch.compile`` traces for a call of ``op_name`` whose key argument is described by ``key``:
        ``((supports, fn), ...)``, the first pair whose ``supports`` is None or accepts the call runs; when
        none does (or the tuple is empty) the op stays its custom op, which dispatches when it runs.

        The candidates are taken in the policy's order as each impl's ``under_compile`` says: a ``"trace"``
        impl adds itself (and ends the walk unless it has a predicate); a ``"reference"`` impl adds the
        reference backend's implementation and ends the walk; a ``"custom_op"`` impl ends it. Chosen when
        Dynamo traces: a later change of policy reaches compiled code only once it is traced again
        (``torch._dynamo.reset()``).
        """
        chain: List[Tuple[Optional[Callable], Callable]] = []
        for impl in self.rank(op_name, key)[0]:
            if impl.under_compile == "trace":
                chain.append((impl.supports, impl.fn))
                if impl.supports is None:
                    break
                continue
            if impl.under_compile == "reference":
                reference = self.reference_impl(op_name)
                chain += [(None, reference.fn)] if reference is not None else []
            break
        return tuple(chain)

    def reference_impl(self, op_name: str) -> Optional[OpImpl]:
        """The reference backend's implementation of ``op_name`` (None when it has none): what a traced
        call runs in place of a kernel Inductor generates itself, and the fake implementation of its custom op."""
        self.ensure_initialized()
        return next((i for i in self.registry.get_implementations(op_name) if i.kind is BackendImplKind.REFERENCE), None)

    def call_impl(self, op_name: str, impl_id: str, *args, **kwargs) -> Any:
        """Run ``op_name`` on exactly the backend ``impl_id`` (no policy, no fallback)."""
        self.ensure_initialized()
        impl = self.registry.get_implementation(op_name, impl_id)
        if impl is None:
            raise NoImplementationError(f"backend {impl_id!r} has no implementation of op {op_name!r}")
        return impl.fn(*args, **kwargs)

    # -- explanations -------------------------------------------------------------------------
    def explain(self, op_name: str, *args, **kwargs) -> List[Decision]:
        """For a call with these arguments: which impl runs and why each other one would not."""
        spec = get_spec(op_name)
        bound = spec.signature.bind_partial(*args, **kwargs).arguments
        key = arg_key(bound.get(spec.key_param))
        candidates, rejected = self.rank(op_name, key)
        decisions, chosen = [], False
        for impl in candidates:
            verdict = True if impl.supports is None else impl.supports(*args, **kwargs)
            if not verdict:
                decisions.append(Decision(impl.impl_id, impl.kind.value, impl.priority, "rejected", _decline_reason(verdict)))
            elif not chosen:
                chosen = True
                decisions.append(Decision(impl.impl_id, impl.kind.value, impl.priority, "selected", "first accepting candidate"))
            else:
                decisions.append(Decision(impl.impl_id, impl.kind.value, impl.priority, "fallback", "used if the selected one raises"))
        decisions += [Decision(i.impl_id, i.kind.value, i.priority, "rejected", r) for i, r in rejected]
        return decisions

    def _explain_text(self, op_name, args, kwargs) -> str:
        lines = [f"no implementation of op {op_name!r} accepts these arguments:"]
        lines += [f"  {d.impl_id}: {d.reason}" for d in self.explain(op_name, *args, **kwargs)]
        return "\n".join(lines)

    def describe(self, device_type: str = "cpu", dtype: Optional[str] = None, device_index: Optional[int] = None) -> Dict[str,
                                                                                                                          List[Decision]]:
        """Static dispatch table: for every declared op, the decisions for a key argument on ``device_type``.

        Runtime ``supports`` predicates cannot be evaluated without arguments: candidates with one
        that come before the first unconditional candidate are reported as "conditional".
        """
        key = ArgKey(device_type, device_index, dtype)
        table: Dict[str, List[Decision]] = {}
        for spec in list_specs():
            candidates, rejected = self.rank(spec.name, key)
            rows, chosen = [], False
            for impl in candidates:
                if chosen:
                    status, reason = "fallback", "used if the selected one raises"
                elif impl.supports is not None:
                    status, reason = "conditional", "selected when its supports() accepts the call's arguments"
                else:
                    status, reason = "selected", "first unconditional candidate in policy order"
                rows.append(Decision(impl.impl_id, impl.kind.value, impl.priority, status, reason))
                chosen = chosen or impl.supports is None
            rows += [Decision(i.impl_id, i.kind.value, i.priority, "rejected", r) for i, r in rejected]
            table[spec.name] = rows
        return table

    # -- fork safety --------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        self._init_lock = threading.RLock()
        self.registry._reinit_lock_after_fork()
        self.clear_cache()


def _registered_vendors(registry: OpRegistry) -> List[str]:
    vendors = {impl.vendor for op in registry.list_operators() for impl in registry.get_implementations(op)
               if impl.kind is BackendImplKind.VENDOR and impl.vendor}
    return sorted(vendors)


def _warn_unknown_vendor_names(cfg, registry: OpRegistry) -> None:
    """Warn about vendor-list entries that are backend kinds, or near misses of a registered vendor.

    A name that is neither (a vendor whose plugin is not installed on this machine) stays silent:
    one environment may serve several kinds of machine.
    """
    vendors = _registered_vendors(registry)
    listed = [("TE_FL_DENY_VENDORS", sorted(cfg.deny_vendors)), ("TE_FL_ALLOW_VENDORS", sorted(cfg.allow_vendors or ()))]
    here = f"vendors registered here: {', '.join(vendors)}" if vendors else "no vendor backend is registered here"
    for variable, names in listed:
        for name in names:
            if name in vendors:
                continue
            if name in KIND_TOKENS:
                effect = "denies nothing" if variable == "TE_FL_DENY_VENDORS" else "allows no vendor by that name"
                config_warning(
                    f"TE-FL: {variable} names {name!r}, a backend kind, not a vendor, so it {effect} ({here}). "
                    "No variable denies a whole kind: TE_FL_PREFER picks the kind tried first, and "
                    "TE_FL_PER_OP='<op>=flagos|vendor|only' keeps an op on the kinds it lists."
                )
                continue
            guess = closest_name(name, vendors)
            if guess:
                config_warning(f"TE-FL: {variable} names unknown vendor {name!r}; did you mean {guess!r}? ({here})")


def _matches(token: str, impl: OpImpl) -> bool:
    if token.startswith("vendor:"):
        return impl.kind is BackendImplKind.VENDOR and impl.vendor == token[7:]
    if token.startswith("impl:"):
        return impl.impl_id == token[5:]
    return impl.kind.value == token


def _decline_reason(verdict) -> str:
    """Why a ``supports`` predicate declined: a :class:`Reject`'s reason, or a generic phrase."""
    return getattr(verdict, "reason", "supports() declined these arguments")


def _raiser(exc_type, message: str) -> Callable:
    def run(*args, **kwargs):
        raise exc_type(message)

    return run


def _no_impl_message(op_name: str, key: Optional[ArgKey], rejected) -> str:
    where = f" for {key.device_type or '?'} / {key.dtype or '?'}" if key is not None else ""
    lines = [f"no implementation of op {op_name!r} can run{where}:"]
    lines += [f"  {impl.impl_id}: {reason}" for impl, reason in rejected] or ["  (no backend implements it)"]
    return "\n".join(lines)


_live_managers: "weakref.WeakSet[OpManager]" = weakref.WeakSet()
_default: Optional[OpManager] = None
_default_lock = threading.Lock()


def get_default_manager() -> OpManager:
    """The process-wide manager that ``transformer_engine.plugin.ops`` dispatches through."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = OpManager()
    return _default


def reset_default_manager() -> None:
    """Reload the default manager: registry cleared, built-ins and plugins loaded again on next use."""
    get_default_manager().reload()


def _after_fork_in_child() -> None:
    # a lock some other thread held at fork time stays locked forever in the child: replace them all
    global _default_lock
    _default_lock = threading.Lock()
    _catalog._reinit_lock_after_fork()
    _policy._reinit_lock_after_fork()
    _discovery._reinit_lock_after_fork()
    _devices._reinit_after_fork()
    for manager in list(_live_managers):
        manager._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
