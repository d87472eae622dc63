"""Delayed scaling, step by step, against a hand-computed history and scale (TE's test_recipe.py ideas)."""

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.quantization import delayed_update
from transformer_engine.pytorch.quantization.delayed_update import reduce_and_update
from transformer_engine.pytorch.quantization.recipe_state import DelayedScalingRecipeState
from transformer_engine.pytorch.quantization.scaling import FP32_MAX


class _Oracle:
    """Float64 bookkeeping of TE's update: amax before the roll, scale = (fp8_max / amax) / 2^margin."""

    def __init__(self, length, n, fp8_max, recipe):
        self.h = [[0.0] * n for _ in range(length)]
        self.s = [1.0] * n
        self.fp8_max, self.recipe = fp8_max, recipe

    def record(self, j, amax):
        self.h[0][j] = max(self.h[0][j], amax)

    def update(self):
        for j, new in enumerate(self.h[0]):
            if new == 0.0:  # the slot was not cast this step: untouched
                continue
            column = [row[j] for row in self.h]
            amax = max(column) if self.recipe.amax_compute_algo == "max" else new
            if math.isfinite(amax) and amax > 0:
                s = self.fp8_max / amax / 2.0**self.recipe.margin
                self.s[j] = FP32_MAX if s > FP32_MAX else s
            for i in range(len(self.h) - 1):  # roll by -1, zero row 0
                self.h[i][j] = self.h[i + 1][j]
            self.h[-1][j], self.h[0][j] = new, 0.0

    def check(self, state):
        torch.testing.assert_close(state.amax_history, torch.tensor(self.h, dtype=torch.float32), rtol=0, atol=0)
        torch.testing.assert_close(state.scale, torch.tensor(self.s, dtype=torch.float32), rtol=1e-6, atol=0)
        torch.testing.assert_close(state.scale_inv, 1.0 / state.scale, rtol=0, atol=0)


@pytest.mark.parametrize("history_len", [1, 3, 31])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_linear_module_scale_update_step_by_step(history_len, algo):
    recipe = DelayedScaling(margin=2, amax_history_len=history_len, amax_compute_algo=algo)
    layer = te.Linear(32, 16)
    fwd, bwd = _Oracle(history_len, 3, 448.0, recipe), _Oracle(history_len, 2, 57344.0, recipe)
    microbatch = [None, None, True, False, None]
    for step, first in enumerate(microbatch):
        x = torch.randn(16, 32) * (step + 1)
        g = torch.randn(16, 16) * 0.1 * (step + 1)
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x, is_first_microbatch=first)
        fwd.record(0, x.abs().max().item())
        if first is not False:  # a cached weight is not cast again, so its amax is not recorded
            fwd.record(1, layer.weight.detach().abs().max().item())
        fwd.update()
        fwd.check(layer.fp8_meta["scaling_fwd"])
        (y * g).sum().backward()
        bwd.record(0, g.abs().max().item())
        bwd.update()
        bwd.check(layer.fp8_meta["scaling_bwd"])


def test_numeric_scenarios_zero_tiny_normal_inf_nan():
    recipe = DelayedScaling(margin=1, amax_history_len=3)
    state = DelayedScalingRecipeState(recipe, "forward", 5, "cpu")
    state.scale.fill_(2.0)
    state.amax_history[0] = torch.tensor([0.0, 1e-40, 3.0, math.inf, math.nan])
    reduce_and_update([state], recipe)
    expected_scale = torch.tensor([2.0, FP32_MAX, 448.0 / 3.0 / 2.0, 2.0, 2.0])
    torch.testing.assert_close(state.scale, expected_scale, rtol=1e-6, atol=0)
    assert torch.all(torch.isfinite(state.scale))
    assert torch.all(state.amax_history[0] == 0)
    assert state.amax_history[2, 2] == 3.0 and state.amax_history[2, 0] == 0.0  # slot 0 idle: not rolled


