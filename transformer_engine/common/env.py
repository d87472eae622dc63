"""Every environment variable TransformerEngine-FL reads: declared once here, read only through here.

Pure Python, no torch, no import from the rest of the package: this is the bottom layer, so that
:mod:`transformer_engine.common.recipe` (NVIDIA TE's ``NVTE_*`` recipe defaults), the plugin's loader
(:mod:`transformer_engine.plugin.core.config`, the ``TE_FL_*`` dispatch variables), the flagos backend
(Triton's ``TRITON_INTERPRET``) and the ``te-fl`` command line all read the environment the same way.
:mod:`transformer_engine.plugin.core.envvars` re-exports the names below (its public names keep working).

Each variable is declared once in :data:`VARIABLES` (:class:`EnvVar`: name, type, default, one-line
meaning, deprecated aliases, who reads it) and read through a reader that refuses an undeclared
name (``KeyError``) or a variable declared with another type (``TypeError``): both are bugs in TE-FL.

| type | reader | what a value means |
|---|---|---|
| ``flag`` | :func:`read_flag` | TE-FL's switches: ``1``/``true``/``yes``/``on`` on, ``0``/``false``/``no``/``off``/empty off; any other value warns (once) and counts as off |
| ``switch`` | :func:`read_switch` | NVIDIA TE's switches: on exactly when the value is ``1`` (``os.getenv(name, "0") == "1"``), silently |
| ``bool`` | :func:`read_bool` | Triton's rule: ``1``/``true``/``yes``/``on``/``y`` (any case, no spaces) on, anything else off, silently |
| ``choice`` | :func:`read_choice` | one of ``choices``, checked by the caller (which names its own error); unset = the declared default |
| ``list``, ``text``, ``int``, ``path`` | :func:`read` | the raw string, parsed by the caller |

``TRITON_INTERPRET`` is Triton's own variable: :func:`triton_interpret` (re-exported by the loader,
``transformer_engine.plugin.core.config.triton_interpret``) says whether Triton runs its kernels in its
interpreter, by Triton's own rule, so that TE-FL and Triton never disagree on where a kernel runs.

Mistakes are named, never silent (:func:`check_environment`, :func:`config_warning`):

- a variable of the ``TE_FL_`` / ``TEFL_`` namespace that is not declared warns, naming the closest
  declared one (``TE_FL_STRCT`` -> ``TE_FL_STRICT``); other namespaces (``NVTE_*``: NVIDIA TE reads many
  that TE-FL does not) are never checked;
- a deprecated alias (``TEFL_LOG_LEVEL``) still works and warns, naming its replacement;
- every such warning is issued once per process, attributed to the first frame outside TE-FL, torch and
  importlib (the user's code), or to ``<environment>`` when there is none.

Example:
    >>> read_choice("NVTE_NVFP4_4OVER6", {})
    'none'
    >>> read_switch("NVTE_NVFP4_DISABLE_RHT", {"NVTE_NVFP4_DISABLE_RHT": "1"})
    True
    >>> read_flag("TE_FL_STRICT", {"TE_FL_STRICT": "yes"})
    True
"""  # noqa: E501

from __future__ import annotations

import difflib
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "EnvVar",
    "PolicyConfigWarning",
    "TYPES",
    "VARIABLES",
    "OWN_VARIABLES",
    "RECIPE_VARIABLES",
    "THIRD_PARTY_VARIABLES",
    "NAMESPACES",
    "declared",
    "lookup",
    "read",
    "read_flag",
    "parse_flag",
    "read_switch",
    "read_choice",
    "read_bool",
    "triton_interpret",
    "closest",
    "closest_name",
    "check_environment",
    "config_warning",
    "describe",
    "reset_warnings",
]

NAMESPACES = ("TE_FL_", "TEFL_")
TYPES = ("flag", "switch", "bool", "choice", "list", "text", "int", "path")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_BOOL_TRUE = {"1", "true", "yes", "on", "y"}  # Triton's knobs.getenv_bool


class PolicyConfigWarning(UserWarning):
    """A ``TE_FL_*`` variable is unknown, deprecated or holds a value that is ignored; the message names it."""


