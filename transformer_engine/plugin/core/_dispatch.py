"""The per-op fast path of :class:`~.manager.OpManager`: plan caches and generated dispatchers.

A *plan* is the ordered candidate list of one op for one (policy, registry epoch, device, dtype) and
how to run it: ``first(...)`` is called with the op's arguments; if it raises and ``recover`` is set,
``recover(exc, args, kwargs)`` continues with the next candidates (``recover`` is None when the error
must propagate: strict policy, in-place op, single candidate, or a ``first`` that handles fallback
itself).

Each op's dispatcher is generated with the op's exact signature, the way :mod:`dataclasses` generates
``__init__``: arguments bind natively (a wrong call is a ``TypeError`` before any impl runs), the key
argument is a local variable and the arguments are forwarded without packing ``*args``/``**kwargs``.
The cached path of a call is: the effective policy (scoped override, else global); an identity check
that policy and registry epoch are those of the previous call (else the table of this
(fingerprint, epoch) is fetched); one dict lookup by ``(key.device, key.dtype)``; the impl call.
A key argument without a hashable ``device`` and ``dtype`` (a list of tensors, None) is described by
:func:`~.devices.arg_key` on a slower path.
"""

from __future__ import annotations

import builtins
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

from . import policy as _policy
from .catalog import CatalogError, OpSpec
from .devices import arg_key
from .types import OpImpl

__all__ = ["Plan", "OpCache"]

_MAX_TABLES = 64  # (fingerprint, epoch) tables kept per op
_MAX_PLANS = 512  # (device, dtype) plans kept per table
_PREFIX = "_te_"  # names of the generated code; an op parameter may not start with it


class Plan:
    """How one op runs for one (policy, registry epoch, device, dtype); ``runs_as_aten``: the head candidate declares
    itself PyTorch's own operator for that dtype (:attr:`OpImpl.aten_dtypes`), decided when the plan is made."""

    __slots__ = ("candidates", "strict", "first", "recover", "runs_as_aten")

    def __init__(self, candidates: Tuple[OpImpl, ...], strict: bool, first: Callable, recover: Optional[Callable],
                 runs_as_aten: bool = False):
        self.candidates = candidates
        self.strict = strict
        self.first = first
        self.recover = recover
        self.runs_as_aten = runs_as_aten


class OpCache:
    """The plans of one op (one table per policy fingerprint and registry epoch) and its dispatcher.

    Args:
        manager: the :class:`~.manager.OpManager`; ``manager._plan(spec, policy, key)`` builds plans.
        spec: the op's declaration.
    """

    __slots__ = ("_manager", "_spec", "_tables", "current", "dispatcher")

    def __init__(self, manager, spec: OpSpec):
        self._manager = manager
        self._spec = spec
        self._tables: Dict[Tuple[str, int], Dict[Any, Plan]] = {}
        self.current: Tuple[Any, int, Dict[Any, Plan]] = (None, -1, {})  # replaced whole, never mutated
        self.dispatcher = _generate(self, spec, manager.registry)

    def clear(self) -> None:
        """Forget every plan."""
        self._tables.clear()
        self.current = (None, -1, {})

    def table_for(self, policy) -> Dict[Any, Plan]:
        """The plan table of ``policy`` at the registry's current epoch; it becomes ``current``."""
        self._manager.ensure_initialized()  # first use registers the backends: read the epoch after
        epoch = self._manager.registry.epoch
        key = (policy.fingerprint, epoch)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            table = self._tables.setdefault(key, {})
        self.current = (policy, epoch, table)
        return table

    def plan(self, policy, table: Dict[Any, Plan], x: Any) -> Plan:
        """The plan for key argument ``x`` (slow path: a cache miss, or a key without device/dtype)."""
        key = arg_key(x)
        try:
            raw = (x.device, x.dtype)
            hash(raw)
        except (AttributeError, TypeError):
            raw = key
        plan = table.get(raw)
        if plan is None:
            if len(table) >= _MAX_PLANS:
                table.clear()
            plan = table[raw] = self._manager._plan(self._spec, policy, key)
        return plan

    def lookup(self, x: Any) -> Plan:
        """The plan the dispatcher would use for key argument ``x`` (its inline code, as a method)."""
        policy = _policy.get_policy()
        last_policy, last_epoch, table = self.current
        if policy is not last_policy or self._manager.registry.epoch != last_epoch:
            table = self.table_for(policy)
        try:
            return table[x.device, x.dtype]
        except (AttributeError, TypeError, KeyError):
            return self.plan(policy, table, x)


class _DefaultRef:
    """Renders as the expression that fetches a parameter's default in the generated code."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{_PREFIX}defaults[{self.name!r}]"


def _forwarding(sig: inspect.Signature) -> Tuple[str, str, str, str, Dict[str, Any]]:
    """(def parameters, call arguments, positional tuple, keyword dict, defaults) for the generated code."""
    params, call, pos, kw, defaults = [], [], [], [], {}
    for p in sig.parameters.values():
        if p.name.startswith(_PREFIX):
            raise CatalogError(f"parameter {p.name!r}: names starting with {_PREFIX!r} are reserved for the dispatcher")
        if p.default is not p.empty:
            defaults[p.name] = p.default
            p = p.replace(default=_DefaultRef(p.name))
        params.append(p.replace(annotation=p.empty))
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            call.append(p.name)
            pos.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            call.append(f"*{p.name}")
            pos.append(f"*{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            call.append(f"{p.name}={p.name}")
            kw.append(f"{p.name!r}: {p.name}")
        else:
            call.append(f"**{p.name}")
            kw.append(f"**{p.name}")
    def_params = str(sig.replace(parameters=params, return_annotation=sig.empty))[1:-1]
    return def_params, ", ".join(call), "(" + "".join(f"{a}, " for a in pos) + ")", "{" + ", ".join(kw) + "}", defaults


_TEMPLATE = """
def {name}({params}):
    _te_policy = _te_get_override() or _te_policy_module._global or _te_get_policy()
    _te_last_policy, _te_last_epoch, _te_table = _te_cache.current
    if _te_policy is not _te_last_policy or _te_registry.epoch != _te_last_epoch:
        _te_table = _te_cache.table_for(_te_policy)
    try:
        _te_plan = _te_table[{key}.device, {key}.dtype]
    except (AttributeError, TypeError, KeyError):
        _te_plan = _te_cache.plan(_te_policy, _te_table, {key})
    try:
        return _te_plan.first({call})
    except Exception as _te_exc:
        if _te_plan.recover is None:
            raise
        return _te_plan.recover(_te_exc, {pos}, {kw})
"""


def _generate(cache: OpCache, spec: OpSpec, registry) -> Callable:
    """Compile the dispatcher of ``spec`` (see the module docstring for its cached path)."""
    params, call, pos, kw, defaults = _forwarding(spec.signature)
    source = _TEMPLATE.format(name=spec.name, params=params, key=spec.key_param, call=call, pos=pos, kw=kw)
    namespace = {
        "__builtins__": builtins,
        "__name__": "transformer_engine.plugin",
        f"{_PREFIX}defaults": defaults,
        f"{_PREFIX}cache": cache,
        f"{_PREFIX}registry": registry,
        f"{_PREFIX}policy_module": _policy,
        f"{_PREFIX}get_override": _policy._override.get,
        f"{_PREFIX}get_policy": _policy.get_policy,
    }
    exec(compile(source, f"<te-fl dispatcher {spec.name}>", "exec"), namespace)  # noqa: S102 - generated above
    dispatch = namespace[spec.name]
    dispatch.__doc__ = spec.doc
    dispatch.__signature__ = spec.signature
    return dispatch
