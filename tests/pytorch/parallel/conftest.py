"""Fixtures of the multi-process tests: pools of ranks (gloo on CPU; nccl on GPUs, ``gpu``-marked).

``ranks`` runs a test at world sizes 2 and 4; ``ranks2`` at world size 2 only. The nccl variants need
as many GPUs as ranks and are skipped otherwise.
"""

import pytest
import torch

from tests.pytorch.parallel._ranks import close_pools, get_pool


def _pool(request):
    backend, world_size = request.param
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"nccl with {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}")
    return get_pool(world_size, backend)


def _params(*world_sizes):
    gloo = [pytest.param(("gloo", n), id=f"gloo{n}") for n in world_sizes]
    nccl = [pytest.param(("nccl", n), id=f"nccl{n}", marks=pytest.mark.gpu) for n in world_sizes]
    return gloo + nccl


@pytest.fixture(params=_params(2, 4))
def ranks(request):
    """A pool of 2 or 4 ranks."""
    return _pool(request)


@pytest.fixture(params=_params(2))
def ranks2(request):
    """A pool of 2 ranks."""
    return _pool(request)


@pytest.fixture(scope="session", autouse=True)
def _stop_pools():
    yield
    close_pools()
