"""NVIDIA TE's helpers for code that captures CUDA graphs of TE modules itself (Megatron-Core's CUDA-graph support),
re-exported from :mod:`.graph` where that code imports them.

- ``set_capture_start`` / ``set_capture_end`` / ``is_graph_capturing``: a process-wide flag marking a capture
  in progress (``make_graphed_callables`` sets it too).
- ``save_fp8_tensors(modules, recipe)`` / ``restore_fp8_tensors(modules, saved)``: the delayed-scaling state of
  every TE module, copied before warm-up steps and written back after them, so that warm-up leaves the amax
  histories and scales as they were (the state is made first where a module has none for ``recipe``).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch

from transformer_engine.common.recipe import DelayedScaling, Recipe

from .module.base import TransformerEngineBaseModule

__all__ = ["is_graph_capturing", "restore_fp8_tensors", "save_fp8_tensors", "scaling_tensors", "set_capture_end", "set_capture_start"]

_capturing = False


def set_capture_start() -> None:
    """Mark the start of a capture of TE modules."""
    global _capturing
    _capturing = True


def set_capture_end() -> None:
    """Mark its end."""
    global _capturing
    _capturing = False


def is_graph_capturing() -> bool:
    """Whether a capture marked by :func:`set_capture_start` is in progress."""
    return _capturing


def save_fp8_tensors(modules: Iterable[torch.nn.Module], recipe: Optional[Recipe]) -> Optional[List[Optional[Tuple[torch.Tensor, ...]]]]:
    """Copies of the delayed-scaling state (amax histories, scales, scale_invs) of every submodule of ``modules``, in
    ``modules()`` order, None for a submodule without one; None unless ``recipe`` is DelayedScaling. A TE module
    with FP8 GEMMs gets its state for ``recipe`` (history length included) made now if it has none yet."""
    if not isinstance(recipe, DelayedScaling):
        return None
    return [_state_copy(m, recipe) for module in modules for m in module.modules()]


def restore_fp8_tensors(modules: Iterable[torch.nn.Module], fp8_tensors: Optional[List[Optional[Tuple[torch.Tensor, ...]]]]) -> None:
    """Write back what :func:`save_fp8_tensors` copied (nothing when it returned None).

    Raises:
        RuntimeError: ``fp8_tensors`` was saved from other modules (another count of submodules or states).
    """
    if fp8_tensors is None:
        return
    submodules = [m for module in modules for m in module.modules()]
    if len(submodules) != len(fp8_tensors):
        raise RuntimeError(f"restore_fp8_tensors got the state of {len(fp8_tensors)} submodules for {len(submodules)}; "
                           "pass the modules given to save_fp8_tensors")
    for m, saved in zip(submodules, fp8_tensors):
        if saved is None:
            continue
        tensors = _state_tensors(m) if isinstance(m, TransformerEngineBaseModule) else ()
        if len(tensors) != len(saved):
            raise RuntimeError(f"restore_fp8_tensors: {type(m).__name__} has {len(tensors)} scaling tensors, the saved state {len(saved)}")
        for tensor, value in zip(tensors, saved):
            tensor.copy_(value)


def _state_copy(m: torch.nn.Module, recipe: DelayedScaling) -> Optional[Tuple[torch.Tensor, ...]]:
    if not isinstance(m, TransformerEngineBaseModule) or m.fp8_meta["num_gemms"] == 0:
        return None
    m._build_states_eagerly(recipe, m._state_device())
    return tuple(t.clone() for t in _state_tensors(m))


def scaling_tensors(state) -> Tuple[torch.Tensor, ...]:
    """The tensors of one delayed-scaling state that an update writes: amax history, scale, scale_inv."""
    return (state.amax_history, state.scale, state.scale_inv)


def _state_tensors(m: TransformerEngineBaseModule) -> Tuple[torch.Tensor, ...]:
    states = (m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"])
    return tuple(t for s in states if s is not None for t in scaling_tensors(s))
