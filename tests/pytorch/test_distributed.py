"""CudaRNGStatesTracker and te.checkpoint: recomputation gives identical outputs, gradients and FP8 state."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

HIDDEN, FFN, HEADS, S, B = 32, 64, 4, 8, 2


def _tracker(seed=1234):
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    return tracker


def test_tracker_streams_are_reproducible_and_isolated():
    tracker = _tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork leaves the default generator alone"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second), "the stream advances across forks"
    saved = tracker.get_states()
    with tracker.fork():
        third = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        torch.testing.assert_close(torch.rand(4), third, rtol=0, atol=0)
    with _tracker().fork():
        torch.testing.assert_close(torch.rand(4), first, rtol=0, atol=0)


def test_tracker_errors_and_reset():
    tracker = _tracker(7)
    assert tracker.is_initialized()
    with pytest.raises(ValueError, match="seed 7"):
        tracker.add("other", 7)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 8)
    with pytest.raises(ValueError, match="was not added"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert not tracker.is_initialized()
    tracker.add("model-parallel-rng", 7)


def _layer(**kwargs):
    return te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=2, **kwargs)


def _run(layer, x, use_checkpoint, use_reentrant, recipe=None, inner_autocast=False, tracker=None):
    """One training step: (out, x.grad, parameter grads)."""
    x = x.detach().clone().requires_grad_(requires_grad=True)
    outer = te.autocast(enabled=True, recipe=recipe) if recipe is not None and not inner_autocast else contextlib.nullcontext()

    def body(inp):
        if inner_autocast:
            with te.autocast(enabled=True, recipe=recipe):
                return layer(inp)
        return layer(inp)

    with outer:
        if use_checkpoint:
            out = te.checkpoint(body, x, use_reentrant=use_reentrant, get_rng_state_tracker=tracker and (lambda: tracker))
        else:
            out = body(x)
    out.backward(torch.ones_like(out))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_replays_dropout_exactly(use_reentrant, device):
    """Hidden dropout (default generator) and attention dropout (tracker stream) are drawn again identically
    (on a GPU the tracker's streams are generator objects: their snapshot and restore are clones)."""
    tracker = _tracker()
    layer = _layer(hidden_dropout=0.2, attention_dropout=0.2, get_rng_state_tracker=lambda: tracker, device=device).train()
    x = randn(S, B, HIDDEN, device=device)
    results = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)  # seeds the CUDA generators too
        tracker.reset()
        tracker.add("model-parallel-rng", 99)
        results.append(_run(layer, x, use_checkpoint, use_reentrant, tracker=tracker))
    _assert_same(*results)


def _scaling_state(layer):
    state = {}
    for name, module in layer.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if meta and meta.get("scaling_fwd") is not None:
            for direction in ("scaling_fwd", "scaling_bwd"):
                for key in ("scale", "scale_inv", "amax_history"):
                    state[f"{name}.{direction}.{key}"] = getattr(meta[direction], key).clone()
    return state


@pytest.mark.parametrize(
    "use_reentrant,inner_autocast",
    # autocast inside a reentrant checkpoint runs its first pass under no_grad: as in TE, no update then
    [(True, False), (False, False), (False, True)],
)
def test_checkpoint_replays_delayed_scaling(use_reentrant, inner_autocast):
    """Three FP8 steps with and without checkpointing: same outputs, gradients and scaling histories."""
    plain = _layer(hidden_dropout=0.0, attention_dropout=0.0)
    checkpointed = copy.deepcopy(plain)
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    for step in range(3):
        x = randn(S, B, HIDDEN, scale=1.0 + step)
        want = _run(plain, x, use_checkpoint=False, use_reentrant=use_reentrant, recipe=recipe, inner_autocast=inner_autocast)
        got = _run(checkpointed, x, use_checkpoint=True, use_reentrant=use_reentrant, recipe=recipe, inner_autocast=inner_autocast)
        _assert_same(got, want)
        state_want, state_got = _scaling_state(plain), _scaling_state(checkpointed)
        assert state_want and state_want.keys() == state_got.keys()
        for key in state_want:
            torch.testing.assert_close(state_got[key], state_want[key], rtol=0, atol=0, msg=key)


def test_checkpoint_current_scaling():
    plain = _layer(hidden_dropout=0.0, attention_dropout=0.0)
    checkpointed = copy.deepcopy(plain)
    x = randn(S, B, HIDDEN)
    _assert_same(_run(checkpointed, x, use_checkpoint=True, use_reentrant=True, recipe=Float8CurrentScaling()),
                 _run(plain, x, use_checkpoint=False, use_reentrant=True, recipe=Float8CurrentScaling()))


def test_checkpoint_plain_function_and_kwargs():
    weight = randn(4, 4).requires_grad_(requires_grad=True)
    x = randn(3, 4).requires_grad_(requires_grad=True)

    def f(inp, scale=1.0):
        return torch.tanh(inp @ weight) * scale

    out = te.checkpoint(f, x, scale=2.0)
    out.sum().backward()
    gx, gw = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    f(x, scale=2.0).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)
    torch.testing.assert_close(gw, weight.grad, rtol=0, atol=0)


def test_legacy_positional_form_warns():
    layer = torch.nn.Linear(4, 4)
    x = randn(2, 4).requires_grad_(requires_grad=True)
    with pytest.warns(DeprecationWarning, match="positionally"):
        out = te.checkpoint(layer, False, None, None, x)  # noqa: FBT003 - the legacy positional form is what is tested
    out.sum().backward()
    assert x.grad is not None


def test_torch_options_need_non_reentrant():
    with pytest.raises(ValueError, match="use_reentrant=False"):
        te.checkpoint(torch.nn.Linear(2, 2), randn(1, 2), determinism_check="none")