@dataclass(frozen=True)
class EnvVar:
    """One declared environment variable.

    Attributes:
        name: the variable's name.
        description: what it does, in one line (shown by ``te-fl info`` and docs/plugins.md).
        default: the meaning when unset, in words; for a ``choice`` variable whose default is one of its
            ``choices``, that value (what :func:`read_choice` returns when it is unset).
        aliases: deprecated names still read (the primary name wins when both are set).
        scope: who reads it: ``"library"``, ``"cli"``, or ``"tests"`` / ``"benchmarks"``.
        type: one of :data:`TYPES`; decides the reader (see the module docstring).
        choices: the valid values of a ``choice`` variable.
    """

    name: str
    description: str
    default: str = "unset"
    aliases: Tuple[str, ...] = ()
    scope: str = "library"
    type: str = "text"
    choices: Tuple[str, ...] = ()


_NVFP4_TARGETS = ("none", "weights", "activations", "all")

#: TE-FL's own variables (the ``TE_FL_`` namespace; the dispatch ones are validated by plugin/core/config.py)
OWN_VARIABLES: Tuple[EnvVar, ...] = (
    EnvVar("TE_FL_PREFER", "backend kind tried first: flagos, vendor or reference", "flagos",
           type="choice", choices=("flagos", "vendor", "reference")),
    EnvVar("TE_FL_PREFER_VENDOR", "upstream TE-FL's legacy preference: 1 = TE_FL_PREFER=vendor, 0 = flagos; "
           "read only when TE_FL_PREFER is unset", "0", type="flag"),
    EnvVar("TE_FL_SKIP_CUDA", "1 = do not load the built-in CUDA vendor backend (upstream TE-FL: no native CUDA build)", "0",
           type="flag"),
    EnvVar("TE_FL_STRICT", "1 = an implementation's exception propagates; 0 = fall back to the next one", "0", type="flag"),
    EnvVar("TE_FL_ALLOW_VENDORS", "comma list of vendor names that may run (case-insensitive)", "all vendors", type="list"),
    EnvVar("TE_FL_DENY_VENDORS", "comma list of vendor names that may not run (deny beats allow)", "none", type="list"),
    EnvVar("TE_FL_PER_OP", "per-op order: op=tok|tok;op2=tok (flagos, vendor, reference, vendor:<name>, impl:<id>, final only)", "none"),
    EnvVar("TE_FL_PLUGIN_MODULES", "comma list of importable modules with a register(registry) hook", "none", type="list"),
    EnvVar("TE_FL_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR for the transformer_engine.plugin logger",
           "the application's logging setup", aliases=("TEFL_LOG_LEVEL",),
           type="choice", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    EnvVar("TE_FL_COMPILE_OPS", "what torch.compile traces of an op: traced = the tensor ops of a traceable implementation "
           "(Inductor fuses them), custom_op = one opaque node calling the dispatcher", "traced",
           type="choice", choices=("traced", "custom_op")),
    EnvVar("TE_FL_FP8_EMULATION", "1 = FP8 may run emulated on a CUDA GPU without FP8 hardware", "0", type="flag"),
    EnvVar("TE_FL_TEST_SEED", "base seed of the test suite's per-test torch seed", "0", scope="tests", type="int"),
    EnvVar("TE_FL_REVISION", "git revision recorded in benchmark JSON where the copy has no .git", "git describe", scope="benchmarks"),
)

#: NVIDIA TE's recipe defaults, read by transformer_engine.common.recipe when a recipe is made (TE's rules)
RECIPE_VARIABLES: Tuple[EnvVar, ...] = (
    EnvVar("NVTE_BACKWARD_OVERRIDE", "default backward_override of every recipe: high_precision or dequantized",
           "no override", type="choice", choices=("high_precision", "dequantized")),
    EnvVar("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1 = Float8CurrentScaling's default use_power_2_scales is True", "0",
           type="switch"),
    EnvVar("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1 = Float8BlockScaling's default use_f32_scales is True", "0", type="switch"),
    EnvVar("NVTE_NVFP4_DISABLE_RHT", "1 = NVFP4BlockScaling's default disable_rht is True", "0", type="switch"),
    EnvVar("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1 = NVFP4BlockScaling's default disable_stochastic_rounding is True", "0",
           type="switch"),
    EnvVar("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "1 = NVFP4BlockScaling's default disable_2d_quantization is True", "0",
           type="switch"),
    EnvVar("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1 = NVFP4BlockScaling's default row_scaled_activation is True", "0", type="switch"),
    EnvVar("NVTE_NVFP4_4OVER6", "NVFP4BlockScaling's default nvfp4_4over6: none, weights, activations or all", "none",
           type="choice", choices=_NVFP4_TARGETS),
    EnvVar("NVTE_NVFP4_4OVER6_E4M3_USE_256", "NVFP4BlockScaling's default nvfp4_4over6_e4m3_use_256: none, weights, "
           "activations or all", "all", type="choice", choices=_NVFP4_TARGETS),
    EnvVar("NVTE_NVFP4_4OVER6_ERR_MODE", "NVFP4BlockScaling's default nvfp4_4over6_err_mode: MAE or MSE", "MAE",
           type="choice", choices=("MAE", "MSE")),
    EnvVar("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH", "NVIDIA TE's fp16 4over6 error: not implemented here, 1 warns when a "
           "4over6 recipe is made", "0", type="switch"),
)

#: other programs' variables that TE-FL reads
THIRD_PARTY_VARIABLES: Tuple[EnvVar, ...] = (
    EnvVar("TRITON_INTERPRET", "Triton's own: 1 = Triton kernels run in Triton's interpreter (the flagos backend then "
           "serves the CPU too)", "0", type="bool"),
    EnvVar("XDG_CACHE_HOME", "base folder of te-fl demo's default output (<it>/te-fl/demo)", "~/.cache", scope="cli", type="path"),
    EnvVar("XLA_FLAGS", "XLA's own: te-fl info says whether it holds --xla_gpu_enable_triton_gemm=false (JAX FP8 compile time)",
           "none", scope="cli"),
)

#: every declared variable: TE-FL's own first (``te-fl info`` lists them in this order)
VARIABLES: Tuple[EnvVar, ...] = OWN_VARIABLES + RECIPE_VARIABLES + THIRD_PARTY_VARIABLES

_BY_NAME: Dict[str, EnvVar] = {var.name: var for var in VARIABLES}
_ALIAS_OF: Dict[str, str] = {alias: var.name for var in VARIABLES for alias in var.aliases}
_OWN_KNOWN = tuple(var.name for var in OWN_VARIABLES) + tuple(alias for var in OWN_VARIABLES for alias in var.aliases)

_lock = threading.Lock()
_emitted: set = set()  # keys of the configuration warnings already issued in this process


# -- reading ----------------------------------------------------------------------------------------
def declared(name: str, type: Optional[str] = None) -> EnvVar:  # noqa: A002 - the field's name
    """The declaration of ``name``.

    Raises:
        KeyError: ``name`` is not declared in :data:`VARIABLES` (a bug in TE-FL, not a user mistake).
        TypeError: ``type`` is given and ``name`` is declared with another one.
    """
    var = _BY_NAME[name]
    if type is not None and var.type != type:
        raise TypeError(f"{name} is declared as a {var.type} variable, not a {type} one")
    return var


def lookup(name: str, environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], Optional[str]]:
    """(value, the name it was read from) of declared variable ``name``; (None, None) when unset.

    ``environ`` defaults to ``os.environ``. A deprecated alias is read when the primary name is unset,
    and warns once.

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


def parse_flag(name: str, value: Optional[str], default: bool = False) -> bool:
    """A TE-FL switch's value: True for 1/true/yes/on, False for 0/false/no/off/empty (any case, spaces
    ignored), ``default`` when unset; any other value warns once (naming ``name``) and gives ``default``."""
    if value is None:
        return default
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    config_warning(f"TE-FL: ignoring {name}={value!r}: expected 1 or 0", PolicyConfigWarning)
    return default


def read_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A declared ``flag`` variable (``TE_FL_STRICT``, ``TE_FL_FP8_EMULATION``): True for 1/true/yes/on.

    Any other non-empty value warns (once) and counts as 0.
    """
    declared(name, "flag")
    return parse_flag(name, read(name, environ), default=False)


