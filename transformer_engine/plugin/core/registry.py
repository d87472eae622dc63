"""OpRegistry: which implementations exist for each op. Thread-safe; registration is checked.

Rules:
- registering an impl equal to one already there (same id, same function) is a no-op, so a backend
  can be registered twice (after a fork, by two discovery paths) without errors;
- registering a *different* impl under an existing (op, impl_id) raises unless ``override=True``;
- ``register_many`` is atomic: every impl is checked first, then all are stored, or none is;
- each impl's function must match the op's signature in the catalog.

Every change bumps :attr:`OpRegistry.epoch`, which invalidates the managers' dispatch caches.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional, Tuple

from .catalog import CatalogError, get_spec
from .types import OpImpl

__all__ = ["OpRegistry", "RegistrationError", "translate_upstream"]


def translate_upstream(impl: OpImpl) -> Optional[OpImpl]:
    """An impl registered the upstream TE-FL way, made fit for this catalog (see :mod:`transformer_engine.plugin.compat`)."""
    from ..compat import translate  # the compatibility layer sits beside the core, loaded on first use

    return translate(impl)


class RegistrationError(ValueError):
    """An implementation conflicts with one already registered, or does not fit the catalog."""


class OpRegistry:
    """Storage of ``{op_name: {impl_id: OpImpl}}`` behind a lock."""

    def __init__(self):
        self._lock = threading.RLock()
        self._impls: Dict[str, Dict[str, OpImpl]] = {}
        self.epoch = 0

    # -- registration -------------------------------------------------------------------------
    def register(self, impl: OpImpl, *, override: bool = False) -> bool:
        """Register one impl. Returns True if stored, False if an identical one was already there."""
        return self.register_many([impl], override=override) == 1

    def register_impl(self, impl: OpImpl, *, override: bool = False) -> bool:
        """Upstream TE-FL's name: :meth:`register`, after :func:`translate_upstream`.

        An impl written for an upstream op signature is adapted onto the catalog op; one for an
        upstream op TE-FL lacks is skipped with a warning (returns False).
        """
        impl = translate_upstream(impl)
        return False if impl is None else self.register(impl, override=override)

    def register_many(self, impls: Iterable[OpImpl], *, override: bool = False) -> int:
        """Register a backend's impls atomically; returns how many were new or replaced."""
        return self._register_pairs([(impl, override) for impl in impls])

    def _register_pairs(self, pairs: List[Tuple[OpImpl, bool]]) -> int:
        """Register ``(impl, override)`` pairs atomically: all of them or, on any error, none."""
        with self._lock:
            todo = self._validate(pairs)
            for impl in todo:
                self._impls.setdefault(impl.op_name, {})[impl.impl_id] = impl
            if todo:
                self.epoch += 1
            return len(todo)

    def _validate(self, pairs: List[Tuple[OpImpl, bool]]) -> List[OpImpl]:
        todo: List[OpImpl] = []
        seen: Dict[tuple, OpImpl] = {}
        for impl, override in pairs:
            if not isinstance(impl, OpImpl):
                raise TypeError(f"expected an OpImpl, got {type(impl).__name__}")
            try:
                get_spec(impl.op_name).check_impl(impl.fn, impl.impl_id)
            except KeyError as exc:
                raise RegistrationError(f"{impl.impl_id}: {exc.args[0]} (declare it in the catalog first)")
            except CatalogError as exc:
                raise RegistrationError(str(exc)) from None
            key = (impl.op_name, impl.impl_id)
            if key in seen and not seen[key].same_as(impl):
                raise RegistrationError(f"two different impls of {impl.op_name!r} with id {impl.impl_id!r} in one batch")
            seen[key] = impl
            old = self._impls.get(impl.op_name, {}).get(impl.impl_id)
            if old is not None and old.same_as(impl):
                continue
            if old is not None and not override:
                raise RegistrationError(
                    f"op {impl.op_name!r} already has a different impl {impl.impl_id!r}; "
                    "pass override=True to replace it"
                )
            todo.append(impl)
        return todo

    def unregister(self, op_name: str, impl_id: str) -> bool:
        """Remove one impl; returns whether it existed."""
        with self._lock:
            removed = self._impls.get(op_name, {}).pop(impl_id, None) is not None
            if removed:
                self.epoch += 1
            return removed

    def unregister_backend(self, impl_id: str) -> int:
        """Remove every impl with this impl_id (a whole backend); returns how many."""
        with self._lock:
            count = sum(per_op.pop(impl_id, None) is not None for per_op in self._impls.values())
            if count:
                self.epoch += 1
            return count

    def clear(self) -> None:
        """Remove everything."""
        with self._lock:
            self._impls.clear()
            self.epoch += 1

    # -- queries ------------------------------------------------------------------------------
    def get_implementations(self, op_name: str) -> List[OpImpl]:
        """All impls of an op (a copy), in registration order."""
        with self._lock:
            return list(self._impls.get(op_name, {}).values())

    def get_implementation(self, op_name: str, impl_id: str) -> Optional[OpImpl]:
        """The impl of ``op_name`` with id ``impl_id``, or None."""
        with self._lock:
            return self._impls.get(op_name, {}).get(impl_id)

    def list_operators(self) -> List[str]:
        """Names of the ops that have at least one impl, sorted."""
        with self._lock:
            return sorted(op for op, impls in self._impls.items() if impls)

    def impl_ids(self) -> List[str]:
        """Every impl_id (backend) present, sorted."""
        with self._lock:
            return sorted({i for impls in self._impls.values() for i in impls})

    def _reinit_lock_after_fork(self) -> None:
        self._lock = threading.RLock()
