"""flagos fused softmax family vs the reference backend (forward of each mask kind, backward)."""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_close
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import softmax as fs
from transformer_engine.plugin.backends.reference import softmax as ref

SCALE = 0.7


def _check(name, x, *extra):
    """Forward ``name`` and its backward (at the reference's y) against the reference."""
    y = getattr(fs, name)(x, *extra)
    y_ref = getattr(ref, name)(x, *extra)
    assert_close(y, y_ref, reduction=True)
    backward = name.replace("forward", "backward")
    dy = randn(*y.shape, dtype=x.dtype, device=x.device)
    assert_close(getattr(fs, backward)(dy, y_ref, SCALE), getattr(ref, backward)(dy, y_ref, SCALE), reduction=True)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 37), (2, 3, 5, 37)])
def test_scaled_softmax(shape, dtype, device):
    _check("scaled_softmax_forward", randn(*shape, dtype=dtype, scale=3.0, device=device), SCALE)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("mask_batch", [1, 2])
def test_scaled_masked_softmax(mask_batch, dtype, device):
    x = randn(2, 3, 5, 37, dtype=dtype, scale=3.0, device=device)
    mask = torch.rand(mask_batch, 1, 5, 37) > 0.6
    mask[0, 0, 1] = True  # a fully masked row gives zeros
    _check("scaled_masked_softmax_forward", x, mask.to(device), SCALE)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_scaled_upper_triang_masked_softmax(dtype, device):
    _check("scaled_upper_triang_masked_softmax_forward", randn(6, 13, 13, dtype=dtype, scale=3.0, device=device), SCALE)


@pytest.mark.parametrize("sq, sk", [(5, 37), (7, 7), (9, 4)])
def test_scaled_aligned_causal_masked_softmax(sq, sk, device):
    # sq > sk leaves the first sq - sk rows fully masked: zeros
    _check("scaled_aligned_causal_masked_softmax_forward", randn(2, 3, sq, sk, scale=3.0, device=device), SCALE)


def test_errors_and_supports(device):
    x = randn(2, 3, 4, 5, device=device)
    with pytest.raises(ValueError, match="mask"):
        fs.scaled_masked_softmax_forward(x, torch.zeros(2, 2, 4, 5, dtype=torch.bool, device=device), SCALE)
    with pytest.raises(ValueError, match=r"\[b\*h, sq, sk\]"):
        fs.scaled_upper_triang_masked_softmax_forward(x, SCALE)
    verdict = fs.SUPPORTS["scaled_softmax_forward"](torch.empty(2, 40000, device=device), SCALE)
    assert not verdict and "40000" in verdict.reason
    assert fs.SUPPORTS["scaled_softmax_backward"](x, x, SCALE)


@pytest.mark.gpu
def test_large_gpu():
    x = randn(4, 16, 1023, 1025, dtype=torch.bfloat16, scale=3.0, device="cuda")
    _check("scaled_aligned_causal_masked_softmax_forward", x, SCALE)
    mask = (torch.rand(4, 1, 1023, 1025, device="cuda") > 0.5)
    _check("scaled_masked_softmax_forward", x, mask, SCALE)
