"""Shared pytest configuration.

- the ``gpu`` marker skips tests when no CUDA device is present;
- every test seeds torch with ``TE_FL_TEST_SEED + crc32(test id)``: each test draws its own fresh
  inputs, and a failure reproduces from the seed alone;
- on a machine with a GPU, a test without the ``gpu`` marker runs as on a CPU-only machine (as in CI):
  ``torch.cuda.is_available()`` answers False inside it, so modules default to the CPU like its inputs.
"""

import importlib.util
import os
import zlib

import pytest

_HAS_TORCH = importlib.util.find_spec("torch") is not None


def _has_cuda() -> bool:
    if not _HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """torch.manual_seed(TE_FL_TEST_SEED + crc32(test id)) when torch is installed."""
    if not _HAS_TORCH:
        return
    import torch

    base = int(os.environ.get("TE_FL_TEST_SEED", "0"))
    torch.manual_seed(base + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _cpu_only_unless_gpu_marked(request, monkeypatch):
    """Hide the GPU from tests without the ``gpu`` marker (see the module docstring)."""
    if "gpu" in request.keywords or not _has_cuda():
        return
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test (compiled graphs keep the tensors they traced alive)."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
