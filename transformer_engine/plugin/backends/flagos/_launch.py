"""Kernel launches that skip Triton's per-call binding once a kernel is compiled.

``kernel[grid](*args, **kwargs)`` on a ``triton.jit`` function binds the arguments, computes each
one's specialization and the cache key, reads the runtime knobs and builds launch metadata before
the compiled kernel's own launcher runs: several times the host time of that launcher alone. Small
kernels run faster than that on the GPU, so an FP8 step of many small casts waits for the host.

:func:`cached_launch` wraps a ``triton.jit`` kernel with a dict from a *launch key* to the compiled
kernel. The key refines Triton's specialization (two calls with one key get the same compiled
kernel from Triton):

- tensor: dtype and whether ``data_ptr()`` is a multiple of 16 (Triton's pointer alignment);
- int: whether it equals 1, is a multiple of 16, fits int32, is negative (Triton's int
  specialization and argument type: i32 / i64 / u64);
- bool, float, None and any other value: its type (floats are fp32 and never specialized) and,
  for bools and None, the value;
- constexpr parameters: their values; launch options (``num_warps``, ...): names and values;
- the current device, and ``knobs.runtime.debug``.

A key seen for the first time goes through Triton's own path (which compiles or finds the kernel,
launches it and returns it); later calls with that key call the compiled kernel's launcher with the
arguments in the kernel's parameter order, as Triton's path does (launch hooks with nothing to
call are passed as None, so no launch metadata is built for them; under Triton 3.6 a kernel without
scratch memory goes straight to the launcher's C function, :func:`_direct_launch`). The launcher is generated per
kernel with its parameters (as :mod:`dataclasses` generates ``__init__``): arguments bind natively
and each key part is an inline expression. Every call takes Triton's path for a grid given as a
callable, while Dynamo traces (it records the ``triton.jit`` kernel, which Inductor launches
itself), or when the compiled kernel lacks the launcher attributes of the Triton versions this was
written against (3.4-3.9); under ``TRITON_INTERPRET=1`` the decorator returns the kernel unchanged. Not covered:
Triton's check that a global the kernel reads has not changed since it was compiled (the kernels
here read module constants only).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton
from triton.runtime import driver

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: cached_launch leaves every kernel to Triton's own launch
    knobs = None

from ._common import INTERPRET

__all__ = ["CachedLaunch", "cached_launch"]

_INT32 = (-(2**31), 2**31 - 1)
_TRITON_3_6 = triton.__version__.split(".")[:2] == ["3", "6"]


def _arg_key(a: Any) -> Any:
    """What Triton's specialization of one runtime argument depends on (a refinement of it)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None or a is True or a is False:
        return a
    if type(a) is int:
        return (a == 1, a % 16 == 0, _INT32[0] <= a <= _INT32[1], a < 0)
    return type(a)


_TEMPLATE = """
def launch_key({params}, **_options):
    return (_device(), _runtime.debug, {key}, tuple(_options.items()) if _options else ())

def launch(_grid, {params}, **_options):
    _key = (_device(), _runtime.debug, {key}, tuple(_options.items()) if _options else ())
    _entry = _compiled.get(_key)
    if _entry is None or _entry is False:
        return _first(_grid, _key, _entry, ({args},), _options)
    _kernel, _direct = _entry
    _stream = _stream_of(_key[0])
    _enter, _exit = _hooks(_runtime.launch_enter_hook), _hooks(_runtime.launch_exit_hook)
    _meta = None if _enter is None and _exit is None else _kernel.launch_metadata(_grid, _stream, {args})
    _g0, _g1, _g2 = (*_grid, 1, 1)[:3]
    if _direct is None:
        _kernel.run(_g0, _g1, _g2, _stream, _kernel.function, _kernel.packed_metadata, _meta, _enter, _exit, {args})
    else:
        _direct[0](_g0, _g1, _g2, _stream, _kernel.function, _direct[1], _direct[2], None, None,
                   _kernel.packed_metadata, _meta, _enter, _exit, {args})
    return _kernel
"""


def _direct_launch(run: Any) -> Optional[Tuple[Callable[..., Any], Any, Any]]:
    """(launch, cooperative grid, PDL) of a compiled kernel's launcher, to call its C ``launch`` as Triton
    3.6's ``CudaLauncher.__call__`` does for a kernel that needs no global or profile scratch memory
    (both buffers None), without that Python frame and its two scratch helpers (host time saved on every
    launch). None under other Triton versions (their ``__call__`` differs: 3.9 passes the
    profile scratch otherwise) or for a kernel with scratch memory: the launch then goes through ``run``."""
    if not _TRITON_3_6 or type(run).__name__ != "CudaLauncher":
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    try:
        return run.launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None


