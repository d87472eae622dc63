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

from typing import Dict, List, Sequence, Tuple, Union

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
    """One step for ``states`` side by side: the catalog op plus 6 torch ops (one state) or 11 (any more).

    H and s are concatenated (not for one state), the op runs once, the idle rule is two ``where``,
    scale_inv one ``reciprocal``, and a single ``_foreach_copy_`` writes every state's three tensors
    in place (quantizers and checkpoints keep referring to them).
    """
    sizes = [s.num_quantizers for s in states]
    history = _side_by_side([s.amax_history for s in states], dim=1)
    scale = _side_by_side([s.scale for s in states], dim=0)
    new_history, new_scale = _step(history, scale, _fp8_max(states), recipe)
    idle = history[0] == 0
    new_history = torch.where(idle, history, new_history)
    new_scale = torch.where(idle, scale, new_scale)
    new_scale_inv = torch.reciprocal(new_scale)
    results = zip(_split(new_history, sizes, 1), _split(new_scale, sizes, 0), _split(new_scale_inv, sizes, 0))
    targets = [t for s in states for t in (s.amax_history, s.scale, s.scale_inv)]
    torch._foreach_copy_(targets, [t for per_state in results for t in per_state])


def _side_by_side(tensors: List[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)``, or the one tensor itself (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _split(t: torch.Tensor, sizes: List[int], dim: int) -> Sequence[torch.Tensor]:
    """Views of ``t`` of ``sizes`` along ``dim``, or (t,) for one size (no op)."""
    return (t,) if len(sizes) == 1 else t.split(sizes, dim=dim)


def _fp8_max(states: Sequence):
    """fp8_max per slot: one float when the states share it (one recipe and direction: always under
    autocast), else a float32 [sum N] tensor of each state's value."""
    values = {s.fp8_max for s in states}
    if len(values) == 1:
        return values.pop()
    device = states[0].scale.device
    return torch.cat([torch.full((s.num_quantizers,), s.fp8_max, dtype=torch.float32, device=device) for s in states])


def _step(
    history: torch.Tensor, scale: torch.Tensor, fp8_max: Union[float, torch.Tensor], recipe: DelayedScaling
) -> Tuple[torch.Tensor, torch.Tensor]:
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
        if not isinstance(fp8_max, torch.Tensor):  # the callable gets fp8_max per slot, float32 [N]
            fp8_max = torch.full_like(scale, fp8_max, dtype=torch.float32)
        new_scale = scale_fn(amax, scale, fp8_max, recipe)
    else:  # the built-in scale rule applied to the callable's amax: a one-row "history"
        _, new_scale = ops.delayed_scaling_update(amax.reshape(1, -1), scale, fp8_max, margin, "most_recent")
    return new_history, new_scale.to(torch.float32)