def test_callable_algorithms():
    def amax_algo(history):
        return history.mean(dim=0)

    def scale_algo(amax, scale, fp8_max, recipe):
        return scale * 0.5 + fp8_max / amax

    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=amax_algo)
    state = DelayedScalingRecipeState(recipe, "forward", 2, "cpu")
    state.amax_history[:] = torch.tensor([[4.0, 2.0], [2.0, 6.0]])
    reduce_and_update([state], recipe)
    torch.testing.assert_close(state.scale, torch.tensor([448.0 / 3.0, 448.0 / 4.0]))
    torch.testing.assert_close(state.amax_history, torch.tensor([[0.0, 0.0], [4.0, 2.0]]))
    recipe2 = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=scale_algo)
    state2 = DelayedScalingRecipeState(recipe2, "forward", 1, "cpu")
    state2.amax_history[0, 0] = 7.0
    reduce_and_update([state2], recipe2)
    torch.testing.assert_close(state2.scale, torch.tensor([0.5 + 448.0 / 7.0]))


def _random_states(recipe, mode, sizes):
    """States of ``sizes`` slots with random histories, an idle slot (row 0 = 0) and random scales."""
    states = [DelayedScalingRecipeState(recipe, mode, n, "cpu") for n in sizes]
    for state in states:
        state.amax_history.copy_(torch.rand_like(state.amax_history) * 10)
        state.amax_history[0, 0] = 0.0
        state.scale.copy_(torch.rand_like(state.scale) + 0.5)
    return states


def _snapshot(states):
    return [(s.amax_history.clone(), s.scale.clone(), s.scale_inv.clone()) for s in states]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_states_updated_together_as_one_at_a_time(algo):
    """One call over states of both directions (their own fp8_max) equals one call per state, in place."""
    recipe = DelayedScaling(margin=1, amax_history_len=4, amax_compute_algo=algo)
    states = _random_states(recipe, "forward", [3, 1, 6]) + _random_states(recipe, "backward", [2, 4])
    alone = [DelayedScalingRecipeState(recipe, s.mode, s.num_quantizers, "cpu") for s in states]
    for single, state in zip(alone, states):
        for mine, theirs in zip((single.amax_history, single.scale), (state.amax_history, state.scale)):
            mine.copy_(theirs)
        reduce_and_update([single], recipe)
    tensors = [(s.amax_history, s.scale, s.scale_inv) for s in states]
    reduce_and_update(states, recipe)
    assert [(s.amax_history, s.scale, s.scale_inv) for s in states] == tensors  # the same tensor objects
    for expected, actual in zip(_snapshot(alone), _snapshot(states)):
        for e, a in zip(expected, actual):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    if algo == "most_recent":  # each direction's own fp8_max (E4M3 forward, E5M2 backward under HYBRID)
        for state, fp8_max in ((states[0], 448.0), (states[3], 57344.0)):
            torch.testing.assert_close(state.scale[1:], fp8_max / state.amax_history[-1, 1:] / 2.0, rtol=1e-6, atol=0)


def _oracle_of(state, recipe):
    """An _Oracle that starts from ``state``'s current history and scale."""
    oracle = _Oracle(*state.amax_history.shape, state.fp8_max, recipe)
    oracle.h, oracle.s = state.amax_history.tolist(), state.scale.tolist()
    return oracle


def _step_and_check(states, recipe):
    """New random amaxes in row 0 (slot 0 idle), one update of ``states`` together, each checked by an oracle."""
    for state in states:
        state.amax_history[0] = torch.rand(state.num_quantizers) * 10
        state.amax_history[0, 0] = 0.0
    oracles = [_oracle_of(s, recipe) for s in states]
    reduce_and_update(states, recipe)
    for oracle, state in zip(oracles, states):
        oracle.update()
        oracle.check(state)


def test_states_of_one_direction_update_in_one_call_on_their_own_tensors(monkeypatch):
    """Several states of one direction: one delayed_scaling_update_many_ call on the states' own tensors, no
    side-by-side copies (the gather is never reached), the oracle's values over steps."""
    from transformer_engine.plugin import ops

    recipe = DelayedScaling(margin=1, amax_history_len=4)
    states = _random_states(recipe, "forward", [3, 1, 6])
    calls, real = [], ops.delayed_scaling_update_many_

    def spy(histories, scales, scale_invs, **kwargs):
        calls.append((histories, scales, scale_invs))
        return real(histories, scales, scale_invs, **kwargs)

    monkeypatch.setattr(ops, "delayed_scaling_update_many_", spy)
    monkeypatch.setattr(delayed_update._Group, "gather", lambda self: pytest.fail("the states were copied side by side"))
    for _ in range(3):
        _step_and_check(states, recipe)
    assert len(calls) == 3
    for name, given in zip(("amax_history", "scale", "scale_inv"), calls[-1]):
        assert all(t is getattr(state, name) for t, state in zip(given, states))


