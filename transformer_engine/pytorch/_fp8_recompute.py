"""FP8 scales across activation recomputation: a recomputed region casts with its first run's scales.

Between a region's first run and its recomputation (in backward) the delayed-scaling update has moved
every scale on, so the recomputation would cast with other scales and compute other values. A
:class:`ScaleRecord` notes, for each module with delayed-scaling state, the scale and scale_inv of
every forward call of the first run (a global forward hook), and puts them back, oldest first per
state, before the module's calls in the recomputation (a global forward pre-hook); the state's own
values (scales and amax history) come back when the recomputation ends. First in, first out per state: with pipelined
micro-batches the first micro-batch run is the first recomputed.

:func:`activation_recompute_forward` is TE's public marker of the two phases, for clients that recompute
with their own machinery (Megatron-LM's ``CheckpointWithoutOutput``); ``te.checkpoint`` uses its own
record per call.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from typing import Deque, Dict, Iterator, Tuple

import torch

from .quantization.autocast import recompute_region

__all__ = ["ScaleRecord", "activation_recompute_forward"]

_REPLAYED = ("scale", "scale_inv")
_STATE_TENSORS = ("scale", "scale_inv", "amax_history")


def fwd_scaling_state(module: torch.nn.Module):
    """The forward delayed-scaling state of a TE module (``fp8_meta["scaling_fwd"]``), or None."""
    meta = getattr(module, "fp8_meta", None)
    state = meta.get("scaling_fwd") if isinstance(meta, dict) else None
    return state if state is not None and getattr(state, "scale", None) is not None else None


def copy_state(state, names: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    """Copies of the state tensors ``names`` that the state has."""
    return {name: getattr(state, name).clone() for name in names if getattr(state, name, None) is not None}


def load_state(state, values: Dict[str, torch.Tensor]) -> None:
    """Write ``values`` into the state's tensors in place (they stay the same objects)."""
    for name, value in values.items():
        getattr(state, name).copy_(value)


class ScaleRecord:
    """The scales FP8 modules cast with in a region's first run, replayed in its recomputation."""

    def __init__(self):
        self.used: Dict[int, Deque[Dict[str, torch.Tensor]]] = defaultdict(deque)

    def _note(self, module, args, output) -> None:
        state = fwd_scaling_state(module)
        if state is not None:
            self.used[id(state)].append(copy_state(state, _REPLAYED))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Note the scales of every module call in the body."""
        handle = torch.nn.modules.module.register_module_forward_hook(self._note)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Before each module call in the body, load the oldest scales noted for its state; on exit, give
        every touched state back its scales and amax history as they were when first touched (the amaxes
        the recomputation recorded are dropped: the history advances once per step)."""
        originals: Dict[int, Tuple[object, Dict[str, torch.Tensor]]] = {}

        def swap_in(module, args) -> None:
            state = fwd_scaling_state(module)
            noted = self.used.get(id(state)) if state is not None else None
            if noted:
                originals.setdefault(id(state), (state, copy_state(state, _STATE_TENSORS)))
                load_state(state, noted.popleft())
                if not noted:
                    del self.used[id(state)]

        handle = torch.nn.modules.module.register_module_forward_pre_hook(swap_in)
        try:
            yield
        finally:
            handle.remove()
            for state, values in originals.values():
                load_state(state, values)


_RECOMPUTE_RECORD = ScaleRecord()


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False) -> Iterator[None]:
    """Mark the body as one run of a recomputed region (TE's API; no effect unless ``activation_recompute``).

    ``recompute_phase=False``: the first run; the scales each FP8 module casts with are noted.
    ``recompute_phase=True``: the recomputation (in backward, inside the caller's autocast); each module
    casts with the scales noted for it, oldest first, and queues no forward update.

    Example:
        >>> from transformer_engine.pytorch.distributed import activation_recompute_forward
        >>> from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        >>> with activation_recompute_forward(activation_recompute=True, recompute_phase=False):
        ...     FP8GlobalStateManager.is_fp8_activation_recompute_enabled()
        True
    """
    if not activation_recompute:
        yield
        return
    noting = _RECOMPUTE_RECORD.replaying() if recompute_phase else _RECOMPUTE_RECORD.recording()
    with recompute_region(phase=recompute_phase), noting:
        yield