def _hooks(hook: Any) -> Any:
    """A launch hook as the compiled launcher should get it: None when there is nothing to call.

    Triton >= 3.5 keeps its launch hooks as chains (``knobs.HookChain``) that exist even when empty;
    the launcher then builds the launch metadata and calls the empty chains on every launch (a few
    microseconds). An empty chain is passed as None, which the launcher skips."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


# _arg_key of one runtime argument, its tensor case inlined for exact torch.Tensor arguments (the common
# case, without a call); a subclass such as nn.Parameter goes through _arg_key, which keys it alike
_TENSOR_KEY = "({0}.dtype, not {0}.data_ptr() & 15) if type({0}) is _Tensor else _arg_key({0})"


class CachedLaunch:
    """A ``triton.jit`` kernel launched as ``wrapper[grid](*args, **kwargs)``, compiled kernels cached by launch key
    (``_compiled``: key -> (compiled kernel, :func:`_direct_launch` of it), or False for a kernel Triton launches each time).

    Attributes:
        fn: the wrapped ``triton.jit`` function.
    """

    def __init__(self, fn):
        reserved = [p.name for p in fn.params if p.name.startswith("_")]
        if reserved:
            raise ValueError(f"{fn.fn.__name__}: parameters {reserved} start with '_', which the generated launcher reserves")
        self.fn = fn
        self._compiled: Dict[Tuple, Any] = {}
        signature = inspect.signature(fn.fn).parameters
        params = [(p.name, p.is_constexpr, signature[p.name].default) for p in fn.params]
        defaults = {name: default for name, _, default in params if default is not inspect.Parameter.empty}
        namespace = {
            "_device": self._bind_driver,  # Triton's driver exists only where a GPU does: bound on first use
            "_runtime": knobs.runtime,
            "_compiled": self._compiled,
            "_first": self._first,
            "_Tensor": torch.Tensor,
            "_arg_key": _arg_key,
            "_hooks": _hooks,
            "_defaults": defaults,
        }
        source = _TEMPLATE.format(
            params=", ".join(f"{n}=_defaults[{n!r}]" if n in defaults else n for n, _, _ in params),
            key=", ".join(n if constexpr else _TENSOR_KEY.format(n) for n, constexpr, _ in params),
            args=", ".join(n for n, _, _ in params),
        )
        exec(compile(source, f"<te-fl launcher {fn.fn.__name__}>", "exec"), namespace)  # noqa: S102 - generated above
        self._namespace = namespace
        self._launch = namespace["launch"]
        #: launch_key(*args, **kwargs): the launch key of ``self[grid](*args, **kwargs)`` here and now
        self.launch_key = namespace["launch_key"]

    def _bind_driver(self) -> int:
        """The current device, after binding the generated code to the active driver's device and stream getters."""
        self._namespace["_device"] = driver.active.get_current_device
        self._namespace["_stream_of"] = driver.active.get_current_stream
        return driver.active.get_current_device()

    def _first(self, grid, key: Tuple, known, args: Tuple, options: Dict[str, Any]):
        """Triton's own launch: for a new key (compiles on first use, then cached) or one marked uncachable."""
        kernel = self.fn[grid](*args, **options)
        if known is None:
            cachable = hasattr(kernel, "packed_metadata") and hasattr(kernel, "function")
            self._compiled[key] = (kernel, _direct_launch(kernel.run)) if cachable else False
        return kernel

    def __getitem__(self, grid) -> Callable[..., Any]:
        if callable(grid) or torch.compiler.is_compiling():  # traced: Dynamo records the Triton kernel itself
            return self.fn[grid]
        return functools.partial(self._launch, grid)


def cached_launch(fn):
    """Decorator (above ``@triton.jit``): launch ``fn`` through :class:`CachedLaunch`; ``fn`` itself
    under ``TRITON_INTERPRET=1`` (Triton's interpreter runs every call) or when this Triton's
    version is older than 3.4 or its ``JITFunction`` does not describe its parameters as 3.4-3.9 do
    (``params[i].is_constexpr``)."""
    if INTERPRET or knobs is None or not all(hasattr(p, "is_constexpr") for p in getattr(fn, "params", [None])):
        return fn
    return CachedLaunch(fn)
