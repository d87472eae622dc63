"""The 24 catalog activation ops as thin functions over one backend's two launchers.

Every backend computes activations with ``forward(op, x[, limit, alpha])`` and
``backward(op, dy, x[, limit, alpha])`` for a forward op name; the catalog wants one function per op
with the declared signature. :func:`activation_ops` builds those functions once, so backends do not
each spell out 24 identical wrappers. A backend module exposes them through a module ``__getattr__``
(a lookup, not a rewrite of its globals).
"""

from __future__ import annotations

import math
from typing import Callable, Dict

from transformer_engine.plugin.core.catalog import get_spec

__all__ = [
    "FORWARD_OPS", "ACTIVATION_OP_NAMES", "activation_ops", "backward_name", "check_activation", "check_clamp", "check_in_place",
    "module_getattr",
]

FORWARD_OPS = ("gelu", "qgelu", "relu", "srelu", "silu", "glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")


def backward_name(op: str) -> str:
    """Catalog name of the backward of forward op ``op`` (``dgelu``, ..., ``clamped_dswiglu``)."""
    return "clamped_dswiglu" if op == "clamped_swiglu" else "d" + op


def check_clamp(limit, alpha) -> None:
    """clamped_swiglu's parameters: limit > 0 and a finite alpha.

    Raises:
        ValueError: either is out of range.
    """
    if not limit > 0:
        raise ValueError(f"clamped_swiglu needs limit > 0, got limit={limit!r} (GPT-OSS uses 7.0)")
    if not math.isfinite(alpha):
        raise ValueError(f"clamped_swiglu needs a finite alpha, got alpha={alpha!r} (GPT-OSS uses 1.702)")


def check_activation(activation: str, limit, alpha) -> None:
    """An op taking the activation by name (``activation_quantize``, ``dactivation_``): a forward op
    name, and clamped_swiglu's parameters when it is that one.

    Raises:
        ValueError: unknown activation, or bad clamped_swiglu parameters.
    """
    if activation not in FORWARD_OPS:
        raise ValueError(f"activation={activation!r} is not one of the forward activation ops {FORWARD_OPS}")
    if activation == "clamped_swiglu":
        check_clamp(limit, alpha)


def check_in_place(x, activation: str, limit, alpha) -> None:
    """``dactivation_``'s own rules: :func:`check_activation`, and an x the gradient can be written over.

    Raises:
        ValueError: unknown activation, bad clamped_swiglu parameters, or x not contiguous.
    """
    check_activation(activation, limit, alpha)
    if not x.is_contiguous():
        raise ValueError(f"dactivation_ writes the gradient over x, which must be contiguous (strides {tuple(x.stride())})")


ACTIVATION_OP_NAMES = tuple(name for op in FORWARD_OPS for name in (op, backward_name(op)))


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = get_spec(name).doc
    return fn


def _plain(forward: Callable, backward: Callable, op: str):
    def fwd(x):
        return forward(op, x)

    def bwd(dy, x):
        return backward(op, dy, x)

    return fwd, bwd


def _clamped(forward: Callable, backward: Callable):
    def fwd(x, limit=7.0, alpha=1.702):
        check_clamp(limit, alpha)
        return forward("clamped_swiglu", x, limit, alpha)

    def bwd(dy, x, limit=7.0, alpha=1.702):
        check_clamp(limit, alpha)
        return backward("clamped_swiglu", dy, x, limit, alpha)

    return fwd, bwd


def activation_ops(forward: Callable, backward: Callable) -> Dict[str, Callable]:
    """{op name: function} for the 24 activation ops, each with the catalog's signature and docstring
    (clamped_swiglu's pair checks ``(limit, alpha)`` with :func:`check_clamp` before any work).

    Args:
        forward: ``forward(op, x, limit=7.0, alpha=1.702)`` of the backend.
        backward: ``backward(op, dy, x, limit=7.0, alpha=1.702)`` of the backend.
    """
    table = {}
    for op in FORWARD_OPS:
        pair = _clamped(forward, backward) if op == "clamped_swiglu" else _plain(forward, backward, op)
        table[op] = _named(pair[0], op)
        table[backward_name(op)] = _named(pair[1], backward_name(op))
    return table


def module_getattr(table: Dict[str, Callable], module_name: str) -> Callable[[str], Callable]:
    """A module ``__getattr__`` (PEP 562) that serves the functions of ``table``."""

    def __getattr__(name: str) -> Callable:
        try:
            return table[name]
        except KeyError:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None

    return __getattr__