def read_switch(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A declared ``switch`` variable (NVIDIA TE's ``NVTE_*`` switches): True exactly when its value is ``1``.

    NVIDIA TE's rule, kept so that an environment means here what it means there: any other value,
    ``true`` included, is off, without a warning.
    """
    declared(name, "switch")
    return read(name, environ) == "1"


def read_choice(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A declared ``choice`` variable: its value as set (the caller checks it against the declared
    ``choices`` and names its own error), else its declared default when that is one of the choices,
    else None."""
    var = declared(name, "choice")
    value = read(name, environ)
    if value is not None:
        return value
    return var.default if var.default in var.choices else None


def read_bool(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A declared ``bool`` variable (Triton's): True for 1, true, yes, on or y (any case, no spaces), as
    Triton's ``knobs.getenv_bool`` reads its own variables; anything else is off, without a warning."""
    declared(name, "bool")
    value = read(name, environ)
    return value is not None and value.lower() in _BOOL_TRUE


def triton_interpret(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``TRITON_INTERPRET`` makes Triton run its kernels in its interpreter (on the CPU), by Triton's rule.

    Every Triton release this package supports (3.4 and newer) decides it with ``knobs.runtime.interpret``
    (1, true, yes, on, y, any case), so TE-FL code that asks here and Triton agree on where a kernel runs;
    reading the variable as ``== "1"`` would disagree with Triton for ``TRITON_INTERPRET=true``. (Triton 3.4
    also strips surrounding spaces; 3.5 and newer do not, nor does this.)
    """
    return read_bool("TRITON_INTERPRET", environ)


def closest_name(name: str, candidates: Sequence[str]) -> Optional[str]:
    """The candidate closest to ``name`` by :func:`difflib.get_close_matches` (cutoff 0.6), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def closest(name: str) -> Optional[str]:
    """The declared ``TE_FL_*`` variable whose name is closest to ``name`` (an alias maps to its primary), or None."""
    match = closest_name(name.upper(), _OWN_KNOWN)
    return _ALIAS_OF.get(match, match) if match else None


def _unknown(name: str) -> bool:
    return name.upper().startswith(NAMESPACES) and name not in _BY_NAME and name not in _ALIAS_OF


def check_environment(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Warn (once per name) about every undeclared ``TE_FL_*`` / ``TEFL_*`` variable; returns their names."""
    env = os.environ if environ is None else environ
    unknown = sorted(name for name in env if _unknown(name))
    for name in unknown:
        guess = closest(name)
        hint = f"did you mean {guess}?" if guess else f"known variables: {', '.join(v.name for v in OWN_VARIABLES)}"
        config_warning(f"TE-FL: unknown environment variable {name} is ignored; {hint}", key=("unknown", name))
    return unknown


def describe(environ: Optional[Mapping[str, str]] = None) -> List[Dict[str, Optional[str]]]:
    """One row per declared variable (:data:`VARIABLES` order), then per unknown one of the ``TE_FL_``
    namespace (for ``te-fl info``).

    Rows: ``name``, ``value`` (None when unset), ``set_as`` (the name actually set: differs for an
    alias), ``default``, ``scope``, ``type`` and ``description`` (for an unknown one: the closest known name).
    """
    env = os.environ if environ is None else environ
    rows = []
    for var in VARIABLES:
        set_as = next((n for n in (var.name,) + var.aliases if n in env), None)
        rows.append({"name": var.name, "value": env.get(set_as) if set_as else None, "set_as": set_as,
                     "default": var.default, "scope": var.scope, "type": var.type, "description": var.description})
    for name in sorted(n for n in env if _unknown(n)):
        guess = closest(name)
        rows.append({"name": name, "value": env[name], "set_as": name, "default": None, "scope": "unknown", "type": None,
                     "description": "unknown, ignored" + (f" (did you mean {guess}?)" if guess else "")})
    return rows


# -- warnings ---------------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def reset_warnings() -> None:
    """Forget which configuration warnings were issued (tests use this to see them again)."""
    with _lock:
        _emitted.clear()