def test_update_follows_replaced_state_tensors():
    """Steps with one cached plan, then tensors replaced by a history resize and by a checkpoint load."""
    recipe = DelayedScaling(margin=1, amax_history_len=3)
    states = _random_states(recipe, "forward", [3, 2, 5])
    for _ in range(3):
        _step_and_check(states, recipe)
    for state in states:
        with pytest.warns(UserWarning, match="amax_history_len"):
            state.adjust_amax_history_length(5)
    _step_and_check(states, recipe)
    _step_and_check(states[1:], recipe)  # another list of the same states
    for name in ("scale", "scale_inv", "amax_history"):  # what set_extra_state does
        setattr(states[1], name, getattr(states[1], name).clone() * 2)
    _step_and_check(states, recipe)
    _step_and_check(states[1:2], recipe)


def test_states_of_different_history_lengths_update_in_place_and_only_side_by_side_raise():
    """The in-place op takes states of any history lengths (each checked by its oracle); the side-by-side path (a
    recipe callable, or an amax reduction) needs one length and says so."""
    recipe = DelayedScaling(amax_history_len=2)
    states = _random_states(recipe, "forward", [3, 3])
    with pytest.warns(UserWarning):
        states[1].adjust_amax_history_length(4)
    _step_and_check(states, recipe)
    with_callable = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda history: history.amax(dim=0))
    with pytest.raises(ValueError, match=r"lengths \[2, 4\]"):
        reduce_and_update(states, with_callable)


def test_a_plan_that_updates_in_place_allocates_no_side_by_side_buffers():
    recipe = DelayedScaling(amax_history_len=2)
    states = _random_states(recipe, "backward", [2, 3])
    reduce_and_update(states, recipe)
    (group,) = delayed_update._plan(states, side_by_side=False)
    assert group.history is None and group.scale is None and len(group.state_histories) == 2


def test_plan_cache_is_bounded():
    recipe = DelayedScaling(amax_history_len=2)
    for _ in range(delayed_update._MAX_PLANS + 3):
        _step_and_check(_random_states(recipe, "backward", [2]), recipe)
    assert len(delayed_update._PLANS) <= delayed_update._MAX_PLANS


def test_fp8_max_follows_a_recipe_format_change():
    """A state adopts a new recipe of the same type (ensure_states): the next update uses its fp8_max."""
    state = DelayedScalingRecipeState(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1), "backward", 2, "cpu")
    state.amax_history[0] = torch.tensor([2.0, 4.0])
    reduce_and_update([state], state.recipe)
    torch.testing.assert_close(state.scale, torch.tensor([224.0, 112.0]), rtol=0, atol=0)
    state.recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1)
    state.amax_history[0] = torch.tensor([2.0, 4.0])
    reduce_and_update([state], state.recipe)
    torch.testing.assert_close(state.scale, torch.tensor([28672.0, 14336.0]), rtol=0, atol=0)


def test_scaling_factor_callable_gets_fp8_max_per_slot():
    seen = []

    def scale_algo(amax, scale, fp8_max, recipe):
        seen.append(fp8_max)
        return fp8_max / amax

    recipe = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=scale_algo)
    states = [DelayedScalingRecipeState(recipe, "forward", n, "cpu") for n in (2, 3)]
    for state in states:
        state.amax_history[0] = 7.0
    reduce_and_update(states, recipe)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], torch.full((5,), 448.0))
    torch.testing.assert_close(torch.cat([s.scale for s in states]), torch.full((5,), 64.0))


