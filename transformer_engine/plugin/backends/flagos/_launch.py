"""A cheaper launch path for the flagos ``@triton.jit`` kernels: ``fast_launch(kernel)[grid](...)``.

``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run``, which costs 14-17 us of host time per
launch on the H200 host (Triton 3.6), while the compiled kernel's launcher alone costs about 5 us.
The FP8 layer step makes ~60 launches and is host-bound, so the difference is the step time.

What a launch must compute, and what this path keeps of Triton's own run:

    options          kwargs + the entries run adds itself (debug, instrumentation_mode, ...), set
                     here by the same rules, read from run's source once (see _parse_run_rules)
    binding          bound_args, specialization, options = binder(*args, **kwargs): Triton's own
                     per-device binder (dtypes, 16-byte alignment, int specialization, constexprs)
    kernel           our_cache[device][(tuple(specialization), str(options))], filled from what
                     ``kernel[grid](...)`` returned on a miss. That pair is the key Triton's
                     ``compute_cache_key`` memoises in ``kernel_key_cache`` (its result is a pure
                     function of it), so a hit is the kernel Triton would pick
    launch           grid canonicalised as run does; ``kernel.run(g0, g1, g2, stream, function,
                     packed_metadata, None, None, None, *bound_args.values())`` on the current stream

Skipped, because it is a no-op in that state: ``compute_cache_key`` and its second-level dict
(replaced by one dict lookup), ``launch_metadata`` (it builds a LazyDict for the launch hooks) and
passing the hook chains to the launcher, which calls them. The normal path is taken instead whenever
something the skipped code would act on is present: a launch enter/exit hook or a stages-inspection
hook with callbacks, a pre-run hook on the kernel, a miss (first call, new specialization or options,
a reset ``device_caches``), a changed global the kernel uses (Triton then raises its error). Launch
errors are never caught: the launcher raises them on either path.

Decided once, at decoration: ``fast_launch`` returns its argument itself (the normal path, no wrapper)
when it is not a plain ``JITFunction`` (an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``, an
``Autotuner``, a subclass overriding ``run``) or when the installed Triton's ``JITFunction.run`` /
``compute_cache_key`` do not have the shape this module mirrors (checked on their source; read for
Triton 3.6.0 and 3.9.0). Wrap only kernels launched from the host: a kernel called from another
``@triton.jit`` function must stay a ``JITFunction``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import jit as _jit
from triton.runtime.driver import driver

__all__ = ["fast_launch"]

_logger = logging.getLogger("transformer_engine.plugin")

#: Knobs ``run`` reads besides the option entries; when one holds a callback, the normal path runs.
_FALLBACK_HOOKS = frozenset({"launch_enter_hook", "launch_exit_hook", "add_stages_inspection_hook"})

#: Statements of ``run`` this path mirrors, in order (whitespace collapsed).
_RUN_STATEMENTS = (
    "device = driver.active.get_current_device()",
    "stream = driver.active.get_current_stream(device)",
    "for hook in self.pre_run_hooks:",
    "kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[device]",
    "bound_args, specialization, options = binder(*args, **kwargs)",
    "key = compute_cache_key(kernel_key_cache, specialization, options)",
    "kernel = kernel_cache.get(key, None)",
    "in self.used_global_vals.items(): if (newVal := globals_dict.get(name, not_present)) != val:",
    "if callable(grid): grid = grid(bound_args) grid_size = len(grid) grid_0 = grid[0]"
    " grid_1 = grid[1] if grid_size > 1 else 1 grid_2 = grid[2] if grid_size > 2 else 1",
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,"
    " knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())",
    "return kernel",
)
_BINDER, _KEY = _RUN_STATEMENTS[4], _RUN_STATEMENTS[5]
#: Statements of ``compute_cache_key``: its result depends on (specialization, str(options)) only.
_KEY_STATEMENTS = (
    "key = (tuple(specialization), str(options))",
    "cache_key = kernel_key_cache.get(key, None) if cache_key is not None: return cache_key",
)

_PLAIN_OPTION = re.compile(r'kwargs\["(\w+)"\] = knobs\.(\w+)\.(\w+)')
_DEFAULTED_OPTION = re.compile(r'kwargs\["(\w+)"\] = kwargs\.get\("\1", self\.(\w+)\) or knobs\.(\w+)\.(\w+)')
_HOOK_GUARD = re.compile(r"if knobs\.runtime\.(\w+) is not None:")
_KNOB_REF = re.compile(r"\bknobs\.([\w.]+)")
_COMMENT = re.compile(r"(^|\s)#.*$")
_MISSING = object()


@dataclass(frozen=True)
class _OptionRule:
    """One ``kwargs[name] = ...`` line of ``run``.

    value = knobs.<group>.<attr>, or kwargs.get(name, jit_fn.<jit_attr>) or knobs.<group>.<attr>
    when ``jit_attr`` is set (the ``debug`` line).
    """

    name: str
    group: str
    attr: str
    jit_attr: Optional[str] = None


@dataclass(frozen=True)
class _RunRules:
    """What the installed ``JITFunction.run`` adds to kwargs and which hooks send launches to it."""

    options: Tuple[_OptionRule, ...]
    hooks: Tuple[str, ...]


def _code_lines(source: str) -> List[str]:
    """The lines of ``source`` without comments and blank lines (indentation kept)."""
    lines = (_COMMENT.sub("", line).rstrip() for line in source.splitlines())
    return [line for line in lines if line.strip()]


def _collapse(lines: List[str]) -> str:
    """The lines joined with every whitespace run made one space (multi-line calls compare equal)."""
    return " ".join(" ".join(lines).split())


def _option_rules(lines: List[str]) -> Tuple[Tuple[_OptionRule, ...], str]:
    """The ``kwargs[...] = ...`` lines of ``run`` as rules, or () and why one is not understood."""
    rules = []
    for line in (line.strip() for line in lines):
        if (match := _DEFAULTED_OPTION.fullmatch(line)) is not None:
            name, jit_attr, group, attr = match.groups()
            rules.append(_OptionRule(name, group, attr, jit_attr))
        elif (match := _PLAIN_OPTION.fullmatch(line)) is not None:
            rules.append(_OptionRule(*match.groups()))
    code = "\n".join(lines)
    defaulted = sum(rule.jit_attr is not None for rule in rules)
    if code.count("kwargs[") != len(rules) or code.count("kwargs.") != defaulted:
        return (), "JITFunction.run changes its kwargs in a way this module does not mirror"
    return tuple(rules), ""


def _guarded_by_hooks(lines: List[str]) -> bool:
    """True when every line is, or is nested in, ``if knobs.runtime.<hook> is not None:``."""
    guard_indent = None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if guard_indent is not None and indent > guard_indent:
            continue
        match = _HOOK_GUARD.fullmatch(line.strip())
        if match is None or match.group(1) not in _FALLBACK_HOOKS:
            return False
        guard_indent = indent
    return True


def _statements_in_order(code: str, statements: Tuple[str, ...]) -> str:
    """The first statement missing from ``code`` (searched in order), '' when all are there."""
    start = 0
    for statement in statements:
        found = code.find(statement, start)
        if found < 0:
            return statement
        start = found + len(statement)
    return ""


def _parse_run_rules(run_source: str, key_source: str) -> Tuple[Optional[_RunRules], str]:
    """Rules mirrored from the source of ``JITFunction.run`` and ``compute_cache_key``.

    Returns (rules, "") when the sources have the shape this module mirrors, else (None, reason).
    """
    lines = _code_lines(run_source)
    code = _collapse(lines)
    missing = _statements_in_order(code, _RUN_STATEMENTS)
    if missing:
        return None, f"JITFunction.run has no statement {missing!r}"
    stripped = [line.strip() for line in lines]
    if _BINDER not in stripped or _KEY not in stripped:
        return None, "JITFunction.run spreads the binder call or the key over several lines"
    if not _guarded_by_hooks(lines[stripped.index(_BINDER) + 1 : stripped.index(_KEY)]):
        return None, "JITFunction.run changes the specialization or options before computing the key"
    options, problem = _option_rules(lines)
    if problem:
        return None, problem
    option_knobs = {f"{rule.group}.{rule.attr}" for rule in options}
    hooks = set()
    for ref in set(_KNOB_REF.findall(code)) - option_knobs:
        group, _, attr = ref.partition(".")
        if group != "runtime" or attr not in _FALLBACK_HOOKS:
            return None, f"JITFunction.run reads knobs.{ref}, which this module does not mirror"
        hooks.add(attr)
    key_code = _collapse(_code_lines(key_source))
    missing = _statements_in_order(key_code, _KEY_STATEMENTS)
    if missing or "knobs" in key_code:
        return None, "compute_cache_key depends on more than (specialization, str(options))"
    return _RunRules(options, tuple(sorted(hooks))), ""


@functools.lru_cache(maxsize=None)
def _installed_run_rules() -> Tuple[Optional[_RunRules], str]:
    """_parse_run_rules for the installed Triton (read once per process)."""
    try:
        run_source = inspect.getsource(_jit.JITFunction.run)
        key_source = inspect.getsource(_jit.compute_cache_key)
    except (AttributeError, OSError, TypeError) as exc:
        return None, f"the source of Triton's JITFunction.run is not readable ({exc})"
    return _parse_run_rules(run_source, key_source)


def _support_problem(jit_fn: Any) -> str:
    """Why ``jit_fn`` must keep Triton's normal launch path ('' when the fast path applies)."""
    if not isinstance(jit_fn, _jit.JITFunction):
        return f"{type(jit_fn).__name__} is not a triton JITFunction (interpreter, autotuner or other wrapper)"
    if type(jit_fn).run is not _jit.JITFunction.run:
        return f"{type(jit_fn).__name__} overrides JITFunction.run"
    return _installed_run_rules()[1]


