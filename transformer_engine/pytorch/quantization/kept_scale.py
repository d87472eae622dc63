"""``kept_copy(scale)``: a copy of a delayed-scaling scale that a compiled backward reads as saved, never recomputed.

A traced training step reads ``scale[i]`` for its forward casts and then, at the autocast's exit,
updates ``scale`` in place; AOTAutograd applies that update to the state tensor when the forward
ends. Its min-cut partitioner may still recompute a cheap cast in the backward graph (x^T for wgrad
from the saved norm input, W^T for dgrad from the weight) rather than save its result, and that
recomputation would read the updated scale: wrong FP8 values, silently. The partitioner never
recomputes the result of a custom op, so a traced cast takes its scale from ``kept_copy``, an opaque
clone (one element) that the backward receives as a saved tensor.

Only traced code calls it; eager casts read the state directly (nothing is recomputed there).
"""

from __future__ import annotations

import torch

__all__ = ["kept_copy"]

_LIBRARY = torch.library.Library("te_fl", "FRAGMENT")
_LIBRARY.define("kept_copy(Tensor t) -> Tensor")
_LIBRARY.impl("kept_copy", lambda t: t.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("te_fl::kept_copy", lambda t: torch.empty_like(t), lib=_LIBRARY)


def kept_copy(t: torch.Tensor) -> torch.Tensor:
    """A clone of ``t`` that torch.compile's partitioner saves for backward instead of recomputing."""
    return torch.ops.te_fl.kept_copy.default(t)
