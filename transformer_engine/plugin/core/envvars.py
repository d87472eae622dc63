"""The registry of TE-FL's environment variables, and how configuration mistakes are reported.

Every ``TE_FL_*`` variable the library reads is declared once in :data:`VARIABLES` (name, one-line
meaning, default, deprecated aliases) and read through :func:`lookup` / :func:`read`, which refuse a
name that is not declared. Values are validated by :mod:`.config`.

Mistakes are named, never silent:

- a variable of the ``TE_FL_`` / ``TEFL_`` namespace that is not declared warns, naming the closest
  declared one (``TE_FL_STRCT`` -> ``TE_FL_STRICT``);
- a deprecated alias (``TEFL_LOG_LEVEL``) still works and warns, naming its replacement;
- every such warning (:func:`config_warning`) is issued once per process, attributed to the first
  frame outside TE-FL, torch and importlib (the user's code), or to ``<environment>`` when there is none.

``TE_FL_LOG_LEVEL`` (:func:`configure_logging`) sets the level of the ``transformer_engine.plugin``
logger and, if no handler would otherwise print its records, gives it one on stderr. Nothing here
touches logging unless that variable is set.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "EnvVar",
    "PolicyConfigWarning",
    "VARIABLES",
    "NAMESPACES",
    "LOGGER_NAME",
    "lookup",
    "read",
    "closest",
    "closest_name",
    "check_environment",
    "config_warning",
    "configure_logging",
    "describe",
]

NAMESPACES = ("TE_FL_", "TEFL_")
LOGGER_NAME = "transformer_engine.plugin"


class PolicyConfigWarning(UserWarning):
    """A ``TE_FL_*`` variable is unknown, deprecated or holds a value that is ignored; the message names it."""


@dataclass(frozen=True)
class EnvVar:
    """One declared environment variable.

    Attributes:
        name: the variable's name.
        description: what it does, in one line (shown by ``te-fl info`` and docs/plugins.md).
        default: the meaning when unset, in words.
        aliases: deprecated names still read (the primary name wins when both are set).
        scope: ``"library"``, or ``"tests"`` / ``"benchmarks"`` for variables only those read.
    """

    name: str
    description: str
    default: str = "unset"
    aliases: Tuple[str, ...] = ()
    scope: str = "library"


VARIABLES: Tuple[EnvVar, ...] = (
    EnvVar("TE_FL_PREFER", "backend kind tried first: flagos, vendor or reference", "flagos"),
    EnvVar("TE_FL_PREFER_VENDOR", "upstream TE-FL's legacy preference: 1 = TE_FL_PREFER=vendor, 0 = flagos; "
           "read only when TE_FL_PREFER is unset", "0"),
    EnvVar("TE_FL_SKIP_CUDA", "1 = do not load the built-in CUDA vendor backend (upstream TE-FL: no native CUDA build)", "0"),
    EnvVar("TE_FL_STRICT", "1 = an implementation's exception propagates; 0 = fall back to the next one", "0"),
    EnvVar("TE_FL_ALLOW_VENDORS", "comma list of vendor names that may run (case-insensitive)", "all vendors"),
    EnvVar("TE_FL_DENY_VENDORS", "comma list of vendor names that may not run (deny beats allow)", "none"),
    EnvVar("TE_FL_PER_OP", "per-op order: op=tok|tok;op2=tok (flagos, vendor, reference, vendor:<name>, impl:<id>, final only)", "none"),
    EnvVar("TE_FL_PLUGIN_MODULES", "comma list of importable modules with a register(registry) hook", "none"),
    EnvVar("TE_FL_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR for the transformer_engine.plugin logger",
           "the application's logging setup", aliases=("TEFL_LOG_LEVEL",)),
    EnvVar("TE_FL_COMPILE_OPS", "what torch.compile traces of an op: traced = the tensor ops of a traceable implementation "
           "(Inductor fuses them), custom_op = one opaque node calling the dispatcher", "traced"),
    EnvVar("TE_FL_FP8_EMULATION", "1 = FP8 may run emulated on a CUDA GPU without FP8 hardware", "0"),
    EnvVar("TE_FL_TEST_SEED", "base seed of the test suite's per-test torch seed", "0", scope="tests"),
    EnvVar("TE_FL_REVISION", "git revision recorded in benchmark JSON where the copy has no .git", "git describe", scope="benchmarks"),
)

_BY_NAME: Dict[str, EnvVar] = {var.name: var for var in VARIABLES}
_ALIAS_OF: Dict[str, str] = {alias: var.name for var in VARIABLES for alias in var.aliases}
_KNOWN = tuple(_BY_NAME) + tuple(_ALIAS_OF)

_lock = threading.Lock()
_emitted: set = set()  # keys of the configuration warnings already issued in this process


# -- reading ----------------------------------------------------------------------------------------
def lookup(name: str, environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], Optional[str]]:
    """(value, the name it was read from) of declared variable ``name``; (None, None) when unset.

    A deprecated alias is read when the primary name is unset, and warns once.

    Raises:
        KeyError: ``name`` is not declared in :data:`VARIABLES` (a bug in TE-FL, not a user mistake).
    """
    var = _BY_NAME[name]
    env = os.environ if environ is None else environ
    value = env.get(name)
    for alias in var.aliases:
        alias_value = env.get(alias)
        if alias_value is None:
            continue
        if value is None:
            config_warning(f"TE-FL: {alias} is deprecated; rename it to {name} (its value {alias_value!r} is used)")
            return alias_value, alias
        if alias_value != value:
            config_warning(f"TE-FL: both {name}={value!r} and its deprecated alias {alias}={alias_value!r} are set; {alias} is ignored")
    return (value, name) if value is not None else (None, None)


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of declared variable ``name`` (or of its deprecated alias), None when unset."""
    return lookup(name, environ)[0]


