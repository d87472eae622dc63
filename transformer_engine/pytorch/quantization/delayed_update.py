"""The delayed-scaling update of a group of states: MAX-reduce the new amaxes, then one catalog op call.

For the states of one (recipe, amax_reduction_group) pair, with H = the histories side by side
[L, sum N] and s = the scales:

1. if ``recipe.reduce_amax`` and torch.distributed is initialized with a group of size > 1, the row-0
   amaxes of all states travel in ONE ``all_reduce(MAX)``;
2. amax = max over H ("max"), H[0] ("most_recent") or ``recipe.amax_compute_algo(H)``, read before
   the roll; s = (fp8_max / amax) / 2^margin (the old s where amax is 0, inf or NaN; float32 max
   where it overflows) or ``recipe.scaling_factor_compute_algo(amax, s, fp8_max, recipe)``;
   H = roll(H, -1) with row 0 zeroed;
3. a slot whose new amax is 0 (a tensor that was not cast this step, e.g. a cached weight with
   ``is_first_microbatch=False`` or an unused output slot) keeps its history and scale, as TE's
   fused update kernel does;
4. scale_inv = 1 / scale.

Steps 2-4 of the built-in algorithms are ONE launch: ``ops.delayed_scaling_update_many_`` on the states'
own tensors (``ops.delayed_scaling_update_`` for one state); only an amax reduction (step 1) or a recipe
callable needs the states side by side, copied into the plan's buffers and back, where a callable's
step is ``ops.delayed_scaling_update`` (or the callables), two ``where`` and a ``reciprocal``.

Traced by torch.compile, each state is updated on its own tensors by ``ops.delayed_scaling_update_``
(on the GPU the flagos kernel, one launch per state), which also folds in the amaxes of the traced casts
(its ``amax`` argument): they reach the update in a buffer (forward) or list (backward) rather than through
H[0], so the history is written once per step; a list is stacked only up to the last slot cast (the op
takes the amaxes of the first K slots), so one grad cast hands its amax over with no kernel of its own.

The host work that does not change from step to step (the side-by-side buffers and their per-state
views, fp8_max per slot, the grouping by device) is a :class:`_Group` plan, cached per list of states
by the identity of their tensors, so a replaced tensor (``adjust_amax_history_length``, ``move_to``,
a checkpoint load) or another fp8 dtype (a recipe format change) gets a new plan; a plan that updates
in place allocates no side-by-side buffers (and its states may differ in history length).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.plugin import ops

__all__ = ["amax_and_scale_update", "default_scale", "fold_amaxes", "hold_plans", "reduce_and_update"]

#: Plans kept (oldest dropped first): one per (autocast, direction) of a training loop is the usual need.
_MAX_PLANS = 16


@dataclass(frozen=True)
class _Group:
    """The update plan of the states of one device.

    One state is updated in place in its own tensors, several by one ``delayed_scaling_update_many_`` call
    on theirs (the built-in algorithms, no amax reduction) or in side-by-side buffers: :meth:`gather`
    fills ``history`` / ``scale`` from ``state_histories`` / ``state_scales``,
    :meth:`write_back` copies ``history_views`` into ``state_histories``, then ``scale_views`` into
    ``scale_targets`` (the states' scale and scale_inv: contiguous 1-D pairs, which CUDA copies in one
    fused launch). The plan holds every state tensor of its cache key.

    Attributes:
        history: H [L, sum N] float32; ``amax`` is its row 0 (both None in a plan of several states that
            updates them in place: no side-by-side buffers).
        scale, scale_inv: s and 1 / s, float32 [sum N] (None likewise).
        fp8_max: one float, or float32 [sum N] when the states' fp8 dtypes differ.
        state_histories, state_scales: the states' H and s (empty for one state).
        history_views, scale_targets, scale_views: the write-back pairs (empty for one state).
        state_scale_invs: the states' scale_inv (empty for one state).
    """

    history: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    scale_inv: Optional[torch.Tensor]
    fp8_max: Union[float, torch.Tensor]
    state_histories: Tuple[torch.Tensor, ...] = ()
    state_scales: Tuple[torch.Tensor, ...] = ()
    history_views: Tuple[torch.Tensor, ...] = ()
    scale_targets: Tuple[torch.Tensor, ...] = ()
    scale_views: Tuple[torch.Tensor, ...] = ()
    state_scale_invs: Tuple[torch.Tensor, ...] = ()

    def update_in_place(self, recipe: DelayedScaling) -> bool:
        """The update of several states on their own tensors, one op call, when the recipe's algorithms are
        built in and fp8_max is one float; False (nothing done) otherwise."""
        if not self.state_histories or not _built_in(recipe) or isinstance(self.fp8_max, torch.Tensor):
            return False
        ops.delayed_scaling_update_many_(self.state_histories, self.state_scales, self.state_scale_invs, fp8_max=self.fp8_max,
                                         margin=float(recipe.margin), amax_compute_algo=recipe.amax_compute_algo)
        return True

    def gather(self) -> None:
        """H and s from the states (two ``cat``; nothing to do for one state)."""
        if self.state_histories:
            torch.cat(self.state_histories, dim=1, out=self.history)
            torch.cat(self.state_scales, out=self.scale)

    def write_back(self) -> None:
        """The states' H, s and scale_inv from the buffers (two ``_foreach_copy_``; nothing for one state)."""
        if self.state_histories:
            torch._foreach_copy_(self.state_histories, self.history_views)
            torch._foreach_copy_(self.scale_targets, self.scale_views)


