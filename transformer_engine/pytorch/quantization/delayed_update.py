"""The delayed-scaling update of a group of states: MAX-reduce the new amaxes, then one catalog op call.

For the states of one (recipe, amax_reduction_group) pair, with H = the histories side by side
[L, sum N] and s = the scales:

1. if ``recipe.reduce_amax`` and torch.distributed is initialized with a group of size > 1, the row-0
   amaxes of all states travel in ONE ``all_reduce(MAX)``;
2. amax = max over H ("max"), H[0] ("most_recent") or ``recipe.amax_compute_algo(H)``, read before
   the roll; s = (fp8_max / amax) / 2^margin (the old s where amax is 0, inf or NaN; float32 max
   where it overflows) or ``recipe.scaling_factor_compute_algo(amax, s, fp8_max, recipe)``;
   H = roll(H, -1) with row 0 zeroed: ``ops.delayed_scaling_update`` does the built-in algorithms;
3. a slot whose new amax is 0 (a tensor that was not cast this step, e.g. a cached weight with
   ``is_first_microbatch=False`` or an unused output slot) keeps its history and scale, as TE's
   fused update kernel does;
4. scale_inv = 1 / scale.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.plugin import ops

__all__ = ["reduce_and_update"]


def reduce_and_update(states: Sequence, recipe: DelayedScaling, group=None) -> None:
    """Reduce the amaxes of ``states`` over ``group`` and advance their scales and histories one step."""
    by_device: Dict[torch.device, List] = {}
    for state in states:
        by_device.setdefault(state.amax_history.device, []).append(state)
    for same_device in by_device.values():
        _reduce_amax(same_device, recipe, group)
        _update(same_device, recipe)


def _reduce_amax(states: Sequence, recipe: DelayedScaling, group) -> None:
    if not (recipe.reduce_amax and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size(group) <= 1:
        return
    amaxes = torch.cat([s.amax_history[0] for s in states])
    torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    for state, part in zip(states, amaxes.split([s.num_quantizers for s in states])):
        state.amax_history[0].copy_(part)


def _update(states: Sequence, recipe: DelayedScaling) -> None:
    history = torch.cat([s.amax_history for s in states], dim=1)
    scale = torch.cat([s.scale for s in states])
    fp8_max = torch.cat([torch.full((s.num_quantizers,), s.fp8_max, device=scale.device) for s in states])
    new_history, new_scale = _step(history, scale, fp8_max, recipe)
    idle = history[0] == 0
    new_history = torch.where(idle, history, new_history)
    new_scale = torch.where(idle, scale, new_scale)
    sizes = [s.num_quantizers for s in states]
    for state, h, s in zip(states, new_history.split(sizes, dim=1), new_scale.split(sizes)):
        state.amax_history.copy_(h)
        state.scale.copy_(s)
        torch.reciprocal(state.scale, out=state.scale_inv)


def _step(history: torch.Tensor, scale: torch.Tensor, fp8_max: torch.Tensor, recipe: DelayedScaling) -> Tuple[torch.Tensor, torch.Tensor]:
    """(H_new, s_new) for the built-in algorithms through the catalog op, else with the recipe's callables."""
    algo, scale_fn, margin = recipe.amax_compute_algo, recipe.scaling_factor_compute_algo, float(recipe.margin)
    if not callable(algo) and scale_fn is None:
        return ops.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    if callable(algo):
        amax = algo(history)
    else:
        amax = history.amax(dim=0) if algo == "max" else history[0]
    new_history = torch.roll(history, -1, dims=0)
    new_history[0] = 0
    if scale_fn is not None:
        new_scale = scale_fn(amax, scale, fp8_max, recipe)
    else:  # the built-in scale rule applied to the callable's amax: a one-row "history"
        _, new_scale = ops.delayed_scaling_update(amax.reshape(1, -1), scale, fp8_max, margin, "most_recent")
    return new_history, new_scale.to(torch.float32)
