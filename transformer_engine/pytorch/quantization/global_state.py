"""``FP8GlobalStateManager``: TE's read-only view of the quantization state, for clients (Megatron-LM).

Only the queries clients use are provided; the state itself lives in :mod:`.autocast` and
:mod:`.model_init`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.recipe import Recipe

from . import availability
from .autocast import autocast_depth, current_config, recompute_flags, reset_autocast_state, run_pending_update
from .model_init import model_init_config

__all__ = ["FP8GlobalStateManager"]


class FP8GlobalStateManager:
    """Class-level queries of the autocast / model-init state (TE's names)."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """True inside ``autocast(enabled=True)``."""
        return current_config().enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """True inside ``autocast(calibrating=True)``."""
        return current_config().calibrating

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The active recipe, or the default recipe outside any autocast."""
        return current_config().recipe or availability.get_default_recipe()

    @classmethod
    def get_fp8_group(cls):
        """The active amax reduction group (None = default group)."""
        return current_config().amax_reduction_group

    @classmethod
    def get_autocast_depth(cls) -> int:
        """How many autocasts are active."""
        return autocast_depth()

    @classmethod
    def is_fp8_activation_recompute_enabled(cls) -> bool:
        """True inside ``activation_recompute_forward(activation_recompute=True)`` (either phase)."""
        return recompute_flags()[0]

    @classmethod
    def in_fp8_activation_recompute_phase(cls) -> bool:
        """True while a recomputed region runs its second time (``recompute_phase=True``)."""
        return recompute_flags()[1]

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """True inside ``quantized_model_init(enabled=True)``."""
        return model_init_config().enabled

    @classmethod
    def get_model_init_recipe(cls) -> Optional[Recipe]:
        """The recipe of the active ``quantized_model_init``."""
        return model_init_config().recipe

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """True while a CUDA graph captures FP8 work (``make_graphed_callables``) on the current stream."""
        return current_config().enabled and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        """(available, reason) for per-tensor FP8."""
        return availability.check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        """(available, reason) for MXFP8."""
        return availability.check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        """(available, reason) for Float8BlockScaling."""
        return availability.check_fp8_block_scaling_support()

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        """(available, reason) for NVFP4."""
        return availability.check_nvfp4_support()

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """The key of a module's forward ("scaling_fwd") or backward ("scaling_bwd") state in ``fp8_meta``."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @classmethod
    def reset(cls) -> None:
        """Back to the state of a fresh process: no autocast active, no update pending, no recompute flags
        (TE's tests call it between cases; a model's own scaling state is not touched)."""
        reset_autocast_state()

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Run the pending forward (or backward) delayed-scaling update now."""
        run_pending_update(forward)
