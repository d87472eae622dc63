"""A module's quantization state (``fp8_meta``, ``quantizers``) and the quantizers of one forward call.

``fp8_meta`` keeps TE's keys: "recipe", "num_gemms", "scaling_fwd", "scaling_bwd" (the
:class:`RecipeState` of each direction, built at the first quantized forward) and "fp8_checkpoint"
(True when the state carries an amax history worth checkpointing). ``quantizers`` maps
"scaling_fwd" / "scaling_bwd" to one quantizer per slot.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from transformer_engine.common.recipe import Recipe

from ..quantization.quantizer import IDENTITY, Quantizer
from ..quantization.recipe_state import ALL_SPLIT, RecipeState, SplitAccumulator
from ..quantization.roles import BWD_ROLES, FWD_ROLES, slot

__all__ = ["ForwardQuantization", "GemmQuantizers", "ensure_states", "high_precision", "install_states", "new_fp8_meta"]


@dataclass(frozen=True)
class GemmQuantizers:
    """The quantizers of the five tensor roles of one GEMM (:data:`HIGH_PRECISION_GEMM`: identity for each).

    No field has a default: torch 2.11's Dynamo cannot rebuild an object default of a dataclass made in a
    traced call (a module's first FP8 step builds these while torch.compile traces it)."""

    input: Quantizer
    weight: Quantizer
    output: Quantizer
    grad_output: Quantizer
    grad_input: Quantizer

    @staticmethod
    def from_slots(fwd: List[Quantizer], bwd: List[Quantizer], num_gemms: int) -> Tuple["GemmQuantizers", ...]:
        """Group per-slot quantizers by GEMM (TE's slot order, see quantization.roles)."""
        return tuple(
            GemmQuantizers(*(fwd[slot(g, r)] for r in FWD_ROLES), *(bwd[slot(g, r)] for r in BWD_ROLES))
            for g in range(num_gemms)
        )


HIGH_PRECISION_GEMM = GemmQuantizers(IDENTITY, IDENTITY, IDENTITY, IDENTITY, IDENTITY)


@dataclass(frozen=True)
class ForwardQuantization:
    """What one forward call of a module quantizes.

    Attributes:
        gemms: quantizers per GEMM.
        split_accumulator: ``use_split_accumulator`` of the fprop, dgrad and wgrad GEMMs.
        backward_update: run at the end of this module's backward with the backward's list of traced
            grad-cast amaxes (the delayed-scaling update of the gradients' scales), or None.
        for_training: grad mode was on: the casts also write the copies that backward reads (x^T);
            off (inference under ``torch.no_grad``), the forward casts only what it multiplies.
    """

    gemms: Tuple[GemmQuantizers, ...]
    split_accumulator: SplitAccumulator = ALL_SPLIT
    backward_update: Optional[Callable[..., None]] = None
    for_training: bool = True


@functools.lru_cache(maxsize=None)
def high_precision(num_gemms: int) -> ForwardQuantization:
    """No quantization for ``num_gemms`` GEMMs."""
    return ForwardQuantization(gemms=(HIGH_PRECISION_GEMM,) * num_gemms)


def new_fp8_meta(num_gemms: int) -> Dict:
    """An empty ``fp8_meta`` (no recipe yet)."""
    return {"recipe": None, "num_gemms": num_gemms, "scaling_fwd": None, "scaling_bwd": None, "fp8_checkpoint": False}


def install_states(fp8_meta: Dict, quantizers: Dict, fwd: RecipeState, bwd: RecipeState) -> None:
    """Make ``fwd`` / ``bwd`` the module's states and rebuild its quantizers."""
    fp8_meta.update(recipe=fwd.recipe, scaling_fwd=fwd, scaling_bwd=bwd, fp8_checkpoint=fwd.has_amax_history)
    quantizers["scaling_fwd"] = fwd.make_quantizers()
    quantizers["scaling_bwd"] = bwd.make_quantizers()


def ensure_states(fp8_meta: Dict, quantizers: Dict, recipe: Recipe, device, owner: str, reserved: Optional[Dict] = None) -> bool:
    """Bring the states in line with ``recipe``; returns True when they or their quantizers were (re)built.

    A new recipe *type* rebuilds them (with a "Recipe type changed" UserWarning if there were any);
    the same type keeps the scales and histories (moved to ``device`` if the module moved), adopting the
    recipe's fields (the history is resized in place when ``amax_history_len`` changed); a recipe of other
    field values also rebuilds the quantizers of states without a history, whose casts take their rules
    from those fields (block tiles, QParams, a CustomRecipe's factory). ``reserved``: tensors allocated
    ahead per mode ("forward", "backward"), taken (popped) by new delayed-scaling states.
    """
    old = fp8_meta["scaling_fwd"]
    if old is not None and type(old.recipe) is type(recipe):
        new_rules = not old.has_amax_history and old.recipe is not recipe and old.recipe != recipe
        for state in (old, fp8_meta["scaling_bwd"]):
            state.move_to(device)
            if state.recipe is not recipe:  # recipes are frozen: the same object has the same fields
                state.recipe = recipe
                if state.has_amax_history:
                    state.adjust_amax_history_length(recipe.amax_history_len)
        fp8_meta["recipe"] = recipe
        if new_rules:
            install_states(fp8_meta, quantizers, old, fp8_meta["scaling_bwd"])
        return new_rules
    if old is not None:
        warnings.warn(
            f"Recipe type changed from {type(old.recipe).__name__} to {type(recipe).__name__} in {owner}: "
            "its quantizers are rebuilt and its scaling state starts afresh",
            UserWarning,
            stacklevel=4,
        )
    n = fp8_meta["num_gemms"]
    reserved = reserved if reserved is not None else {}
    fwd = RecipeState.create(recipe, mode="forward", num_gemms=n, device=device, reserved=reserved.pop("forward", None))
    bwd = RecipeState.create(recipe, mode="backward", num_gemms=n, device=device, reserved=reserved.pop("backward", None))
    install_states(fp8_meta, quantizers, fwd, bwd)
    return True
