"""The one loader of the ``TE_FL_*`` environment variables. Bad values warn; nothing here raises.

The variables are declared in :mod:`transformer_engine.common.env` (re-exported by :mod:`.envvars`: the
registry of names, types, meanings and aliases, its typed readers, the unknown-variable check and the
once-per-process warnings); this module validates the dispatch variables' values. The typed readers
other layers use are re-exported here: :func:`read_flag` (a ``TE_FL_*`` 0/1 switch, e.g.
``TE_FL_FP8_EMULATION``) and :func:`triton_interpret` (Triton's ``TRITON_INTERPRET``, by Triton's own rule).

| variable | values |
|---|---|
| ``TE_FL_PREFER`` | ``flagos`` (default), ``vendor`` or ``reference`` |
| ``TE_FL_PREFER_VENDOR`` | upstream's legacy form: ``1`` = ``vendor``, ``0`` = ``flagos``; only when ``TE_FL_PREFER`` is unset |
| ``TE_FL_SKIP_CUDA`` | ``1`` = the built-in CUDA vendor backend is not loaded |
| ``TE_FL_STRICT`` | ``1`` = an implementation's exception propagates; ``0`` or unset = try the next one |
| ``TE_FL_ALLOW_VENDORS`` | comma list of vendor names allowed (case-insensitive); unset = all |
| ``TE_FL_DENY_VENDORS`` | comma list of vendor names denied (deny beats allow) |
| ``TE_FL_PER_OP`` | ``op=tok|tok;op2=tok``, tokens ``flagos``, ``vendor``, ``reference``, ``vendor:<name>``, ``impl:<id>``; a final ``only`` makes the list exclusive |
| ``TE_FL_PLUGIN_MODULES`` | comma list of importable modules with a ``register(registry)`` hook |
| ``TE_FL_LOG_LEVEL`` | ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``; ``TEFL_LOG_LEVEL`` is its deprecated alias |
"""  # noqa: E501

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Mapping, Optional, Tuple

from transformer_engine.common.env import parse_flag, read_flag, triton_interpret

from .envvars import PolicyConfigWarning, check_environment, config_warning, lookup, read

__all__ = ["EnvConfig", "load_env", "read_flag", "triton_interpret", "parse_per_op", "parse_token", "PolicyConfigWarning",
           "KIND_TOKENS"]

KIND_TOKENS = ("flagos", "vendor", "reference")
ONLY_TOKEN = "only"
_LOG_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvConfig:
    """The validated content of the environment."""

    prefer: str = "flagos"
    strict: bool = False
    allow_vendors: Optional[FrozenSet[str]] = None
    deny_vendors: FrozenSet[str] = frozenset()
    per_op: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    plugin_modules: Tuple[str, ...] = ()
    log_level: int = logging.WARNING
    log_level_set: bool = False  # TE_FL_LOG_LEVEL (or its alias) holds a valid level: configure the logger
    skip_cuda: bool = False  # TE_FL_SKIP_CUDA=1: the built-in vendor.cuda backend is not loaded


def _warn(message: str) -> None:
    config_warning(message, PolicyConfigWarning)


def parse_token(token: str) -> Optional[str]:
    """Normalise one selection token, or return None (after a warning) if it is not one.

    Valid: ``flagos``, ``vendor``, ``reference``, ``vendor:<name>`` (name lower-cased), ``impl:<id>``.
    """
    text = token.strip()
    low = text.lower()
    if low in KIND_TOKENS:
        return low
    if low.startswith("vendor:") and len(low) > len("vendor:"):
        return "vendor:" + low[len("vendor:"):].strip()
    if low.startswith("impl:") and len(text) > len("impl:"):
        return "impl:" + text[len("impl:"):].strip()
    _warn(
        f"TE-FL: ignoring selection token {token!r}: valid tokens are flagos, vendor, reference, "
        "vendor:<name>, impl:<impl_id>"
    )
    return None


