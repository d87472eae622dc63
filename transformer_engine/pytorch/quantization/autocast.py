"""``autocast``: the context in which TE modules quantize, and the delayed-scaling update schedule.

    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = model(x)          # modules cast their GEMM operands to FP8
    y.sum().backward()        # gradients in FP8 (E5M2 under HYBRID)

Nesting saves the enclosing setting on entry and restores it on exit; one instance cannot be entered
twice at once. ``calibrating=True`` (usually with ``enabled=False``) computes in high precision but
records the amaxes of delayed-scaling slots.

Update schedule (delayed scaling, TE's):

- forward slots: when the *outermost* autocast exits with ``enabled``, grad mode on and no exception,
  the states of every module that ran FP8 inside it are updated, grouped per (recipe,
  amax_reduction_group), one ``all_reduce(MAX)`` per group when ``recipe.reduce_amax``;
- backward slots: at the end of the backward of the first module that ran inside the outermost
  autocast (the last module to run backward), grouped the same way.

Threads: the autocast state is one per process, as NVIDIA TE's ``FP8GlobalStateManager`` (class attributes):
every thread sees the setting of the autocast that is active anywhere, and autocasts must not be entered
from two threads at once (the stack would interleave). The backward of an FP8 forward needs nothing from
it (autograd may run it on another thread): each module's backward carries its own update. The op
dispatch policy (``transformer_engine.plugin``), by contrast, is per context (a ``ContextVar``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from transformer_engine.common.recipe import Format, Recipe

from .availability import (
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    fp8_emulation_requested,
    get_default_recipe,
)
from .delayed_update import fold_amaxes, reduce_and_update
from .recipe_state import check_recipe_implemented

__all__ = [
    "BackwardUpdate", "QuantizationConfig", "autocast", "autocast_depth", "current_config", "forward_amax_buffer", "fp8_autocast",
    "isolated_stack", "recompute_flags", "recompute_region", "register_states", "reset_autocast_state", "run_pending_update",
]


@dataclass(frozen=True)
class QuantizationConfig:
    """The setting of the innermost active autocast.

    Attributes:
        enabled: quantize GEMM operands.
        calibrating: record amaxes while computing in high precision.
        recipe: the recipe (None outside any autocast).
        amax_reduction_group: process group of the amax reduction (None = the default group).
    """

    enabled: bool = False
    calibrating: bool = False
    recipe: Optional[Recipe] = None
    amax_reduction_group: Any = None

    @property
    def active(self) -> bool:
        """True when modules need their scaling state (FP8 or calibration)."""
        return self.enabled or self.calibrating


class _UpdateGroups:
    """Delayed-scaling states waiting for their update, grouped per (recipe, amax_reduction_group).

    ``traced``: made while torch.compile traces (an outermost autocast entered inside the compiled code),
    so the update runs in the same trace: the traced casts of the queued states hand it their amaxes
    (:meth:`amax_buffer`) rather than writing them into the histories first."""

    def __init__(self, traced: bool = False):
        self._groups: Dict[Tuple[Recipe, Any], Tuple[Recipe, Any, Dict[Any, Any]]] = {}
        self.traced = traced
        self._amaxes: Dict[Any, torch.Tensor] = {}

    def add(self, state, group) -> None:
        entry = self._groups.setdefault((state.recipe, group), (state.recipe, group, {}))
        entry[2][state] = state  # states and groups hash by identity

    def amax_buffer(self, state) -> torch.Tensor:
        """float32 [N], zeros at first: the traced casts of ``state`` max their amaxes into it, for :meth:`run`."""
        if state not in self._amaxes:
            self._amaxes[state] = torch.zeros(state.num_quantizers, dtype=torch.float32, device=state.scale.device)
        return self._amaxes[state]

    def run(self) -> None:
        groups, self._groups = self._groups, {}
        amaxes, self._amaxes = self._amaxes, {}
        for recipe, group, states in groups.values():
            reduce_and_update(list(states.values()), recipe, group, amaxes)

    def keep_amaxes(self) -> None:
        """No update at the autocast's exit (grad mode off, an exception, a graph capture): the amaxes handed
        over go into the histories' row 0, where an eager step leaves them for a later update."""
        amaxes, self._amaxes = self._amaxes, {}
        fold_amaxes(amaxes)


