"""Turning an impl registered the upstream TE-FL way into one this registry accepts.

:func:`translate` is what ``OpRegistry.register_impl`` (upstream's registration name) runs first:

- an impl whose signature already equals the catalog op's passes unchanged;
- an impl under an upstream op name with an :class:`~._adapters.Adapter` is wrapped: the wrapper
  has the catalog signature, calls the upstream function the way its signature allows, converts the
  result, and a ``supports`` predicate declines (with the reason, shown by ``explain``) the calls
  the upstream function cannot serve;
- an impl of an upstream op this catalog lacks (:data:`~._missing.MISSING`), or one whose function
  cannot take the op's data, is skipped with an :class:`UpstreamCompatWarning` naming what is missing.

Wrappers are memoised per (op, impl id, function), so registering the same upstream impl twice is
the registry's usual no-op.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from ..core.catalog import CatalogError, get_spec
from ..core.envvars import config_warning
from ..core.manager import Reject
from ..core.types import OpImpl
from ._adapters import ADAPTERS, Adapter, CallPlan
from ._missing import MISSING

__all__ = ["UpstreamCompatWarning", "translate", "upstream_function"]


class UpstreamCompatWarning(UserWarning):
    """An impl written for upstream TE-FL could not be registered here; the message says what is missing."""


_lock = threading.Lock()
_memo: Dict[Tuple[str, str, Any], Tuple[Callable, Callable]] = {}


def translate(impl: OpImpl) -> Optional[OpImpl]:
    """The impl to register for ``impl`` (itself, or adapted onto the catalog), or None after a warning."""
    if not isinstance(impl, OpImpl):
        return impl  # the registry raises its usual TypeError
    if _fits_catalog(impl):
        return impl
    adapter = ADAPTERS.get(impl.op_name)
    if adapter is not None:
        try:
            return _adapt(impl, adapter)
        except ValueError as exc:
            _skip(impl, f"it cannot be adapted onto {adapter.ours!r}: {exc}")
            return None
    if impl.op_name in MISSING:
        _skip(impl, f"TE-FL has no equivalent of upstream op {impl.op_name!r}: {MISSING[impl.op_name]}")
        return None
    return impl  # neither ours nor upstream's: the registry names the problem


def upstream_function(fn: Callable) -> Optional[Callable]:
    """The upstream function an adapted impl wraps, or None for a native impl."""
    return getattr(fn, "__te_fl_upstream_fn__", None)


def _fits_catalog(impl: OpImpl) -> bool:
    try:
        get_spec(impl.op_name).check_impl(impl.fn, impl.impl_id)
        return True
    except (KeyError, CatalogError):
        return False


def _skip(impl: OpImpl, why: str) -> None:
    config_warning(f"TE-FL: upstream-style impl {impl.impl_id!r} of op {impl.op_name!r} is not registered: {why}",
                   UpstreamCompatWarning)


def _adapt(impl: OpImpl, adapter: Adapter) -> OpImpl:
    key = (adapter.upstream, impl.impl_id, impl.fn)
    with _lock:
        pair = _memo.get(key)
        if pair is None:
            pair = _memo[key] = _wrap(impl.fn, adapter)
    wrapper, supports = pair
    return dataclasses.replace(impl, op_name=adapter.ours, fn=wrapper, supports=_both(impl.supports, supports),
                               description=impl.description or f"upstream-style {adapter.upstream} impl, adapted")


def _wrap(fn: Callable, adapter: Adapter) -> Tuple[Callable, Callable]:
    """(wrapper with the catalog signature, supports predicate) around upstream function ``fn``."""
    spec = get_spec(adapter.ours)
    plan = CallPlan.for_function(fn, adapter)
    signature = spec.signature
    fn_name = getattr(fn, "__qualname__", repr(fn))

    def bind(args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def adapted(*args, **kwargs):
        ours = bind(args, kwargs)
        values = adapter.to_upstream(ours)
        result = plan.call(fn, values)
        return adapter.from_upstream(values[adapter.result_from] if adapter.result_from else result, ours)

    def supports(*args, **kwargs):
        ours = bind(args, kwargs)
        reason = adapter.decline(ours) or plan.blocked(adapter, adapter.to_upstream(ours), fn_name)
        return Reject(reason) if reason else True

    adapted.__signature__ = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()], return_annotation=signature.empty)
    adapted.__name__ = f"upstream_{adapter.upstream}"
    adapted.__qualname__ = f"upstream[{fn_name}]"
    adapted.__doc__ = f"{fn_name}, written for upstream TE-FL's {adapter.upstream}, adapted onto {adapter.ours}."
    adapted.__te_fl_upstream_fn__ = fn
    adapted.__te_fl_upstream_op__ = adapter.upstream
    if hasattr(fn, "_is_available"):
        adapted._is_available = fn._is_available  # upstream's availability probe keeps working
    return adapted, supports


def _both(first: Optional[Callable], second: Callable) -> Callable:
    if first is None:
        return second

    def supports(*args, **kwargs):
        verdict = first(*args, **kwargs)
        return second(*args, **kwargs) if verdict else verdict

    return supports