_PLANS: Dict[tuple, Tuple[_Group, ...]] = {}
_HOLDERS: List[List[Tuple[_Group, ...]]] = []  # the lists of the open hold_plans() contexts


@contextmanager
def hold_plans() -> Iterator[List[Tuple[_Group, ...]]]:
    """Collect the plans that the updates inside the context use.

    A CUDA graph captures a plan's buffers by address: whoever owns the graph keeps this list, so that
    the buffers outlive the plan cache, which drops the oldest plans.
    """
    held: List[Tuple[_Group, ...]] = []
    _HOLDERS.append(held)
    try:
        yield held
    finally:
        _HOLDERS.remove(held)


def reduce_and_update(states: Sequence, recipe: DelayedScaling, group=None, amaxes: Optional[Mapping] = None) -> None:
    """Reduce the amaxes of ``states`` over ``group`` and advance their scales and histories one step.

    Per device: one in-place catalog op on the states' own tensors (``delayed_scaling_update_many_``, or
    ``delayed_scaling_update_`` for one state: H, s and scale_inv with the idle rule); with an amax
    reduction or a recipe callable, several states go through ``cat`` of H and s, the all-reduce, the
    update (a callable: the op or the callables, two ``where`` and ``reciprocal``) and two
    ``_foreach_copy_`` back into their tensors, which stay the same objects.

    ``amaxes``: {state: amaxes} recorded by casts that torch.compile traced, not yet in the states' H[0]:
    a float32 [N] buffer, or a list of (slot, amax) pairs (see ``Float8Quantizer.recording_into``);
    folded in first, max per slot.
    """
    reduce = _reduces(recipe, group)
    if torch.compiler.is_compiling():
        _update_traced(states, recipe, reduce, group, amaxes or {})
        return
    if amaxes:
        fold_amaxes(amaxes)
    plan = _plan(states, side_by_side=reduce or not _built_in(recipe))
    for held in _HOLDERS:
        held.append(plan)
    for part in plan:
        if not reduce and part.update_in_place(recipe):
            continue
        part.gather()
        if reduce:
            torch.distributed.all_reduce(part.amax, op=torch.distributed.ReduceOp.MAX, group=group)
        _update(part, recipe)
        part.write_back()


def fold_amaxes(amaxes: Mapping) -> None:
    """H[0, i] = max(H[0, i], amax) of each state of ``amaxes`` ({state: a float32 [N] buffer or (slot i, amax) pairs})."""
    for state, recorded in amaxes.items():
        slot_amaxes = _slot_amaxes(recorded)
        if slot_amaxes is not None:
            row = state.amax_history[0, : slot_amaxes.shape[0]]
            row.copy_(torch.maximum(row, slot_amaxes))


