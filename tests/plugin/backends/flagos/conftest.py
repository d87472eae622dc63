"""Runs the flagos kernels on the device Triton can use here.

With a CUDA GPU the kernels are compiled and the tests use ``cuda`` tensors (they are marked ``gpu``,
so the root conftest does not hide the GPU from them). Without one, the
kernel modules are imported with ``TRITON_INTERPRET=1`` (``_interpreter.py``, called by the root
conftest when pytest starts), so they run in Triton's CPU interpreter on ``cpu`` tensors.
If Triton was imported compiled before that, the tests here are skipped with that reason, and the
root conftest fails the session because this tier, expected to run here, ran nothing.
"""

import os
import zlib

import pytest
import torch

from tests.plugin.backends.flagos._interpreter import import_kernels

# the root conftest already imported the kernels at startup (see _interpreter.py); this is a no-op then
_SKIP_REASON = import_kernels()
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
