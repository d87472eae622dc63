"""The backends this package ships: the list the plugin core loads before any out-of-tree plugin.

The core (:mod:`.core`) names no backend. Its bootstrap hook (:func:`.core.discovery.builtin_provider`)
reads :func:`builtin_backends` of this module, the ``builtin`` module beside the core package, unless a
host registered another provider with :func:`.core.discovery.set_builtin_provider`. Each backend is a
plugin like any other (a module with ``register(registry)``), loaded in this order; one whose
dependency is absent here (no triton, a ROCm build) is recorded as not loaded, never raised.
"""

from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["BUILTIN_BACKENDS", "CUDA_BACKEND", "builtin_backends"]

#: The in-tree backends, in load order: the numerical oracle first, then the portable Triton kernels,
#: then the vendor libraries.
BUILTIN_BACKENDS: Tuple[str, ...] = (
    "transformer_engine.plugin.backends.reference",
    "transformer_engine.plugin.backends.flagos",
    "transformer_engine.plugin.backends.vendor.cuda",
)

#: The CUDA vendor backend, which ``TE_FL_SKIP_CUDA=1`` leaves out.
CUDA_BACKEND = "transformer_engine.plugin.backends.vendor.cuda"


def builtin_backends(cfg) -> Tuple[Tuple[str, Optional[str]], ...]:
    """``((module, why it is skipped, or None), ...)`` for each in-tree backend, in load order.

    Args:
        cfg: the validated environment (:class:`~.core.config.EnvConfig`); with ``cfg.skip_cuda``
            (``TE_FL_SKIP_CUDA=1``) the CUDA vendor backend is skipped.
    """
    return tuple((name, "TE_FL_SKIP_CUDA=1" if cfg.skip_cuda and name == CUDA_BACKEND else None) for name in BUILTIN_BACKENDS)
