"""``ops``: one callable per catalog op, dispatching through the default manager.

    from transformer_engine.plugin import ops
    y, mean, rstd = ops.layernorm_fwd(x, weight, bias, 1e-5, False, None, None)

Each attribute is the op's dispatcher, built on first access (``ops.gemm.spec`` is its declaration, ``ops.gemm.traced``
also returns the impl that ran). Nothing is imported or registered until the first call.
"""

from __future__ import annotations

from typing import Callable, List

from .core.catalog import list_specs
from .core.manager import get_default_manager

__all__ = ["OpNamespace"]


class OpNamespace:
    """Attribute access to the dispatchers of one manager (the default one unless given)."""

    def __init__(self, manager=None):
        self._manager = manager

    def _dispatcher(self, name: str) -> Callable:
        return (self._manager or get_default_manager()).dispatcher(name)

    def __getattr__(self, name: str) -> Callable:
        # built on first use and then kept as an instance attribute (no cost at import)
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn = self._dispatcher(name)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None
        setattr(self, name, fn)
        return fn

    def __dir__(self) -> List[str]:
        return sorted(spec.name for spec in list_specs())