class BackwardUpdate:
    """The backward states of one outermost autocast; called at the end of its first module's backward.

    Traced by torch.compile, a module's backward is traced when its forward is, before the modules after
    it have queued their states: each state then gets an update of its own (:meth:`claim_state`), run
    at the end of the backward of the first call that queued it (the last of its backwards to run, the
    last to read its scale), which gives the grouped update's values.
    """

    def __init__(self):
        self.groups = _UpdateGroups()
        self._claimed = False
        self._states_claimed = set()

    def claim_state(self, state, group) -> Callable[..., None]:
        """The update of ``state`` alone for its first caller; for later callers (whose backwards run
        before it) the fold of their amaxes into the history. Both take the (slot, amax) list of the
        backward's traced grad casts (``Quantizer.recording_into``)."""
        if state in self._states_claimed:
            return functools.partial(_fold_state, state)
        self._states_claimed.add(state)
        return functools.partial(_update_state, state, group)

    def claim(self) -> Optional["BackwardUpdate"]:
        """Self for the first caller (the first module to run forward), None afterwards."""
        if self._claimed:
            return None
        self._claimed = True
        return self

    def __call__(self, amaxes: Sequence = ()) -> None:
        """The update of every queued state (eager: the casts wrote their amaxes, ``amaxes`` is empty)."""
        self.groups.run()


def _update_state(state, group, amaxes: Sequence = ()) -> None:
    """The update of one backward state, its traced grad casts' ``amaxes`` ((slot, amax) pairs) folded in."""
    reduce_and_update([state], state.recipe, group, {state: amaxes})


def _fold_state(state, amaxes: Sequence = ()) -> None:
    """H[0] = max(H[0], amax) for a traced backward that does not update ``state`` (another call of its module
    does, later in the backward)."""
    fold_amaxes({state: amaxes})


class _GlobalState:
    """The autocast stack: current setting, depth, the updates pending for the outermost autocast, the
    callback that sees each registered state (set by :func:`isolated_stack`) and the activation-recompute
    flags (set by :func:`recompute_region`)."""

    def __init__(self):
        self.config = QuantizationConfig()
        self.depth = 0
        self.recompute_enabled = False
        self.recompute_phase = False
        self.forward = _UpdateGroups()
        self.backward = BackwardUpdate()
        self.on_register: Optional[Callable[[Any], None]] = None

    def enter(self, config: QuantizationConfig) -> QuantizationConfig:
        if self.depth == 0:
            self.forward = _UpdateGroups(traced=torch.compiler.is_compiling())
            self.backward = BackwardUpdate()
        saved, self.config = self.config, config
        self.depth += 1
        return saved

    def exit(self, saved: QuantizationConfig, update: bool) -> None:
        self.config = saved
        self.depth -= 1
        if self.depth == 0 and update:
            self.forward.run()
        elif self.depth == 0:
            self.forward.keep_amaxes()


_STATE = _GlobalState()


def current_config() -> QuantizationConfig:
    """The setting of the innermost active autocast (disabled outside any)."""
    return _STATE.config


def autocast_depth() -> int:
    """How many autocasts are active."""
    return _STATE.depth


def recompute_flags() -> Tuple[bool, bool]:
    """(inside a recompute region, in its recomputation): see :func:`recompute_region`."""
    return _STATE.recompute_enabled, _STATE.recompute_phase


def run_pending_update(forward: bool) -> None:
    """Run the delayed-scaling update still pending for the outermost autocast's forward (or backward) states."""
    (_STATE.forward if forward else _STATE.backward.groups).run()


def forward_amax_buffer(fwd_state) -> Optional[torch.Tensor]:
    """While torch.compile traces an FP8 forward whose outermost autocast it traced too: the buffer the casts
    of ``fwd_state`` max their amaxes into, folded in by the update at that autocast's exit; else None
    (the casts write them into the history themselves)."""
    config, forward = _STATE.config, _STATE.forward
    if not (forward.traced and config.enabled and fwd_state.has_amax_history and not _STATE.recompute_phase):
        return None
    return forward.amax_buffer(fwd_state)


