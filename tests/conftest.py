"""Shared pytest configuration: the ``gpu`` marker skips tests when no CUDA device is present."""

import os

import pytest

os.environ.setdefault("TE_FL_TEST_SEED", "0")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