def _update_traced(states: Sequence, recipe: DelayedScaling, reduce: bool, group, amaxes: Mapping) -> None:
    """:func:`reduce_and_update` as torch.compile traces it: each state on its own tensors, without the
    cached side-by-side buffers (the same math per slot; the compiler plans the buffers), its traced
    casts' amaxes handed to the in-place op (``amax``), which folds them into H[0] as it updates: on the
    GPU the flagos update kernel, one launch per state, without the history ever being written twice.
    ``reduce``: MAX-reduce the amaxes over ``group`` first (None: the default group). A recipe callable
    takes the tensor ops of :func:`_update` on the folded history."""
    for state in states:
        history = state.amax_history
        amax = _slot_amaxes(amaxes.get(state, ()))
        if reduce:  # H[0] itself when nothing was handed over (no tensor that aliases H goes to the op)
            if amax is not None:
                k = amax.shape[0]
                amax = torch.cat([torch.maximum(history[0, :k], amax), history[0, k:]])
            torch.distributed.all_reduce(history[0] if amax is None else amax, op=torch.distributed.ReduceOp.MAX, group=group)
        if _built_in(recipe):
            ops.delayed_scaling_update_(history, state.scale, state.scale_inv, fp8_max=state.fp8_max, margin=float(recipe.margin),
                                        amax_compute_algo=recipe.amax_compute_algo, amax=amax)
            continue
        if amax is not None:
            recorded = history[0, : amax.shape[0]]
            recorded.copy_(torch.maximum(recorded, amax))
        _update(_Group(history, history[0], state.scale, state.scale_inv, state.fp8_max), recipe, in_place_op=False)


def _slot_amaxes(recorded: Union[torch.Tensor, Sequence[Tuple[int, torch.Tensor]]]) -> Optional[torch.Tensor]:
    """float32 [K]: ``recorded`` when it is a float32 [N] buffer; for (slot, amax) pairs, K = 1 + the last
    slot recorded, per slot the max of the amaxes recorded for it, 0 where none (one slot 0: a view of
    its amax); None when nothing was recorded."""
    if isinstance(recorded, torch.Tensor):
        return recorded
    if not recorded:
        return None
    per_slot: Dict[int, torch.Tensor] = {}
    for index, amax in recorded:
        per_slot[index] = amax if index not in per_slot else torch.maximum(per_slot[index], amax)
    if len(per_slot) == 1 and 0 in per_slot:
        return per_slot[0].reshape(1)
    zero = recorded[0][1].new_zeros(())
    return torch.stack([per_slot.get(i, zero) for i in range(max(per_slot) + 1)])


def _reduces(recipe: DelayedScaling, group) -> bool:
    """True when the amaxes must be MAX-reduced: ``recipe.reduce_amax`` over a group of more than one rank."""
    if not (recipe.reduce_amax and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return torch.distributed.get_world_size(group) > 1


def _update(part: _Group, recipe: DelayedScaling, in_place_op: bool = True) -> None:
    """One step in place on the plan's H, s and scale_inv: one ``ops.delayed_scaling_update_`` call for the
    built-in algorithms; with a recipe callable (or without ``in_place_op``), :func:`_step`, the idle
    rule, scale_inv = 1 / s: the same values (the op's contract)."""
    algo, margin = recipe.amax_compute_algo, float(recipe.margin)
    if in_place_op and _built_in(recipe):
        ops.delayed_scaling_update_(part.history, part.scale, part.scale_inv, fp8_max=part.fp8_max, margin=margin, amax_compute_algo=algo)
        return
    new_history, new_scale = _step(part.history, part.scale, part.fp8_max, recipe)
    active = part.amax.bool()  # new amax != 0 (NaN included): the slot was cast this step
    torch.where(active, new_history, part.history, out=part.history)
    torch.where(active, new_scale, part.scale, out=part.scale)
    torch.reciprocal(part.scale, out=part.scale_inv)


def default_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max, margin: float) -> torch.Tensor:
    """The built-in scale rule (NVIDIA TE's ``_default_sf_compute``): (fp8_max / amax) / 2^margin where amax is
    finite and > 0, else the old scale; float32 max where that overflows (the catalog's ``delayed_scaling_update``
    applied to a one-row history).

    Example:
        >>> import torch
        >>> default_scale(torch.tensor([2.0, 0.0, float("inf")]), torch.ones(3), 448.0, 0).tolist()
        [224.0, 1.0, 1.0]
    """
    return ops.delayed_scaling_update(amax.reshape(1, -1), scale, fp8_max=fp8_max, margin=float(margin), amax_compute_algo="most_recent")[1]


def amax_and_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe: DelayedScaling) -> None:
    """One delayed-scaling step of every slot of one state, in place (NVIDIA TE's ``_amax_and_scale_update``).

    amax from the history by ``recipe.amax_compute_algo``; scale = (fp8_max / amax) / 2^margin where amax is
    finite and > 0, else the old scale (float32 max where it overflows), or the recipe's callables; the
    history rolled with row 0 zeroed. Unlike the autocast's update, slots not cast this step are updated too.

    Example:
        >>> import torch
        >>> from transformer_engine.common.recipe import DelayedScaling
        >>> history, scale = torch.tensor([[2.0, 0.0]]), torch.ones(2)
        >>> amax_and_scale_update(history, scale, 448.0, DelayedScaling())
        >>> scale.tolist(), history.tolist()
        ([224.0, 1.0], [[0.0, 0.0]])
    """
    new_history, new_scale = _step(amax_history, scale, fp8_max, recipe)
    scale.copy_(new_scale)
    amax_history.copy_(new_history)


