"""``activation_recompute_forward``: a region recomputed by the client's own machinery (Megatron-LM's
``CheckpointWithoutOutput``) casts with its first run's scales and advances the scaling state once."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.distributed import (
    activation_recompute_forward, in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled,
)

RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)


def _state(module):
    return {role: tuple(getattr(module.fp8_meta[role], name).clone() for name in ("amax_history", "scale", "scale_inv"))
            for role in ("scaling_fwd", "scaling_bwd")}


def _assert_same_state(a, b):
    for role in a:
        for x, y in zip(a[role], b[role]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _warm(module, steps=2):
    """A few plain FP8 steps, so that the scales have moved off 1."""
    for i in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + i)) * (i + 2)
        with te.autocast(recipe=RECIPE):
            y = module(x)
        y.float().square().mean().backward()
    module.zero_grad(set_to_none=True)


def test_recomputed_region_matches_a_plain_step():
    torch.manual_seed(0)
    plain = te.Linear(32, 24)
    _warm(plain)
    recomputed = copy.deepcopy(plain)
    x = torch.randn(16, 32) * 40  # a new amax maximum: the forward update moves the scales
    dy = torch.randn(16, 24)

    # plain step
    x_plain = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=RECIPE):
        y_plain = plain(x_plain)
    y_plain.backward(dy)

    before = _state(recomputed)
    # first run without a graph, then (in "backward") the recomputation inside the client's autocast
    with te.autocast(recipe=RECIPE):
        with torch.no_grad(), activation_recompute_forward(activation_recompute=True, recompute_phase=False):
            assert is_fp8_activation_recompute_enabled() and not in_fp8_activation_recompute_phase()
            y_first = recomputed(x)
    after_forward = _state(recomputed)
    assert not torch.equal(after_forward["scaling_fwd"][1], before["scaling_fwd"][1])
    x_re = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=RECIPE), activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        assert in_fp8_activation_recompute_phase()
        y_re = recomputed(x_re)
    assert not is_fp8_activation_recompute_enabled()
    # the recomputation cast with the first run's scales, though the forward update has moved them since
    torch.testing.assert_close(y_re, y_first, rtol=0, atol=0)
    torch.testing.assert_close(y_re, y_plain.detach(), rtol=0, atol=0)
    # and queued no second forward update: the forward state is what the first run left
    _assert_same_state({"scaling_fwd": after_forward["scaling_fwd"]}, {"scaling_fwd": _state(recomputed)["scaling_fwd"]})
    y_re.backward(dy)
    torch.testing.assert_close(x_re.grad, x_plain.grad, rtol=0, atol=0)
    torch.testing.assert_close(recomputed.weight.grad, plain.weight.grad, rtol=0, atol=0)
    _assert_same_state(_state(recomputed), _state(plain))


def test_recomputations_take_the_first_runs_scales_in_order():
    """Two micro-batches run first, then are recomputed first-in first-out."""
    torch.manual_seed(1)
    module = te.Linear(32, 24)
    _warm(module)
    xs = [torch.randn(16, 32) * s for s in (2.0, 9.0)]
    firsts = []
    for x in xs:
        with te.autocast(recipe=RECIPE):
            with torch.no_grad(), activation_recompute_forward(activation_recompute=True, recompute_phase=False):
                firsts.append(module(x))
    for x, first in zip(xs, firsts):
        with te.autocast(recipe=RECIPE), activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            torch.testing.assert_close(module(x), first, rtol=0, atol=0)


def test_without_activation_recompute_it_changes_nothing():
    with activation_recompute_forward(activation_recompute=False, recompute_phase=True):
        assert not is_fp8_activation_recompute_enabled() and not in_fp8_activation_recompute_phase()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_te_checkpoint_still_replays_scales(use_reentrant):
    torch.manual_seed(2)
    plain = te.Linear(32, 24)
    _warm(plain)
    checkpointed = copy.deepcopy(plain)
    x = torch.randn(16, 32) * 5
    outs = []
    for module, wrap in ((plain, lambda f, a: f(a)), (checkpointed, lambda f, a: te.checkpoint(f, a, use_reentrant=use_reentrant))):
        xi = x.clone().requires_grad_(requires_grad=True)
        with te.autocast(recipe=RECIPE):
            y = wrap(module, xi)
        y.float().square().mean().backward()
        outs.append((y.detach(), xi.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _assert_same_state(_state(checkpointed), _state(plain))
