"""Runs the flagos kernels on the device Triton can use here.

With a CUDA GPU the kernels are compiled and the tests use ``cuda`` tensors (they are marked ``gpu``,
so the root conftest does not hide the GPU from them). Without one, the
kernel modules are imported with ``TRITON_INTERPRET=1`` (Triton decides at decoration time), so
they run in Triton's CPU interpreter on ``cpu`` tensors; the variable is restored afterwards so
that the rest of a test session does not route CPU calls to the (slow) interpreted backend.
If the modules were already imported compiled, the tests here are skipped with that reason.
"""

import importlib
import importlib.util
import os
import sys
import zlib

import pytest
import torch

_FAMILIES = ("activation", "attention", "misc", "normalization", "optimizer", "quantization", "rope", "softmax")
_PACKAGE = "transformer_engine.plugin.backends.flagos"


def _import_kernels() -> str:
    """Import the kernel modules (interpreted without a GPU); '' on success, else why not."""
    # no `import triton` before TRITON_INTERPRET=1 is set: Triton's own jit helpers (tl.sum, tl.max,
    # tl.zeros, ...) are decorated at that import, and compiled ones cannot run in the interpreter
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if "triton" in sys.modules and not interpreting and not torch.cuda.is_available():
        return "triton was imported before this conftest could set TRITON_INTERPRET=1 and there is no GPU"
    if torch.cuda.is_available():
        for name in _FAMILIES:
            importlib.import_module(f"{_PACKAGE}.{name}")
        return ""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        common = importlib.import_module(f"{_PACKAGE}._common")
        for name in _FAMILIES:
            importlib.import_module(f"{_PACKAGE}.{name}")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    if not common.INTERPRET:
        return (
            "the flagos kernels were imported compiled before this conftest could set TRITON_INTERPRET=1 "
            "and there is no GPU; run `TRITON_INTERPRET=1 python -m pytest tests/plugin/backends/flagos`"
        )
    return ""


_SKIP_REASON = _import_kernels()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    # the interpreter evaluates kernels with numpy, which warns on exp overflow and inf * 0 (the
    # kernels handle both); those warnings say nothing about the kernels
    quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=_SKIP_REASON) if _SKIP_REASON else quiet)
            if DEVICE == "cuda":  # they run on the GPU: the root conftest must not hide it from them
                item.add_marker(pytest.mark.gpu)


@pytest.fixture
def device() -> str:
    """Where the kernels run: "cuda" with a GPU, else "cpu" (Triton interpreter)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """torch.manual_seed(TE_FL_TEST_SEED + crc32(test id)): fresh, reproducible inputs per test."""
    base = int(os.environ.get("TE_FL_TEST_SEED", "0"))
    torch.manual_seed(base + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _interpret_during_test(monkeypatch):
    """Keep TRITON_INTERPRET=1 while an interpreted kernel runs: Triton also reads it at launch
    (its lazy imports and constexpr functions), not only when the kernels are decorated."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