def _built_in(recipe: DelayedScaling) -> bool:
    """True when the recipe's amax and scale rules are the built-in ones, which the catalog's update ops
    implement (no callable ``amax_compute_algo`` or ``scaling_factor_compute_algo``)."""
    return not callable(recipe.amax_compute_algo) and recipe.scaling_factor_compute_algo is None


def _plan(states: Sequence, side_by_side: bool) -> Tuple[_Group, ...]:
    """The cached plan of ``states``, keyed by their tensors' ids and fp8 dtypes and whether the update needs
    them side by side (a plan holds the tensors of its key, so no live tensor can take one of its ids)."""
    key = (side_by_side,) + tuple([(id(s.amax_history), id(s.scale), id(s.scale_inv), s.fp8_dtype) for s in states])
    plan = _PLANS.get(key)
    if plan is None:
        by_device: Dict[torch.device, List] = {}
        for state in states:
            by_device.setdefault(state.amax_history.device, []).append(state)
        plan = tuple(_make_group(same_device, side_by_side) for same_device in by_device.values())
        if len(_PLANS) >= _MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan
    return plan


def _make_group(states: List, side_by_side: bool) -> _Group:
    """The plan of states on one device: in place (one state, or several with one fp8_max and no need for
    ``side_by_side``), else side-by-side buffers, which need histories of one length L."""
    fp8_max = _fp8_max(states)
    if len(states) == 1:
        (s,) = states
        return _Group(s.amax_history, s.amax_history[0], s.scale, s.scale_inv, fp8_max)
    in_place = dict(state_histories=tuple(s.amax_history for s in states), state_scales=tuple(s.scale for s in states),
                    state_scale_invs=tuple(s.scale_inv for s in states))
    if not side_by_side and not isinstance(fp8_max, torch.Tensor):
        return _Group(None, None, None, None, fp8_max, **in_place)
    lengths = {s.amax_history.shape[0] for s in states}
    if len(lengths) > 1:
        raise ValueError(
            f"the states updated together have amax histories of lengths {sorted(lengths)}; with an amax reduction or "
            "a recipe callable they must share one length: give their modules the same recipe amax_history_len"
        )
    sizes = [s.num_quantizers for s in states]
    history = torch.empty(lengths.pop(), sum(sizes), dtype=torch.float32, device=states[0].amax_history.device)
    scale, scale_inv = torch.empty_like(history[0]), torch.empty_like(history[0])
    return _Group(
        history, history[0], scale, scale_inv, fp8_max, **in_place,
        history_views=history.split(sizes, dim=1),
        scale_targets=tuple([s.scale for s in states] + [s.scale_inv for s in states]),
        scale_views=scale.split(sizes) + scale_inv.split(sizes),
    )  # fmt: skip


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
    """(H_new, s_new): the catalog's ``delayed_scaling_update`` for the built-in algorithms, else the recipe's
    callable amax_compute_algo or scaling_factor_compute_algo."""
    algo, scale_fn, margin = recipe.amax_compute_algo, recipe.scaling_factor_compute_algo, float(recipe.margin)
    if _built_in(recipe):  # the catalog op
        return ops.delayed_scaling_update(history, scale, fp8_max=fp8_max, margin=margin, amax_compute_algo=algo)
    if callable(algo):
        amax = algo(history)
    else:
        amax = history.amax(dim=0) if algo == "max" else history[0]
    # H rolled, row 0 zeroed
    new_history, _ = ops.delayed_scaling_update(history, scale, fp8_max=fp8_max, margin=margin, amax_compute_algo="most_recent")
    if scale_fn is not None:
        if not isinstance(fp8_max, torch.Tensor):  # the callable gets fp8_max per slot, float32 [N]
            fp8_max = torch.full_like(scale, fp8_max, dtype=torch.float32)
        new_scale = scale_fn(amax, scale, fp8_max, recipe)
    else:  # the built-in scale rule applied to the callable's amax
        new_scale = default_scale(amax, scale, fp8_max, margin)
    return new_history, new_scale.to(torch.float32)
