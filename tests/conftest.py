"""Shared pytest configuration.

- the ``gpu`` marker skips tests when no CUDA device is present;
- every test seeds torch with ``TE_FL_TEST_SEED + crc32(test id)``: each test draws its own fresh
  inputs, and a failure reproduces from the seed alone.
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
