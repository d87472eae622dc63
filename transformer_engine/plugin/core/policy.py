"""SelectionPolicy: in which order backends are tried, and whether a failure may fall through.

The effective policy is the innermost scoped override (a :mod:`contextvars` variable, so overrides
are private to a thread or an asyncio task), else the global policy built once from the environment
(:func:`~.config.load_env`). ``strict`` lives here and only here: with ``strict=True`` an
implementation's exception propagates; otherwise the next candidate is tried.

Order of candidates for an op: the per-op tokens (if any), then the default order of ``prefer``
(flagos -> vendor -> reference for ``prefer="flagos"``), unless the per-op list ends with ``only``.
Under the default preference, an op for which a loaded backend declared a measured order (its
``TE_FL_MEASURED_PER_OP``, where it was measured faster than the flagos kernel; see :mod:`.discovery`)
starts with that order's tokens: the policy reads the declarations it is given, and names no backend.
Inside one token, higher priority first, then impl_id ascending.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Dict, FrozenSet, Iterator, Mapping, Optional, Tuple

from .config import KIND_TOKENS, ONLY_TOKEN, load_env, parse_token

__all__ = [
    "SelectionPolicy",
    "get_policy",
    "set_global_policy",
    "reset_global_policy",
    "policy_context",
    "with_strict_mode",
    "with_preference",
    "with_allowed_vendors",
    "with_denied_vendors",
    "DEFAULT_ORDERS",
    "check_measured_per_op",
]

_NO_MEASURED: Mapping[str, Tuple[str, ...]] = MappingProxyType({})

DEFAULT_ORDERS: Dict[str, Tuple[str, ...]] = {
    "flagos": ("flagos", "vendor", "reference"),
    "vendor": ("vendor", "flagos", "reference"),
    "reference": ("reference", "flagos", "vendor"),
}


@dataclass(frozen=True)
class SelectionPolicy:
    """An immutable selection policy.

    Attributes:
        prefer: ``"flagos"``, ``"vendor"`` or ``"reference"``: which kind goes first.
        strict: True = no fallback after an exception.
        per_op_order: ``((op, (token, ...)), ...)`` overrides; a last token ``"only"`` is exclusive.
        allow_vendors: vendors allowed (lower-case), None = all.
        deny_vendors: vendors denied (lower-case); deny beats allow.
    """

    prefer: str = "flagos"
    strict: bool = False
    per_op_order: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    allow_vendors: Optional[FrozenSet[str]] = None
    deny_vendors: FrozenSet[str] = frozenset()
    fingerprint: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        prefer = str(self.prefer).strip().lower()
        if prefer not in KIND_TOKENS:
            raise ValueError(f"prefer={self.prefer!r} is not one of {', '.join(KIND_TOKENS)}")
        object.__setattr__(self, "prefer", prefer)
        object.__setattr__(self, "per_op_order", _normalise_per_op(self.per_op_order))
        if self.allow_vendors is not None:
            object.__setattr__(self, "allow_vendors", frozenset(v.lower() for v in self.allow_vendors))
        object.__setattr__(self, "deny_vendors", frozenset(v.lower() for v in self.deny_vendors))
        object.__setattr__(self, "fingerprint", self._make_fingerprint())

    def _make_fingerprint(self) -> str:
        allow = ",".join(sorted(self.allow_vendors)) if self.allow_vendors is not None else "*"
        per = ";".join(f"{op}={'|'.join(t)}" for op, t in self.per_op_order)
        return f"prefer={self.prefer};strict={int(self.strict)};allow={allow};deny={','.join(sorted(self.deny_vendors))};per={per}"

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "SelectionPolicy":
        """Build the policy from ``TE_FL_*`` variables (see :mod:`.config`)."""
        cfg = load_env(environ)
        return cls(cfg.prefer, cfg.strict, cfg.per_op, cfg.allow_vendors, cfg.deny_vendors)

    def order_for(self, op_name: str, measured: Mapping[str, Tuple[str, ...]] = _NO_MEASURED) -> Tuple[Tuple[str, ...], bool]:
        """(tokens in order, exclusive?) for one op.

        ``measured``: ``{op: tokens}`` the loaded backends declared (:func:`.discovery.measured_per_op`):
        under the default preference, and without a per-op entry for the op, its tokens go first.
        """
        for op, tokens in self.per_op_order:
            if op == op_name:
                exclusive = tokens[-1] == ONLY_TOKEN
                named = tokens[:-1] if exclusive else tokens
                if exclusive:
                    return named, True
                rest = tuple(t for t in DEFAULT_ORDERS[self.prefer] if t not in named)
                return named + rest, False
        if self.prefer == "flagos" and op_name in measured:
            named = measured[op_name]
            return named + tuple(t for t in DEFAULT_ORDERS[self.prefer] if t not in named), False
        return DEFAULT_ORDERS[self.prefer], False

    def vendor_allowed(self, vendor: Optional[str]) -> Optional[str]:
        """None if ``vendor`` may be used, else the reason it may not."""
        if vendor in self.deny_vendors:
            return f"vendor {vendor!r} is denied (TE_FL_DENY_VENDORS)"
        if self.allow_vendors is not None and vendor not in self.allow_vendors:
            return f"vendor {vendor!r} is not in the allow list {sorted(self.allow_vendors)}"
        return None


def check_measured_per_op(table: Mapping) -> Dict[str, Tuple[str, ...]]:
    """A backend's ``TE_FL_MEASURED_PER_OP``, checked and normalised: ``{op: (token, ...)}``.

    Tokens are those of ``TE_FL_PER_OP`` (a ``"a|b"`` string or a sequence), without a final ``only``:
    a measurement orders the candidates, it excludes none.

    Raises:
        TypeError: ``table`` is not a mapping. ValueError: an invalid token, or ``only``.
    """
    if not isinstance(table, Mapping):
        raise TypeError(f"expected a dict op -> tokens, got {type(table).__name__}")
    orders = dict(_normalise_per_op(table))
    exclusive = sorted(op for op, tokens in orders.items() if tokens[-1] == ONLY_TOKEN)
    if exclusive:
        raise ValueError(f"a measured order may not end with {ONLY_TOKEN!r} (ops {exclusive})")
    return orders


def _normalise_per_op(items) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    if isinstance(items, Mapping):
        items = items.items()
    out = {}
    for op, tokens in items:
        if isinstance(tokens, str):
            tokens = tokens.split("|")
        tokens = [str(t).strip() for t in tokens if str(t).strip()]
        only = bool(tokens) and tokens[-1].lower() == ONLY_TOKEN
        body = [parse_token(t) for t in (tokens[:-1] if only else tokens)]
        if any(t is None for t in body) or not body:
            raise ValueError(f"invalid per-op order for {op!r}: {tokens}")
        out[str(op)] = tuple(body) + ((ONLY_TOKEN,) if only else ())
    return tuple(sorted(out.items()))


_override: contextvars.ContextVar[Optional[SelectionPolicy]] = contextvars.ContextVar("te_fl_policy", default=None)
_global_lock = threading.Lock()
_global: Optional[SelectionPolicy] = None


def get_policy() -> SelectionPolicy:
    """The effective policy: the innermost scoped override, else the global one."""
    scoped = _override.get()
    if scoped is not None:
        return scoped
    policy = _global
    if policy is None:
        return _load_global()
    return policy


def _load_global() -> SelectionPolicy:
    global _global
    with _global_lock:
        if _global is None:
            _global = SelectionPolicy.from_env()
        return _global


def _reinit_lock_after_fork() -> None:
    global _global_lock
    _global_lock = threading.Lock()


def set_global_policy(policy: SelectionPolicy) -> Optional[SelectionPolicy]:
    """Replace the global policy; returns the previous one."""
    global _global
    if not isinstance(policy, SelectionPolicy):
        raise TypeError(f"expected a SelectionPolicy, got {type(policy).__name__}")
    with _global_lock:
        old, _global = _global, policy
        return old


def reset_global_policy() -> None:
    """Forget the global policy, so the next use re-reads the environment."""
    global _global
    with _global_lock:
        _global = None


@contextlib.contextmanager
def policy_context(policy: SelectionPolicy) -> Iterator[SelectionPolicy]:
    """Use ``policy`` inside the block (this thread / task only)."""
    token = _override.set(policy)
    try:
        yield policy
    finally:
        _override.reset(token)


def _scoped(**changes):
    return policy_context(replace(get_policy(), **changes))


def with_strict_mode(strict: bool = True):
    """Scoped ``strict`` on (or off)."""
    return _scoped(strict=bool(strict))


def with_preference(prefer: str):
    """Scoped preferred kind (``flagos``, ``vendor`` or ``reference``)."""
    return _scoped(prefer=prefer)


def with_allowed_vendors(*vendors: str):
    """Scoped allow list (replaces the current one)."""
    return _scoped(allow_vendors=frozenset(v.lower() for v in vendors))


def with_denied_vendors(*vendors: str):
    """Scoped deny list, added to the current one."""
    current = get_policy()
    return _scoped(deny_vendors=current.deny_vendors | {v.lower() for v in vendors})
