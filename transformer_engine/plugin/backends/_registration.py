"""Helpers shared by the in-tree backends: turning a module's functions into OpImpls.

A backend module lists the ops it implements in ``__all__``, each function named after its op.
``SUPPORTS`` (optional, a dict op name -> predicate) and ``CAPABILITIES`` (optional, a dict op name
-> :class:`Capabilities`) refine single ops. ``DISPATCHED`` (optional, a dict op name -> function) names
the function the dispatcher calls when it is not the public one: a public function that checks its
arguments against ``SUPPORTS`` for direct calls can hand the dispatcher, which has checked them already,
its unchecked body. ``UNDER_COMPILE`` (optional, a dict op name -> one of ``"trace"``, ``"reference"``,
``"custom_op"``) overrides the backend's ``under_compile`` for single ops (see :class:`OpImpl`). ``ATEN_DTYPES``
(optional, a dict op name -> dtypes) declares the dtypes for which an op is exactly PyTorch's own operator
(:attr:`OpImpl.aten_dtypes`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterable, List, Optional

from transformer_engine.plugin.core.types import BackendImplKind, Capabilities, OpImpl

__all__ = ["impls_from_modules", "register_torch_capability_probe"]


def impls_from_modules(
    modules: Iterable[ModuleType],
    impl_id: str,
    kind: BackendImplKind,
    capabilities: Capabilities,
    vendor: Optional[str] = None,
    description: str = "",
    under_compile: str = "custom_op",
) -> List[OpImpl]:
    """One OpImpl per name in each module's ``__all__`` (``under_compile``: how torch.compile sees them, see :class:`OpImpl`)."""
    impls = []
    for module in modules:
        supports = getattr(module, "SUPPORTS", {})
        caps = getattr(module, "CAPABILITIES", {})
        dispatched = getattr(module, "DISPATCHED", {})
        compiled = getattr(module, "UNDER_COMPILE", {})
        aten = getattr(module, "ATEN_DTYPES", {})
        for name in module.__all__:
            impls.append(
                OpImpl(
                    op_name=name,
                    impl_id=impl_id,
                    kind=kind,
                    fn=dispatched.get(name) or getattr(module, name),
                    vendor=vendor,
                    capabilities=caps.get(name, capabilities),
                    supports=supports.get(name),
                    description=description,
                    under_compile=compiled.get(name, under_compile),
                    aten_dtypes=aten.get(name),
                )
            )
    return impls


def register_torch_capability_probe() -> None:
    """Let the core read CUDA compute capability through torch (idempotent)."""
    import torch

    from transformer_engine.plugin.core.devices import register_capability_probe

    def probe(index):
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())

    register_capability_probe("cuda", probe)