def closest_name(name: str, candidates: Sequence[str]) -> Optional[str]:
    """The candidate closest to ``name`` by :func:`difflib.get_close_matches` (cutoff 0.6), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def closest(name: str) -> Optional[str]:
    """The declared variable whose name is closest to ``name`` (an alias maps to its primary), or None."""
    match = closest_name(name.upper(), _KNOWN)
    return _ALIAS_OF.get(match, match) if match else None


def _in_namespace(name: str) -> bool:
    return name.upper().startswith(NAMESPACES)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Warn (once per name) about every undeclared ``TE_FL_*`` / ``TEFL_*`` variable; returns their names."""
    env = os.environ if environ is None else environ
    unknown = sorted(name for name in env if _in_namespace(name) and name not in _BY_NAME and name not in _ALIAS_OF)
    for name in unknown:
        guess = closest(name)
        hint = f"did you mean {guess}?" if guess else f"known variables: {', '.join(_BY_NAME)}"
        config_warning(f"TE-FL: unknown environment variable {name} is ignored; {hint}", key=("unknown", name))
    return unknown


def describe(environ: Optional[Mapping[str, str]] = None) -> List[Dict[str, Optional[str]]]:
    """One row per declared variable, then per unknown one of the namespace (for ``te-fl info``).

    Rows: ``name``, ``value`` (None when unset), ``set_as`` (the name actually set: differs for an
    alias), ``default``, ``scope`` and ``description`` (for an unknown one: the closest known name).
    """
    env = os.environ if environ is None else environ
    rows = []
    for var in VARIABLES:
        set_as = next((n for n in (var.name,) + var.aliases if n in env), None)
        rows.append({"name": var.name, "value": env.get(set_as) if set_as else None, "set_as": set_as,
                     "default": var.default, "scope": var.scope, "description": var.description})
    for name in sorted(n for n in env if _in_namespace(n) and n not in _BY_NAME and n not in _ALIAS_OF):
        guess = closest(name)
        rows.append({"name": name, "value": env[name], "set_as": name, "default": None, "scope": "unknown",
                     "description": "unknown, ignored" + (f" (did you mean {guess}?)" if guess else "")})
    return rows


# -- warnings ---------------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_INTERNAL_MODULES = ("transformer_engine", "torch", "importlib", "contextlib", "functools")


def _is_internal(frame) -> bool:
    module = frame.f_globals.get("__name__") or ""
    filename = frame.f_code.co_filename
    if filename.startswith(("<frozen", "<te-fl")) or os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        return True
    return any(module == m or module.startswith(m + ".") for m in _INTERNAL_MODULES)


def _user_frame():
    frame = sys._getframe(1)
    while frame is not None and _is_internal(frame):
        frame = frame.f_back
    return frame


def config_warning(message: str, category: type = PolicyConfigWarning, key=None) -> bool:
    """Issue a configuration warning once per process, attributed to the user's code.

    The warning points at the first frame outside TE-FL (its files and its generated ``<te-fl ...>``
    code) and outside torch, importlib, contextlib and functools,
    or at ``<environment>`` when the whole stack is library code. ``key`` (default: the message)
    decides what counts as the same warning. Returns True when the warning was issued now.
    """
    key = key if key is not None else (category, message)
    with _lock:
        if key in _emitted:
            return False
        _emitted.add(key)
    frame = _user_frame()
    if frame is None:
        warnings.warn_explicit(message, category, "<environment>", 0, module="transformer_engine.config")
    else:
        warnings.warn_explicit(
            message, category, frame.f_code.co_filename, frame.f_lineno,
            module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault("__warningregistry__", {}),
        )
    return True


def _reset_warnings() -> None:
    """Forget which configuration warnings were issued (tests use this to see them again)."""
    with _lock:
        _emitted.clear()


# -- logging ----------------------------------------------------------------------------------------
class _Handler(logging.StreamHandler):
    """The stderr handler TE-FL adds to its logger when ``TE_FL_LOG_LEVEL`` is set and nothing else prints."""


def configure_logging(level: int) -> logging.Logger:
    """Set the TE-FL logger's level; give it a stderr handler if its records would otherwise be lost.

    Called only when ``TE_FL_LOG_LEVEL`` (or its alias) is set. A handler is added only when neither
    the logger nor an ancestor has one (``logging.lastResort`` would print WARNING and above only);
    an application that configured logging keeps its own handlers and no record is printed twice.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = _Handler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger
