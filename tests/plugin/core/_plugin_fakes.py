"""Torch-free stand-ins for the dispatch tests: tensor-like objects and impl factories.

The catalog's ``relu(x)``, ``dgelu(dy, x)``, ``clamped_swiglu(x, limit, alpha)`` and the in-place
``multi_tensor_scale`` are used as test ops; every impl returns its own tag, so a result says which
implementation ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from transformer_engine.plugin.core import BackendImplKind, OpImpl, OpManager, OpRegistry


@dataclass(frozen=True)
class FakeDevice:
    """Looks like ``torch.device``: a type and an optional index."""

    type: str
    index: Optional[int] = None


class FakeTensor:
    """Anything with ``.device`` and ``.dtype`` is a key argument for the manager."""

    def __init__(self, device: str = "cpu", dtype: str = "float32", index: Optional[int] = None, bad: bool = False):
        self.device = FakeDevice(device, index)
        self.dtype = dtype
        self.bad = bad  # impls made with fail_on_bad=True raise on such inputs


def relu_impl(tag: str, fail_on_bad: bool = False, always_fail: bool = False, calls: Optional[list] = None) -> Callable:
    """A ``relu(x)`` impl returning ``tag``; it can raise on ``x.bad`` or always, and log its calls."""

    def relu(x):
        if calls is not None:
            calls.append(tag)
        if always_fail or (fail_on_bad and getattr(x, "bad", False)):
            raise RuntimeError(f"{tag} cannot do this")
        return tag

    return relu


def make_impl(impl_id: str, fn: Optional[Callable] = None, op: str = "relu", **fields) -> OpImpl:
    """An OpImpl whose kind and vendor are read off ``impl_id`` (``"vendor.acme"`` -> vendor acme)."""
    prefix, _, name = impl_id.partition(".")
    kind = fields.pop("kind", BackendImplKind.parse(prefix))
    if kind is BackendImplKind.VENDOR:
        fields.setdefault("vendor", name)
    return OpImpl(op_name=op, impl_id=impl_id, kind=kind, fn=fn or relu_impl(impl_id), **fields)


def make_manager(*impls: OpImpl) -> OpManager:
    """A fresh manager over a fresh registry holding ``impls`` (no built-ins, no discovery)."""
    registry = OpRegistry()
    registry.register_many(impls)
    return OpManager(registry, load_builtins=False, discover=False)


def three_kinds(**fail) -> OpManager:
    """relu implemented by flagos.triton, vendor.acme and reference.torch (tags = impl ids)."""
    return make_manager(
        make_impl("flagos.triton", relu_impl("flagos.triton", **fail)),
        make_impl("vendor.acme"),
        make_impl("reference.torch"),
    )


def explained_order(manager, op: str = "relu", x=None) -> list:
    """The impl ids ``manager.explain`` would try for ``op`` on ``x`` (a cpu float32 FakeTensor by default), in order."""
    return [d.impl_id for d in manager.explain(op, FakeTensor() if x is None else x) if d.status != "rejected"]
