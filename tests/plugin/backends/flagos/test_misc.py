"""flagos cross entropy vs the reference backend: online logsumexp, label smoothing, ignored rows."""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_close
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import misc as fm
from transformer_engine.plugin.backends.reference import misc as ref


def _targets(n, vocab, device):
    target = torch.randint(0, vocab, (n,))
    target[1] = -100  # ignored row
    return target.to(device)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("vocab", [1, 37, 5003])  # 5003: two blocks of the online logsumexp
def test_cross_entropy(vocab, dtype, label_smoothing, device):
    logits = randn(4, vocab, dtype=dtype, scale=4.0, device=device)
    target = _targets(4, vocab, device)
    loss, lse = fm.cross_entropy_fwd(logits, target, label_smoothing)
    loss_ref, lse_ref = ref.cross_entropy_fwd(logits, target, label_smoothing)
    assert_close(loss, loss_ref, reduction=True)
    assert_close(lse, lse_ref, reduction=True)
    assert loss[1].item() == 0.0
    grad = randn(4, device=device)
    dz = fm.cross_entropy_bwd(grad, logits, target, lse_ref, label_smoothing)
    assert_close(dz, ref.cross_entropy_bwd(grad, logits, target, lse_ref, label_smoothing), reduction=True)
    assert not bool(dz[1].cpu().any())


def test_broadcast_grad_strided_logits_custom_ignore_index(device):
    logits = randn(3, 40, device=device)[:, 2:35]  # row stride 40
    target = torch.tensor([4, 7, 0], device=device)
    loss, lse = fm.cross_entropy_fwd(logits, target, 0.0, 7)
    assert_close(loss, ref.cross_entropy_fwd(logits, target, 0.0, 7)[0], reduction=True)
    grad = torch.ones(1, device=device).expand(3)  # the mean-reduction gradient, stride 0
    assert_close(fm.cross_entropy_bwd(grad, logits, target, lse, 0.0, 7), ref.cross_entropy_bwd(grad, logits, target, lse, 0.0, 7), reduction=True)


def test_out_of_range_target_gives_nan(device):
    loss, _ = fm.cross_entropy_fwd(randn(2, 5, device=device), torch.tensor([1, 5], device=device))
    assert math.isfinite(loss[0].item()) and math.isnan(loss[1].item())


def test_errors_and_supports(device):
    logits = randn(2, 5, device=device)
    with pytest.raises(ValueError, match="2-D"):
        fm.cross_entropy_fwd(logits[None], torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="integer"):
        fm.cross_entropy_fwd(logits, torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="lse"):
        fm.cross_entropy_bwd(torch.ones(2, device=device), logits, torch.zeros(2, dtype=torch.long, device=device), torch.ones(3, device=device))
    if device == "cuda":
        verdict = fm.SUPPORTS["cross_entropy_fwd"](logits, torch.zeros(2, dtype=torch.long))
        assert not verdict and "cpu" in verdict.reason
    assert fm.SUPPORTS["cross_entropy_fwd"](logits, torch.zeros(2, dtype=torch.long, device=device))


@pytest.mark.gpu
def test_large_gpu():
    logits = randn(4097, 32003, dtype=torch.bfloat16, scale=4.0, device="cuda")
    target = _targets(4097, 32003, "cuda")
    loss, lse = fm.cross_entropy_fwd(logits, target, 0.1)
    loss_ref, lse_ref = ref.cross_entropy_fwd(logits, target, 0.1)
    assert_close(loss, loss_ref, reduction=True)
    assert_close(lse, lse_ref, reduction=True)
    grad = randn(4097, device="cuda")
    assert_close(fm.cross_entropy_bwd(grad, logits, target, lse, 0.1), ref.cross_entropy_bwd(grad, logits, target, lse_ref, 0.1))
