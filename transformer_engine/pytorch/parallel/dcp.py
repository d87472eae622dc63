"""``torch.distributed.checkpoint`` (DCP) with the modules' ``_extra_state``: a load planner that resizes it.

A module's ``_extra_state`` is a uint8 tensor whose length depends on its FP8 state: empty for a
module that has not run under delayed scaling yet, a few kilobytes after. DCP loads into the tensors
of the state dict it is given and refuses a saved tensor of another size ("Size mismatch between
saved torch.Size([2322]) and current: torch.Size([0])", NVIDIA TE issue #1860), which is exactly the
case of resuming into a freshly built model. :class:`ExtraStateLoadPlanner` resizes each
``_extra_state`` destination to the saved length before the reads are planned; the module's
``set_extra_state`` then restores the FP8 state from it (``load_state_dict`` or DCP's
``set_model_state_dict``). Parameters reshard as DCP always does (save at one world size, load at
another).

    import torch.distributed.checkpoint as dcp
    from transformer_engine.pytorch.parallel import ExtraStateLoadPlanner

    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=ExtraStateLoadPlanner())
    model.load_state_dict(state["model"])
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["ExtraStateLoadPlanner"]

_SUFFIX = "_extra_state"


def _is_extra_state(key: str, value) -> bool:
    return key.endswith(_SUFFIX) and isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


class ExtraStateLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus: every uint8 ``*_extra_state`` destination takes the saved length.

    The tensors are resized in place, so the caller's (nested) state dict sees the loaded payloads.
    Everything else (keys, strictness, resharding) behaves as :class:`DefaultLoadPlanner`.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        for key, value in self.state_dict.items():
            saved = metadata.state_dict_metadata.get(key)
            if _is_extra_state(key, value) and isinstance(saved, TensorStorageMetadata) and value.size() != saved.size:
                value.resize_(saved.size)
