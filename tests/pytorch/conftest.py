"""Per-test seeding for the PyTorch module tests: fresh inputs per test, reproducible from ``TE_FL_TEST_SEED``."""

import os
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """torch.manual_seed(TE_FL_TEST_SEED + crc32(test id))."""
    base = int(os.environ.get("TE_FL_TEST_SEED", "0"))
    torch.manual_seed(base + zlib.crc32(request.node.nodeid.encode()))