def register_states(fwd_state, bwd_state) -> Optional[Callable[..., None]]:
    """Queue a module's delayed-scaling states for their updates (call once per FP8 forward).

    Returns:
        The backward update that this module must run at the end of its backward, if it is the first
        module of the outermost autocast to run forward with grad enabled; else None. Traced by
        torch.compile: the update of this module's own backward state for its first call, the fold of
        the amaxes into its history for later calls (see :class:`BackwardUpdate`).
    """
    config = _STATE.config
    if not (config.enabled and fwd_state.has_amax_history):
        return None
    if _STATE.on_register is not None:
        _STATE.on_register(fwd_state)
        _STATE.on_register(bwd_state)
    if not _STATE.recompute_phase:  # a recomputation casts with the first run's scales: no second forward update
        _STATE.forward.add(fwd_state, config.amax_reduction_group)
    if not torch.is_grad_enabled():
        return None
    if torch.compiler.is_compiling():
        return _STATE.backward.claim_state(bwd_state, config.amax_reduction_group)
    _STATE.backward.groups.add(bwd_state, config.amax_reduction_group)
    return _STATE.backward.claim()


def reset_autocast_state() -> None:
    """Drop the autocast stack, the pending updates and the recompute flags (a fresh process's state)."""
    vars(_STATE).update(vars(_GlobalState()))


@contextmanager
def recompute_region(phase: bool) -> Iterator[None]:
    """Mark the body as a region run twice for activation recomputation: its first run (``phase``
    False) or its recomputation (``phase`` True). Modules that run FP8 in a recomputation queue no
    forward update (their forward states were queued by the first run); the previous flags come back
    on exit."""
    saved = _STATE.recompute_enabled, _STATE.recompute_phase
    _STATE.recompute_enabled, _STATE.recompute_phase = True, phase
    try:
        yield
    finally:
        _STATE.recompute_enabled, _STATE.recompute_phase = saved


@contextmanager
def isolated_stack(on_register: Callable[[Any], None]) -> Iterator[None]:
    """Run the body on an empty autocast stack, the caller's restored afterwards (CUDA-graph capture).

    Inside, an autocast entered by the body is the outermost one, so its updates run (and are captured)
    at its own exit and backward; ``on_register(state)`` sees every delayed-scaling state queued for
    an update, before that update.
    """
    saved = vars(_STATE).copy()
    vars(_STATE).update(vars(_GlobalState()), on_register=on_register)
    try:
        yield
    finally:
        vars(_STATE).update(saved)


def _check_runnable(recipe: Recipe) -> None:
    """Raise before entering FP8 when ``recipe`` cannot run here (the reason is in the message)."""
    if recipe.backward_override is not None:
        raise NotImplementedError(
            f"backward_override={recipe.backward_override!r} is not implemented yet in TransformerEngine-FL; "
            "unset NVTE_BACKWARD_OVERRIDE"
        )
    if getattr(recipe, "fp8_mha", False):
        raise NotImplementedError(
            f"{type(recipe).__name__}(fp8_mha=True): FP8 across the attention's boundaries is not implemented yet in "
            "TransformerEngine-FL (the projections would silently exchange high-precision tensors); set fp8_mha=False "
            "(fp8_dpa=True runs the attention itself in FP8 under DelayedScaling)"
        )
    if getattr(recipe, "fp8_dpa", False) and not recipe.delayed():
        raise NotImplementedError(
            f"{type(recipe).__name__}(fp8_dpa=True): FP8 attention is implemented for DelayedScaling only in "
            "TransformerEngine-FL (attention would silently stay in high precision); set fp8_dpa=False"
        )
    if recipe.mxfp8():  # emulated anywhere
        _check_emulated_runnable(check_mxfp8_support)
    elif recipe.nvfp4():
        _check_emulated_runnable(check_nvfp4_support)
    elif recipe.float8_block_scaling():
        _check_block_scaling_runnable(recipe)
    else:
        _check_fp8_runnable(recipe)


