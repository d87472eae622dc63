"""``ops``: one callable per catalog op, dispatching through the default manager.

    from transformer_engine.plugin import ops
    y, mean, rstd = ops.layernorm_fwd(x, weight, bias, 1e-5, False, None, None)

Each attribute is the op's dispatcher, built on first access (``ops.gemm.spec`` is its declaration, ``ops.gemm.traced``
also returns the impl that ran). Nothing is imported or registered until the first call. The default
namespace's dispatchers also trace under ``torch.compile``, each as one custom op (:mod:`._compile`);
:func:`prepare_for_compile` builds them all ahead (a dispatcher first built inside a traced function
would be traced too).
"""

from __future__ import annotations

import sys
from typing import Callable, List, Tuple

from .core.catalog import list_specs
from .core.manager import get_default_manager

__all__ = ["OpNamespace"]


class OpNamespace:
    """Attribute access to the dispatchers of one manager (the default one unless given)."""

    def __init__(self, manager=None):
        self._manager = manager
        self._prepared = False

    def _dispatcher(self, name: str) -> Tuple[Callable, bool]:
        """(the op's callable, whether it is final): the default namespace's is traceable once torch is
        imported; before, the plain dispatcher (so that naming an op imports no framework), not kept."""
        if self._manager is not None:
            return self._manager.dispatcher(name), True
        manager = get_default_manager()
        dispatcher = manager.dispatcher(name)
        if "torch" not in sys.modules:
            return dispatcher, False
        from ._compile import traceable

        def reference(*args):
            """The reference backend's implementation, looked up when a traced call needs it (building a
            dispatcher loads no backend)."""
            impl = manager.reference_impl(name)
            if impl is None:
                raise NotImplementedError(f"op {name!r} has no reference implementation to trace it with under torch.compile")
            return impl.fn(*args)

        return traceable(dispatcher.spec, dispatcher, reference, lambda key: manager.compiled_form(name, key)), True

    def prepare_for_compile(self) -> None:
        """Build every op's dispatcher now (each is otherwise built on its first use); once per namespace."""
        if self._prepared:
            return
        for spec in list_specs():
            getattr(self, spec.name)
        self._prepared = True

    def __getattr__(self, name: str) -> Callable:
        # built on first use and then kept as an instance attribute (no cost at import)
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn, final = self._dispatcher(name)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None
        if final:
            setattr(self, name, fn)
        return fn

    def __dir__(self) -> List[str]:
        return sorted(spec.name for spec in list_specs())
