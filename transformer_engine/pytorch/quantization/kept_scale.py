"""``kept_scales(scale)``: copies of a delayed-scaling scale's entries and their reciprocals that a compiled
backward reads as saved, never recomputed.

A traced training step reads ``scale[i]`` for its forward casts and then, at the autocast's exit,
updates ``scale`` in place; AOTAutograd applies that update to the state tensor when the forward
ends. Its min-cut partitioner may still recompute a cheap cast in the backward graph (x^T for wgrad
from the saved norm input, W^T for dgrad from the weight) rather than save its result, and that
recomputation would read the updated scale: wrong FP8 values, silently. The partitioner recomputes only
the ops of its allowlist (pointwise and view ops), which has no foreach op: a traced cast takes its scale
from ``torch._foreach_mul(entries, 1.0)`` (x * 1 = x, bit for bit), which the backward receives as saved.

Each copy and each reciprocal (``torch._foreach_reciprocal``, torch.reciprocal's value) is a 0-d tensor
of its own, as Inductor's ``_scaled_mm`` lowering wants its scales (no view into a vector); Inductor
computes a foreach op's outputs in one kernel, without a Python call. Only traced code calls these;
eager casts read the state directly (nothing is recomputed there).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["kept_copy", "kept_scales"]


def kept_scales(scale: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """([s_0, ..., s_{N-1}], [1 / s_0, ..., 1 / s_{N-1}]) of the vector ``scale``: 0-d tensors that the
    partitioner saves for backward instead of recomputing."""
    kept = torch._foreach_mul(scale.unbind(), 1.0)
    return kept, torch._foreach_reciprocal(kept)


def kept_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that the partitioner saves for backward instead of recomputing."""
    return torch._foreach_mul([t], 1.0)[0]