def test_forward_update_only_at_outermost_exit_with_grad():
    recipe = DelayedScaling(amax_history_len=2)
    a, b = te.Linear(16, 16), te.Linear(16, 16)
    x = torch.randn(8, 16)
    with te.autocast(recipe=recipe):
        with te.autocast(recipe=recipe):
            a(x)
        assert torch.all(a.fp8_meta["scaling_fwd"].scale == 1.0)  # inner exit: no update
        b(x)
    for layer in (a, b):  # both updated together at the outermost exit
        assert layer.fp8_meta["scaling_fwd"].scale[0] == 448.0 / x.abs().max()
    with torch.no_grad(), te.autocast(recipe=recipe):
        a(x * 4)
    assert a.fp8_meta["scaling_fwd"].scale[0] == 448.0 / x.abs().max()  # inference: not updated


def test_hybrid_vs_e4m3_backward_max():
    for fmt, fp8_max in ((Format.HYBRID, 57344.0), (Format.E4M3, 448.0)):
        layer = te.Linear(16, 16)
        with te.autocast(recipe=DelayedScaling(fp8_format=fmt, amax_history_len=1)):
            y = layer(torch.randn(8, 16))
        y.sum().backward()  # dy = 1
        assert layer.fp8_meta["scaling_bwd"].scale[0] == fp8_max


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reduce_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        recipe = DelayedScaling(amax_history_len=2)
        states = [DelayedScalingRecipeState(recipe, "forward", 3, "cpu") for _ in range(2)]
        states[0].amax_history[0] = torch.tensor([1.0, 2.0, 0.0]) * (rank + 1)
        states[1].amax_history[0] = torch.tensor([5.0, 1.0, 3.0]) / (rank + 1)
        reduce_and_update(states, recipe, None)
        results.put((rank, torch.cat([s.scale for s in states]).tolist()))
    finally:
        torch.distributed.destroy_process_group()


def test_amax_max_reduced_across_ranks():
    """Two gloo ranks with different amaxes end with the same scales, those of the elementwise max."""
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    mp.start_processes(_reduce_worker, args=(2, _free_port(), results), nprocs=2, join=True, start_method="fork")
    expected = [448.0 / 2.0, 448.0 / 4.0, 1.0, 448.0 / 5.0, 448.0 / 1.0, 448.0 / 3.0]
    scales = dict(results.get() for _ in range(2))
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(scales[rank]), torch.tensor(expected))


def test_hold_plans_collects_the_plans_used_inside():
    """hold_plans() lists the update plans (their buffers) used in its body, and only those."""
    recipe = DelayedScaling(amax_history_len=3)
    states = [DelayedScalingRecipeState(recipe, "forward", 2, "cpu") for _ in range(2)]
    with delayed_update.hold_plans() as held:
        reduce_and_update(states, recipe)
        reduce_and_update(states, recipe)
    reduce_and_update(states[:1], recipe)  # after the context: not collected
    assert len(held) == 2 and held[0] is held[1]  # the cached plan, once per update
    (group,) = held[0]
    assert all(h is s.amax_history for h, s in zip(group.state_histories, states))  # in place: the states' own tensors


@pytest.mark.parametrize("amax, expected", [(2.0, 224.0), (0.0, 1.0), (math.inf, 1.0), (math.nan, 1.0), (1e-40, FP32_MAX)])
def test_amax_and_scale_update_is_te_private_step(amax, expected):
    """NVIDIA TE's ``_amax_and_scale_update`` (its recipe tests call it): fp8_max / amax, the old scale where the
    amax is zero, inf or NaN, float32 max where the scale overflows; every slot, in place."""
    from transformer_engine.pytorch.quantization import _amax_and_scale_update, _default_sf_compute

    assert _default_sf_compute(torch.tensor([amax]), torch.ones(1), 448.0, 0).item() == expected
    history = torch.tensor([[amax], [1.0]], dtype=torch.float32)
    scale = torch.ones(1)
    _amax_and_scale_update(history, scale, 448.0, DelayedScaling(amax_compute_algo="most_recent"))
    assert scale.item() == expected
    assert history[0].item() == 0.0  # rolled by one, row 0 zeroed: [[0], [amax]]
    assert torch.equal(history[1], torch.tensor([amax])) or (math.isnan(amax) and history[1].isnan().all())