def _check_fp8_runnable(recipe) -> None:
    """Per-tensor FP8: the GPU has FP8 hardware, or emulation was asked for."""
    available, reason = check_fp8_support()
    if not available:
        raise RuntimeError(reason)


def _check_emulated_runnable(check) -> None:
    """MXFP8BlockScaling, NVFP4BlockScaling: emulated exactly on every device (``check()`` says why), no FP8 hardware needed."""
    available, reason = check()
    if not available:
        raise RuntimeError(reason)


def _check_block_scaling_runnable(recipe) -> None:
    """Float8BlockScaling: FP8 runs here, and cuBLASLt's block-scaled GEMMs exist and take the recipe's (E4M3) operands."""
    _check_fp8_runnable(recipe)
    available, reason = check_fp8_block_scaling_support()
    if not available:
        raise RuntimeError(reason)
    if torch.cuda.is_available() and recipe.fp8_format is not Format.E4M3 and not fp8_emulation_requested():
        raise ValueError(
            f"Float8BlockScaling(fp8_format={recipe.fp8_format}) on a CUDA GPU: cuBLASLt's block-scaled GEMMs take "
            "E4M3 operands only (E5M2 gradients would run on the slow reference backend); use Format.E4M3, the default"
        )


class autocast:
    """Context manager that makes TE modules quantize their GEMMs with ``recipe``.

    Args:
        enabled: quantize (FP8) inside the context.
        calibrating: record amax statistics while computing in high precision.
        recipe: the recipe; None means :func:`get_default_recipe`.
        amax_reduction_group: process group over which amaxes are MAX-reduced (None = default group).
        _graph: internal (CUDA-graph capture): skip the forward update at exit.

    Raises:
        RuntimeError: on entry, if FP8 cannot run on this GPU (sm < 8.9 without
            ``TE_FL_FP8_EMULATION=1``); if this instance is already active.
        NotImplementedError: for a recipe not implemented yet (NVFP4).
        ValueError: Float8BlockScaling with E5M2 gradients (HYBRID) on a CUDA GPU.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> from transformer_engine.common.recipe import DelayedScaling
        >>> layer = te.Linear(16, 16)
        >>> with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        ...     y = layer(torch.randn(8, 16))
        >>> y.shape
        torch.Size([8, 16])
    """

    __slots__ = ("enabled", "calibrating", "recipe", "amax_reduction_group", "_graph", "_saved")

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group=None, _graph: bool = False):
        self.enabled = bool(enabled)
        self.calibrating = bool(calibrating)
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self._graph = _graph
        self._saved: Optional[QuantizationConfig] = None

    def __enter__(self) -> "autocast":
        if self._saved is not None:
            raise RuntimeError("this autocast is already active; create a new autocast(...) to nest one")
        recipe = self.recipe if self.recipe is not None else get_default_recipe()
        if self.enabled or self.calibrating:
            check_recipe_implemented(recipe)
        if self.enabled:
            _check_runnable(recipe)
        config = QuantizationConfig(self.enabled, self.calibrating, recipe, self.amax_reduction_group)
        self._saved = _STATE.enter(config)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        saved, self._saved = self._saved, None
        update = self.enabled and not self._graph and exc_type is None and torch.is_grad_enabled()
        _STATE.exit(saved, update)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False) -> autocast:
    """Deprecated alias of :class:`autocast` (``fp8_recipe`` -> ``recipe``, ``fp8_group`` -> ``amax_reduction_group``).

    The deprecation warning is given eagerly only: clients that still call it (HF Accelerate wraps every
    forward in it) must trace under torch.compile without a graph break."""
    if not torch.compiler.is_compiling():
        warnings.warn(
            "fp8_autocast is deprecated; use transformer_engine.pytorch.autocast(enabled, calibrating, recipe, "
            "amax_reduction_group)",
            DeprecationWarning,
            stacklevel=2,
        )
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph)
