"""The value types of the dispatch layer: backend kinds, capabilities and one implementation of an op.

Nothing here imports a tensor library: devices and dtypes are described by plain strings
(``"cuda"``, ``"bfloat16"``), read off tensors by duck typing in :mod:`.devices`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, Optional, Tuple

__all__ = ["BackendImplKind", "Capabilities", "OpImpl", "ArgKey", "parse_arch", "UNDER_COMPILE"]


class BackendImplKind(str, enum.Enum):
    """The three kinds of backend. The policy orders kinds; priority orders impls inside a kind.

    ``DEFAULT`` is the portable Triton backend, named ``flagos`` as upstream TE-FL does.
    """

    DEFAULT = "flagos"
    VENDOR = "vendor"
    REFERENCE = "reference"

    @property
    def default_priority(self) -> int:
        """Priority an impl of this kind gets when it names none: flagos 150, vendor 100, reference 50."""
        return _DEFAULT_PRIORITY[self]

    @classmethod
    def parse(cls, name: "str | BackendImplKind") -> "BackendImplKind":
        """Accept an enum member or its name/value in any case (``"flagos"``, ``"DEFAULT"``, ``"vendor"``)."""
        if isinstance(name, cls):
            return name
        text = str(name).strip().lower()
        for kind in cls:
            if text in (kind.value, kind.name.lower()):
                return kind
        raise ValueError(f"unknown backend kind {name!r}; expected one of flagos, vendor, reference")


_DEFAULT_PRIORITY = {
    BackendImplKind.DEFAULT: 150,
    BackendImplKind.VENDOR: 100,
    BackendImplKind.REFERENCE: 50,
}


@dataclass(frozen=True)
class ArgKey:
    """What the manager knows about the key argument of a call: its device and dtype.

    ``device_type`` is ``"cpu"``, ``"cuda"``, ... ; ``device_index`` is None for devices without one;
    ``dtype`` is the dtype's short name (``"bfloat16"``, ``"float8_e4m3fn"``) or None when the
    key argument carries no dtype.
    """

    device_type: Optional[str]
    device_index: Optional[int]
    dtype: Optional[str]


@dataclass(frozen=True)
class Capabilities:
    """What an implementation can run on, checked before the call.

    Attributes:
        device_types: device types it accepts (``{"cuda"}``); None means any.
        dtypes: dtype short names of the key argument it accepts; None means any.
        min_compute_capability: (major, minor) it needs on devices that report one; None means any.
    """

    device_types: Optional[FrozenSet[str]] = None
    dtypes: Optional[FrozenSet[str]] = None
    min_compute_capability: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        if self.device_types is not None:
            object.__setattr__(self, "device_types", frozenset(d.lower() for d in self.device_types))
        if self.dtypes is not None:
            object.__setattr__(self, "dtypes", frozenset(_short_dtype(d) for d in self.dtypes))
        if self.min_compute_capability is not None:
            major, minor = self.min_compute_capability
            object.__setattr__(self, "min_compute_capability", (int(major), int(minor)))

    def reject_reason(self, key: ArgKey, compute_capability: Optional[Tuple[int, int]]) -> Optional[str]:
        """Why an argument with ``key`` cannot run here, or None when it can."""
        if self.device_types is not None and key.device_type not in self.device_types:
            return f"device {key.device_type!r} not in {sorted(self.device_types)}"
        if self.dtypes is not None and key.dtype is not None and key.dtype not in self.dtypes:
            return f"dtype {key.dtype!r} not in {sorted(self.dtypes)}"
        if self.min_compute_capability is not None and compute_capability is not None:
            if tuple(compute_capability) < self.min_compute_capability:
                need = "%d.%d" % self.min_compute_capability
                have = "%d.%d" % tuple(compute_capability)
                return f"needs compute capability >= {need}, device has {have}"
        return None


def parse_arch(arch: Any) -> Tuple[int, int]:
    """A compute capability from upstream's ``min_arch`` spellings: ``"sm_90"``, ``"sm90a"``, ``"9.0"``, ``90``, ``(9, 0)``.

    >>> parse_arch("sm_80"), parse_arch("8.9"), parse_arch(90), parse_arch((7, 5))
    ((8, 0), (8, 9), (9, 0), (7, 5))
    """
    if isinstance(arch, (tuple, list)) and len(arch) == 2:
        return int(arch[0]), int(arch[1])
    text = str(arch).strip().lower()
    for prefix in ("sm_", "sm"):
        if text.startswith(prefix):
            text = text[len(prefix):].rstrip("af")
            break
    if "." in text:
        major, _, minor = text.partition(".")
        if major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    elif text.isdigit() and len(text) >= 2:
        return int(text[:-1]), int(text[-1])
    raise ValueError(f"min_arch={arch!r} is not a compute capability; use 'sm_80', '8.0', 80 or (8, 0)")


def _short_dtype(name: Any) -> str:
    text = str(name)
    return text[len("torch."):] if text.startswith("torch.") else text


#: The values of :attr:`OpImpl.under_compile`.
UNDER_COMPILE = ("trace", "reference", "custom_op")


@dataclass(frozen=True)
class OpImpl:
    """One implementation of one catalog op.

    Attributes:
        op_name: the catalog op it implements (``"gemm"``).
        impl_id: the backend's id, shared by all its ops, ``"<kind>.<name>"`` by convention
            (``"flagos.triton"``, ``"vendor.cuda"``, ``"reference.torch"``).
        kind: a :class:`BackendImplKind` (or its name).
        fn: the function; its signature must equal the op's declared signature.
        vendor: vendor name, required for VENDOR impls; stored lower-case.
        priority: order inside a kind, larger first; None means the kind's default.
        capabilities: static device / dtype / compute-capability limits, checked before the call.
        supports: optional predicate ``supports(*args, **kwargs) -> bool`` called with the op's
            arguments before the call; returning False passes the call to the next candidate.
        description: one line shown by ``te-fl info``.
        supported_dtypes: upstream TE-FL's field: dtype names the key argument may have; folded
            into ``capabilities.dtypes`` (so a call outside them is passed over, with the reason).
        min_arch: upstream TE-FL's field: the minimum compute capability, ``"sm_80"``, ``"8.0"``,
            ``80`` or ``(8, 0)``; folded into ``capabilities.min_compute_capability``.
        under_compile: how ``torch.compile`` sees a call this impl would run (one of :data:`UNDER_COMPILE`):
            ``"trace"``: Dynamo traces its code, tensor ops that Inductor compiles (the reference backend,
            the cuBLASLt GEMM through ``torch._scaled_mm``) and ``triton.jit`` kernels called as
            ``kernel[grid](...)``, which Inductor launches (flagos dropout); ``"reference"``: the reference
            backend's implementation is traced in its place (a Triton kernel whose work Inductor
            generates itself from those tensor ops, fused with its neighbours); ``"custom_op"``
            (default): the op stays one opaque node of the graph that calls the dispatcher when it runs.
        aten_dtypes: dtype names of the key argument for which this implementation computes exactly what
            PyTorch's own operator computes (vendor.cuda's ``gemm`` on bf16 / fp16 / fp32 operands is
            ``torch.mm`` / ``torch.addmm``). Where the policy picks such an implementation first, a caller
            may run the PyTorch operator itself, with PyTorch's autograd (``te.Linear`` in high precision
            does, see :meth:`~.manager.OpManager.runs_as_aten`); None means none.
    """

    op_name: str
    impl_id: str
    kind: BackendImplKind
    fn: Callable[..., Any]
    vendor: Optional[str] = None
    priority: Optional[int] = None
    capabilities: Capabilities = field(default_factory=Capabilities)
    supports: Optional[Callable[..., bool]] = None
    description: str = ""
    supported_dtypes: Optional[FrozenSet[str]] = None
    min_arch: Any = None
    under_compile: str = "custom_op"
    aten_dtypes: Optional[FrozenSet[str]] = None

    def __post_init__(self):
        kind = BackendImplKind.parse(self.kind)
        if self.under_compile not in UNDER_COMPILE:
            raise ValueError(f"OpImpl {self.impl_id!r}: under_compile={self.under_compile!r} must be one of {UNDER_COMPILE}")
        object.__setattr__(self, "kind", kind)
        if not self.op_name or not self.impl_id:
            raise ValueError("OpImpl needs a non-empty op_name and impl_id")
        if not callable(self.fn):
            raise TypeError(f"OpImpl {self.impl_id!r} for op {self.op_name!r}: fn is not callable")
        if self.supports is not None and not callable(self.supports):
            raise TypeError(f"OpImpl {self.impl_id!r}: supports must be callable or None")
        vendor = self.vendor.strip().lower() if self.vendor else None
        if kind is BackendImplKind.VENDOR and not vendor:
            raise ValueError(f"OpImpl {self.impl_id!r} is of kind vendor and must name its vendor")
        object.__setattr__(self, "vendor", vendor)
        if self.aten_dtypes is not None:
            object.__setattr__(self, "aten_dtypes", frozenset(_short_dtype(d) for d in self.aten_dtypes))
        if self.priority is None:
            object.__setattr__(self, "priority", kind.default_priority)
        if not isinstance(self.capabilities, Capabilities):
            raise TypeError("OpImpl.capabilities must be a Capabilities instance")
        self._fold_upstream_limits()

    def _fold_upstream_limits(self) -> None:
        """Merge upstream's ``supported_dtypes`` / ``min_arch`` into :attr:`capabilities` (stricter wins)."""
        caps = self.capabilities
        dtypes, cc = caps.dtypes, caps.min_compute_capability
        if self.supported_dtypes is not None:
            names = frozenset(_short_dtype(d) for d in self.supported_dtypes)
            object.__setattr__(self, "supported_dtypes", names)
            dtypes = names if dtypes is None else dtypes & names
        if self.min_arch is not None:
            arch = parse_arch(self.min_arch)
            cc = arch if cc is None else max(cc, arch)
        if (dtypes, cc) != (caps.dtypes, caps.min_compute_capability):
            object.__setattr__(self, "capabilities", Capabilities(caps.device_types, dtypes, cc))

    def is_available(self) -> bool:
        """Upstream TE-FL's probe: ``fn._is_available()`` when the function has one; raising counts as False."""
        probe = getattr(self.fn, "_is_available", None)
        if probe is None:
            return True
        try:
            return bool(probe())
        except Exception:  # noqa: BLE001 - a failing probe means "not available", as upstream
            return False

    def same_as(self, other: "OpImpl") -> bool:
        """True when ``other`` registers the very same implementation (same fields, same function)."""
        return (
            self.op_name == other.op_name
            and self.impl_id == other.impl_id
            and self.kind is other.kind
            and _same_callable(self.fn, other.fn)
            and self.vendor == other.vendor
            and self.priority == other.priority
            and self.capabilities == other.capabilities
            and _same_callable(self.supports, other.supports)
            and self.aten_dtypes == other.aten_dtypes
        )


def _same_callable(a, b) -> bool:
    """Identity, except that two bound-method objects of one method on one instance are the same."""
    if a is b:
        return True
    func = getattr(a, "__func__", None)
    return func is not None and func is getattr(b, "__func__", None) and a.__self__ is getattr(b, "__self__", None)