def parse_per_op(text: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """Parse ``op=tok|tok;op2=tok`` into sorted ``((op, tokens), ...)``; bad parts warn and are dropped.

    A last token ``only`` is kept as the marker of an exclusive order.
    """
    result: Dict[str, Tuple[str, ...]] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            _warn(f"TE-FL: ignoring TE_FL_PER_OP entry {part!r}: expected op=token|token")
            continue
        op, _, rhs = part.partition("=")
        op = op.strip()
        if not _OP_NAME.match(op):
            _warn(f"TE-FL: ignoring TE_FL_PER_OP entry {part!r}: {op!r} is not an op name")
            continue
        raw = [t for t in rhs.split("|") if t.strip()]
        only = bool(raw) and raw[-1].strip().lower() == ONLY_TOKEN
        tokens = [tok for tok in (parse_token(t) for t in (raw[:-1] if only else raw)) if tok]
        if not tokens:
            _warn(f"TE-FL: ignoring TE_FL_PER_OP entry {part!r}: no valid token")
            continue
        result[op] = tuple(tokens) + ((ONLY_TOKEN,) if only else ())
    return tuple(sorted(result.items()))


def _vendor_set(text: str) -> FrozenSet[str]:
    return frozenset(v.strip().lower() for v in text.split(",") if v.strip())


def load_env(environ: Optional[Mapping[str, str]] = None) -> EnvConfig:
    """Read and validate every dispatch variable once (unknown ``TE_FL_*`` names warn, see :mod:`.envvars`)."""
    env = environ  # None: the readers of transformer_engine.common.env read the process environment
    check_environment(env)
    prefer = _prefer(env)
    allow_text = read("TE_FL_ALLOW_VENDORS", env)
    allow = _vendor_set(allow_text) if allow_text and allow_text.strip() else None
    if allow is not None and not allow:  # e.g. "," would otherwise silently deny every vendor
        _warn(f"TE-FL: ignoring TE_FL_ALLOW_VENDORS={allow_text!r}: it names no vendor")
        allow = None
    level, level_set = _log_level(env)
    modules = tuple(m.strip() for m in (read("TE_FL_PLUGIN_MODULES", env) or "").split(",") if m.strip())
    return EnvConfig(
        prefer=prefer,
        strict=read_flag("TE_FL_STRICT", env),
        allow_vendors=allow,
        deny_vendors=_vendor_set(read("TE_FL_DENY_VENDORS", env) or ""),
        per_op=parse_per_op(read("TE_FL_PER_OP", env) or ""),
        plugin_modules=modules,
        log_level=level,
        log_level_set=level_set,
        skip_cuda=read_flag("TE_FL_SKIP_CUDA", env),
    )


def _prefer(env: Optional[Mapping[str, str]]) -> str:
    """``TE_FL_PREFER``, else upstream's legacy ``TE_FL_PREFER_VENDOR`` (1 = vendor, 0 = flagos), else flagos."""
    prefer_text = read("TE_FL_PREFER", env)
    legacy_text = read("TE_FL_PREFER_VENDOR", env)
    prefer = (prefer_text or "").strip().lower()
    if prefer and prefer not in KIND_TOKENS:
        _warn(f"TE-FL: ignoring TE_FL_PREFER={prefer_text!r}: expected flagos, vendor or reference")
        prefer = ""
    if legacy_text is None:
        return prefer or "flagos"
    legacy = "vendor" if parse_flag("TE_FL_PREFER_VENDOR", legacy_text, default=False) else "flagos"
    if prefer:
        if prefer != legacy:
            _warn(f"TE-FL: TE_FL_PREFER_VENDOR={legacy_text!r} is ignored because TE_FL_PREFER={prefer_text!r} is set")
        return prefer
    return legacy


def _log_level(env: Optional[Mapping[str, str]]) -> Tuple[int, bool]:
    """(level, whether one was set) from ``TE_FL_LOG_LEVEL`` or its deprecated alias ``TEFL_LOG_LEVEL``."""
    text, name = lookup("TE_FL_LOG_LEVEL", env)
    level_name = (text or "").strip().upper()
    if not level_name:
        return logging.WARNING, False
    if level_name not in _LOG_LEVELS:
        _warn(f"TE-FL: ignoring {name}={text!r}: expected one of {sorted(_LOG_LEVELS)}")
        return logging.WARNING, False
    return getattr(logging, level_name), True