def _hook_active(hook: Any) -> bool:
    """True when a knob hook would do something: set, and for a HookChain, holding callbacks."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _grid_dims(grid: Any, bound_args: Dict[str, Any]) -> Tuple[Any, Any, Any]:
    """(g0, g1, g2) as ``JITFunction.run`` makes them: a callable grid gets the bound arguments
    (constexprs included), missing trailing dimensions are 1."""
    if callable(grid):
        grid = grid(bound_args)
    size = len(grid)
    return grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1


def _globals_changed(jit_fn: Any) -> bool:
    """True when a global the compiled kernel used no longer has its compile-time value."""
    for (name, _), (value, globals_dict) in jit_fn.used_global_vals.items():
        if globals_dict.get(name, _MISSING) != value:
            return True
    return False


class _FastKernel:
    """``jit_fn`` with a cheaper ``[grid](...)``; other attributes are the JITFunction's."""

    def __init__(self, jit_fn: Any, rules: _RunRules):
        self._jit_fn = jit_fn
        self._rules = rules
        # device -> (the device_caches entry whose binder made the keys, {key: CompiledKernel})
        self._kernels: Dict[int, Tuple[tuple, Dict[tuple, Any]]] = {}

    def __getitem__(self, grid: Any):
        return functools.partial(self._launch, grid)

    def __getattr__(self, name: str) -> Any:
        if name == "_jit_fn":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._jit_fn, name)

    def __repr__(self) -> str:
        return f"fast_launch({self._jit_fn!r})"

    def _normal_path_needed(self) -> bool:
        """True when a pre-run hook or a knob hook must see this launch (Triton's run calls them)."""
        if self._jit_fn.pre_run_hooks:
            return True
        runtime = knobs.runtime
        for name in self._rules.hooks:
            if _hook_active(getattr(runtime, name, None)):
                return True
        return False

    def _add_run_options(self, kwargs: Dict[str, Any]) -> None:
        """kwargs[name] = the value ``JITFunction.run`` would set, for each rule, in run's order."""
        for rule in self._rules.options:
            knob = getattr(getattr(knobs, rule.group), rule.attr)
            if rule.jit_attr is None:
                kwargs[rule.name] = knob
            else:
                kwargs[rule.name] = kwargs.get(rule.name, getattr(self._jit_fn, rule.jit_attr)) or knob

    def _launch(self, grid: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``jit_fn[grid](*args, **kwargs)``: the cached kernel's launcher on a hit, else Triton's run."""
        jit_fn = self._jit_fn
        if self._normal_path_needed():
            return jit_fn[grid](*args, **kwargs)
        self._add_run_options(kwargs)  # run sets them again to the same values on the normal path
        active = driver.active
        device = active.get_current_device()
        caches = jit_fn.device_caches.get(device)
        if caches is None:  # first launch on this device: Triton builds the binder
            return jit_fn[grid](*args, **kwargs)
        bound_args, specialization, options = caches[4](*args, **kwargs)
        key = (tuple(specialization), str(options))
        entry = self._kernels.get(device)
        kernel = entry[1].get(key) if entry is not None and entry[0] is caches else None
        if kernel is None or (jit_fn.used_global_vals and _globals_changed(jit_fn)):
            return self._launch_and_remember(grid, args, kwargs, (device, caches, key))
        grid_0, grid_1, grid_2 = _grid_dims(grid, bound_args)
        stream = active.get_current_stream(device)
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *bound_args.values())  # fmt: skip
        return kernel

    def _launch_and_remember(self, grid: Any, args: tuple, kwargs: Dict[str, Any], where: tuple) -> Any:
        """Triton's normal launch (compiles on a miss, raises its own errors); its kernel is kept."""
        kernel = self._jit_fn[grid](*args, **kwargs)
        device, caches, key = where
        if isinstance(kernel, CompiledKernel):
            entry = self._kernels.get(device)
            if entry is None or entry[0] is not caches:
                entry = self._kernels[device] = (caches, {})
            entry[1][key] = kernel
        return kernel


def fast_launch(jit_fn: Any) -> Any:
    """Wrap a ``@triton.jit`` kernel so that ``[grid](...)`` launches skip most of Triton's host work.

    ``fast_launch(k)[grid](*args, **kwargs)`` launches what ``k[grid](*args, **kwargs)`` launches
    (same kernel, specialization, options and stream) and returns the same CompiledKernel;
    host cost per hit ~ binder + dict lookup + launcher, instead of Triton's full ``run``.

    Args:
        jit_fn: a kernel decorated with ``@triton.jit`` (apply ``fast_launch`` on top of it).

    Returns:
        A wrapper with ``[grid]`` and the JITFunction's attributes; ``jit_fn`` itself when the
        fast path does not apply (interpreter, autotuner, an unrecognised Triton version).

    Example:
        >>> not_a_kernel = object()
        >>> fast_launch(not_a_kernel) is not_a_kernel
        True
    """
    problem = _support_problem(jit_fn)
    if problem:
        _logger.debug("TE-FL: normal Triton launches for %r: %s", jit_fn, problem)
        return jit_fn
    rules, _ = _installed_run_rules()
    return _FastKernel(jit_fn, rules)
