"""Import the flagos kernel modules the way this machine can run them.

With a CUDA GPU the kernels are imported compiled. Without one they are imported with
``TRITON_INTERPRET=1`` so that they run in Triton's CPU interpreter. Triton decides at decoration
time, and Triton's own jit helpers (``tl.sum``, ``tl.max``, ``tl.zeros``, ...) are decorated when
``triton`` itself is imported: so ``triton`` must not be imported before the variable is set, or
no interpreted kernel could run. The root ``tests/conftest.py`` calls :func:`import_kernels` when
pytest starts, before any test module (or a doctest of the package) can import Triton; the variable
is restored afterwards so that the rest of a session does not route CPU calls to the (slow)
interpreted backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

FAMILIES = ("activation", "attention", "misc", "normalization", "optimizer", "quantization", "rope", "softmax")
PACKAGE = "transformer_engine.plugin.backends.flagos"

_COMPILED = (
    "the flagos kernels were imported compiled before the test conftest could set TRITON_INTERPRET=1 and there "
    "is no GPU; run `TRITON_INTERPRET=1 python -m pytest tests/plugin/backends/flagos`"
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _import_all() -> None:
    for name in FAMILIES:
        importlib.import_module(f"{PACKAGE}.{name}")


def _import_interpreted() -> str:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        common = importlib.import_module(f"{PACKAGE}._common")
        _import_all()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return "" if common.INTERPRET else _COMPILED


def import_kernels() -> str:
    """Import the kernel modules (interpreted without a GPU); '' when they can run here, else why not.

    Idempotent: a second call reads how the first one imported them.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if _cuda():
        _import_all()
        return ""
    common = sys.modules.get(f"{PACKAGE}._common")
    if common is not None:
        return "" if common.INTERPRET else _COMPILED
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "triton was imported (by a pytest plugin, sitecustomize or an earlier import) before tests/conftest.py "
            "could set TRITON_INTERPRET=1, and there is no GPU: Triton's own helpers are compiled and cannot run in "
            "the interpreter; run `TRITON_INTERPRET=1 python -m pytest ...` or find the importer (python -X importtime)"
        )
    return _import_interpreted()
