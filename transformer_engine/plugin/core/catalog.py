"""The op catalog: one declaration per op (name, parameters, results, math).

An op is declared by writing its signature as a stub function decorated with :func:`declare`; the
stub's docstring carries the math and the results. Backends register functions whose signature
equals the stub's (same parameter names, order, kinds and defaults); :meth:`OpSpec.check_impl`
enforces it at registration so a drifting signature fails loudly, once.

The built-in declarations live in :mod:`transformer_engine.plugin.catalog`; an out-of-tree plugin
may declare new ops with :func:`declare` before registering impls for them.

A stub may also carry type annotations, written as strings over the names ``Tensor`` and ``dtype``
(this module's markers: the catalog imports no torch), ``Optional``, ``Tuple``, ``int``, ``float``,
``bool`` and ``str``, and name the tensor arguments it writes in place (``mutates``). An op so
described traces under ``torch.compile`` as one custom op (:mod:`transformer_engine.plugin._compile`).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

__all__ = ["OpSpec", "Tensor", "declare", "dtype", "get_spec", "list_specs", "CatalogError"]


class Tensor:
    """Annotation marker for a ``torch.Tensor`` in the catalog's stubs."""


class dtype:  # noqa: N801 - spelled as torch.dtype, which it stands for
    """Annotation marker for a ``torch.dtype`` in the catalog's stubs."""


class CatalogError(ValueError):
    """An op declaration or an implementation's signature does not fit the catalog."""


@dataclass(frozen=True)
class OpSpec:
    """The declaration of one op.

    Attributes:
        name: op name (``"gemm"``).
        signature: the declared call signature.
        doc: the stub's docstring (math and results).
        key_param: parameter whose device and dtype select the implementation (default: the first).
        inplace: the op mutates its arguments; after an exception its state may be dirty, so the
            manager never retries it on another implementation.
        mutates: the tensor parameters the op writes in place when they are given (``amax_out``,
            ``out``, ...); what a traced custom op declares (``torch.library.custom_op``'s ``mutates_args``).
        traced: an op whose stub has no annotations (an argument that is not a tensor or a scalar: no custom op)
            but whose result is plain tensors: ``torch.compile`` traces its compiled form, as for an annotated op,
            rather than ending the graph at it.
    """

    name: str
    signature: inspect.Signature
    doc: str
    key_param: str
    inplace: bool = False
    mutates: Tuple[str, ...] = ()
    traced: bool = False

    @property
    def key_index(self) -> int:
        """Position of ``key_param`` among the positional parameters."""
        return list(self.signature.parameters).index(self.key_param)

    def check_impl(self, fn: Callable, impl_id: str) -> None:
        """Raise :class:`CatalogError` unless ``fn``'s signature equals the declared one."""
        try:
            actual = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise CatalogError(f"{impl_id}: cannot read the signature of the impl of {self.name!r}: {exc}")
        expected = self.signature
        if _shape(actual) != _shape(expected):
            raise CatalogError(
                f"{impl_id}: the impl of op {self.name!r} has signature {actual}, "
                f"but the catalog declares {self.name}{_unannotated(expected)}"
            )


def _unannotated(sig: inspect.Signature) -> inspect.Signature:
    """``sig`` without its annotations (what an implementation must match)."""
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()], return_annotation=sig.empty)


def _shape(sig: inspect.Signature) -> Tuple:
    return tuple((p.name, p.kind, p.default) for p in sig.parameters.values())


_LOCK = threading.Lock()
_SPECS: Dict[str, OpSpec] = {}


def _reinit_lock_after_fork() -> None:
    global _LOCK
    _LOCK = threading.Lock()


def declare(fn: Optional[Callable] = None, *, key: Optional[str] = None, inplace: bool = False, mutates: Tuple[str, ...] = (),
            traced: bool = False):
    """Declare an op from a stub function; usable as ``@declare`` or ``@declare(key=..., inplace=..., mutates=..., traced=...)``.

    Declaring the same name twice with the same signature is a no-op; with another one it raises.
    """

    def wrap(stub: Callable) -> OpSpec:
        sig = inspect.signature(stub)
        params = list(sig.parameters)
        if not params:
            raise CatalogError(f"op {stub.__name__!r} declares no parameters")
        key_param = key or params[0]
        if key_param not in params:
            raise CatalogError(f"op {stub.__name__!r}: key parameter {key_param!r} is not a parameter")
        unknown = [name for name in mutates if name not in params]
        if unknown:
            raise CatalogError(f"op {stub.__name__!r}: mutates names {unknown}, which are not parameters")
        spec = OpSpec(stub.__name__, sig, inspect.getdoc(stub) or "", key_param, inplace, tuple(mutates), traced)
        with _LOCK:
            old = _SPECS.get(spec.name)
            if old is not None and (_shape(old.signature) != _shape(sig)
                                    or (old.inplace, old.mutates, old.traced) != (inplace, spec.mutates, traced)):
                raise CatalogError(f"op {spec.name!r} is already declared with signature {old.signature}")
            _SPECS.setdefault(spec.name, spec)
        return _SPECS[spec.name]

    return wrap(fn) if fn is not None else wrap


def get_spec(name: str) -> OpSpec:
    """The declaration of op ``name``; KeyError names the close matches."""
    _load_builtin_catalog()
    try:
        return _SPECS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(_SPECS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown op {name!r}{hint}") from None


def list_specs() -> Tuple[OpSpec, ...]:
    """Every declared op, sorted by name."""
    _load_builtin_catalog()
    return tuple(_SPECS[name] for name in sorted(_SPECS))


def _load_builtin_catalog() -> None:
    import transformer_engine.plugin.catalog  # noqa: F401  (declares the built-in ops on import)
