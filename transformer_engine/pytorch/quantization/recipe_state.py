"""Per-module scaling state of one direction (forward or backward), built from the active recipe.

A module keeps two states in ``fp8_meta["scaling_fwd"]`` and ``fp8_meta["scaling_bwd"]`` (TE's names),
with 3 slots per GEMM forward (input, weight, output) and 2 backward (grad output, grad input), see
:mod:`.roles`. The state hands out one quantizer per slot (``module.quantizers["scaling_fwd"]``).

:class:`DelayedScalingRecipeState` holds TE's tensors:

    scale        float32 [N], ones at first: the scale each slot casts with this step
    scale_inv    float32 [N], 1 / scale
    amax_history float32 [L, N], zeros at first: row 0 collects this step's amaxes; after an update
                 rows 1..L-1 hold the last L-1 amaxes, the newest in row L-1

:class:`Float8CurrentScalingRecipeState`, :class:`Float8BlockScalingRecipeState`,
:class:`MXFP8BlockScalingRecipeState` and :class:`NVFP4BlockScalingRecipeState` hold nothing: each cast
computes its own scale (per tensor, per tile, per block of 32 as an E8M0 power of two, or per block of 16
as E4M3 under a per-tensor scale). :class:`CustomRecipeState` holds what the user's
quantizers hold (``CustomRecipe.qfactory``).
"""

from __future__ import annotations

import itertools
import warnings
from typing import List, NamedTuple, Optional, Tuple

import torch

from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

from .kept_scale import kept_scales
from .quantizer import (
    IDENTITY,
    AmaxObserver,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from .roles import BWD_ROLES, FWD_ROLES, Role
from .scaling import fp8_dtypes, fp8_max

__all__ = [
    "DelayedScalingRecipeState",
    "Float8BlockScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "CustomRecipeState",
    "MXFP8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState",
    "RecipeState",
    "SplitAccumulator",
    "check_recipe_implemented",
]


class SplitAccumulator(NamedTuple):
    """``use_split_accumulator`` of a linear layer's three GEMMs (the recipes' ``fp8_gemm_fprop`` / ``_dgrad`` / ``_wgrad``)."""

    fprop: bool
    dgrad: bool
    wgrad: bool


#: every GEMM with the exact accumulation
ALL_SPLIT = SplitAccumulator(fprop=True, dgrad=True, wgrad=True)
#: TE's defaults: the fprop GEMM with the fast accumulation, dgrad and wgrad exact
FAST_FPROP = SplitAccumulator(fprop=False, dgrad=True, wgrad=True)
#: each combination of the three flags as one SplitAccumulator, made here rather than per forward call
_SPLITS = {flags: SplitAccumulator(*flags) for flags in itertools.product((False, True), repeat=3)}

_IMPLEMENTED = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, CustomRecipe)
_MODES = ("forward", "backward")


def check_recipe_implemented(recipe: Recipe) -> None:
    """Raise TypeError for what is not a recipe, NotImplementedError for a recipe option the modules cannot honour yet."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a transformer_engine.common.recipe recipe, got {type(recipe).__name__}")
    if not isinstance(recipe, _IMPLEMENTED):
        raise NotImplementedError(
            f"{type(recipe).__name__} is not implemented yet in TransformerEngine-FL's PyTorch modules; "
            "use DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling or CustomRecipe"
        )
    if isinstance(recipe, NVFP4BlockScaling):
        _check_nvfp4_options(recipe)


def _check_nvfp4_options(recipe: NVFP4BlockScaling) -> None:
    """NotImplementedError for NVFP4 options newer than what the modules implement (never silently ignored);
    ValueError for 4over6 on activations with the RHT, which NVIDIA TE refuses when it makes their quantizers."""
    unsupported = {name: getattr(recipe, name) for name, default in _NVFP4_DEFAULTS.items() if getattr(recipe, name) != default}
    if unsupported:
        settings = ", ".join(f"{name}={value!r}" for name, value in unsupported.items())
        raise NotImplementedError(
            f"NVFP4BlockScaling({settings}) is not implemented yet in TransformerEngine-FL (environment NVTE_NVFP4_*); "
            "leave these options at their defaults"
        )
    if recipe.nvfp4_4over6 in ("activations", "all") and not recipe.disable_rht:
        raise ValueError(
            f"NVFP4BlockScaling(nvfp4_4over6={recipe.nvfp4_4over6!r}, disable_rht=False): 4over6 quantizes the activations, "
            "whose recipe settings apply the random Hadamard transform, and NVFP4 4over6 quantization does not support RHT "
            "(NVIDIA TE raises the same); pass disable_rht=True, or nvfp4_4over6='weights'"
        )


#: NVFP4 options (TE 2.16) whose non-default values the modules do not implement yet
_NVFP4_DEFAULTS = {"row_scaled_activation": False}


class RecipeState:
    """Base class; :meth:`create` picks the subclass that matches the recipe.

    Attributes:
        recipe: the recipe in force (same type for the state's lifetime; other fields may change).
        mode: "forward" or "backward".
        num_quantizers: N, 3 per GEMM forward and 2 per GEMM backward.
        fp8_dtype: E4M3 forward; backward E5M2 under HYBRID, E4M3 under E4M3 (set with the recipe:
            every cast reads it, and recipes are frozen).
    """

    #: True when the state has an amax history that autocast must reduce and update.
    has_amax_history = False

    def __init__(self, recipe: Recipe, mode: str, num_quantizers: int):
        if mode not in _MODES:
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        self.mode = mode
        self._adopt(recipe)  # not the property setter: torch 2.11's Dynamo loses what a setter sets on an object made in a trace
        self.num_quantizers = num_quantizers

    @property
    def recipe(self) -> Recipe:
        """The recipe in force; assigning one also sets ``fp8_dtype``."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        self._adopt(recipe)

    def _adopt(self, recipe: Recipe) -> None:
        forward, backward = fp8_dtypes(recipe.fp8_format)
        self._recipe = recipe
        self.fp8_dtype = forward if self.mode == "forward" else backward

    @staticmethod
    def create(recipe: Recipe, *, mode: str, num_gemms: int, device, reserved: Optional[Tuple[torch.Tensor, ...]] = None) -> "RecipeState":
        """The state of ``num_gemms`` GEMMs for ``recipe`` in direction ``mode``; ``reserved``: delayed scaling's
        (scale, scale_inv, amax_history) allocated ahead (see :func:`reserve_delayed_tensors`), taken when they fit."""
        check_recipe_implemented(recipe)
        n = num_gemms * (len(FWD_ROLES) if mode == "forward" else len(BWD_ROLES))
        if isinstance(recipe, DelayedScaling):
            return DelayedScalingRecipeState(recipe, mode, n, device, reserved)
        if isinstance(recipe, Float8BlockScaling):
            return Float8BlockScalingRecipeState(recipe, mode, n)
        if isinstance(recipe, CustomRecipe):
            return CustomRecipeState(recipe, mode, n)
        if isinstance(recipe, MXFP8BlockScaling):
            return MXFP8BlockScalingRecipeState(recipe, mode, n)
        if isinstance(recipe, NVFP4BlockScaling):
            return NVFP4BlockScalingRecipeState(recipe, mode, n)
        return Float8CurrentScalingRecipeState(recipe, mode, n)

    @property
    def split_accumulator(self) -> SplitAccumulator:
        """``use_split_accumulator`` of the fprop, dgrad and wgrad GEMMs."""
        raise NotImplementedError

    def make_quantizers(self) -> List[Quantizer]:
        """One FP8 quantizer per slot."""
        raise NotImplementedError

    def make_observers(self) -> List[Quantizer]:
        """One calibration quantizer per slot (high precision that records amaxes, where the recipe has any)."""
        return [IDENTITY] * self.num_quantizers

    def move_to(self, device: torch.device) -> None:
        """Keep the state's tensors on ``device`` (a module moved after its first FP8 step)."""


def reserve_delayed_tensors(num_quantizers: int, history_len: int, device) -> Tuple[torch.Tensor, ...]:
    """(scale, scale_inv, amax_history) of a fresh delayed-scaling state: ones, ones, zeros [L, N].

    Modules allocate them ahead, at construction, for the default history length: a state whose
    tensors exist before torch.compile traces the first FP8 step is traced whole (tensors the graph
    made itself could not be written by the backward graph), see ``TransformerEngineBaseModule``."""
    def ones():
        return torch.ones(num_quantizers, dtype=torch.float32, device=device)

    return ones(), ones(), torch.zeros(history_len, num_quantizers, dtype=torch.float32, device=device)


def reserved_fit(reserved: Optional[Tuple[torch.Tensor, ...]], recipe: DelayedScaling, num_quantizers: int, device) -> bool:
    """True when tensors from :func:`reserve_delayed_tensors` can be the state of ``recipe`` on ``device``
    (same history length and slot count: a module moved after construction keeps them on the old device)."""
    return (reserved is not None and reserved[2].shape == (recipe.amax_history_len, num_quantizers)
            and reserved[2].device == torch.device(device))


def _static(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as a static address for torch.compile (a new tensor in its place: CUDA graphs re-record).

    What ``torch._dynamo.mark_static_address(t, guard=False)`` does, without importing Dynamo (1.6 s) with
    the first FP8 state (``tests/pytorch/test_compile.py`` checks that the two agree). A tensor made
    inside a traced call is the graph's own: nothing to mark."""
    if not torch.compiler.is_compiling():
        t._dynamo_static_input_type = "unguarded"
    return t


class DelayedScalingRecipeState(RecipeState):
    """Delayed scaling: ``scale``, ``scale_inv`` [N] and ``amax_history`` [L, N] (see the module docstring)."""

    has_amax_history = True

    def __init__(self, recipe: DelayedScaling, mode: str, num_quantizers: int, device,
                 reserved: Optional[Tuple[torch.Tensor, ...]] = None):
        super().__init__(recipe, mode, num_quantizers)
        fits = reserved_fit(reserved, recipe, num_quantizers, device)
        scale, scale_inv, amax_history = reserved if fits else reserve_delayed_tensors(num_quantizers, recipe.amax_history_len, device)
        self._scale, self._scale_inv, self._amax_history = _static(scale), _static(scale_inv), _static(amax_history)  # (as _adopt)

    # The state tensors are written in place by every step, inside the graphs torch.compile makes too.
    # Marked as static addresses (as parameters and buffers are), they let Inductor's CUDA graphs
    # (mode="reduce-overhead") keep graphs that write them; any other written input makes it skip them.
    scale = property(lambda self: self._scale, lambda self, t: setattr(self, "_scale", _static(t)))
    scale_inv = property(lambda self: self._scale_inv, lambda self, t: setattr(self, "_scale_inv", _static(t)))
    amax_history = property(lambda self: self._amax_history, lambda self, t: setattr(self, "_amax_history", _static(t)))

    @property
    def fp8_max(self) -> float:
        """448 for E4M3, 57344 for E5M2."""
        return fp8_max(self.fp8_dtype)

    @property
    def split_accumulator(self) -> SplitAccumulator:
        return FAST_FPROP

    def adjust_amax_history_length(self, length: int) -> None:
        """Resize the history in place to ``length`` rows: keep the first rows, or pad with zeros at the end."""
        current = self.amax_history.shape[0]
        if length == current:
            return
        warnings.warn(
            f"Quantizer is being updated, this may affect model behavior: amax_history_len changes from "
            f"{current} to {length}", UserWarning, stacklevel=3
        )
        if length < current:
            self.amax_history = self.amax_history[:length].clone()
        else:
            pad = self.amax_history.new_zeros(length - current, self.num_quantizers)
            self.amax_history = torch.cat([self.amax_history, pad])

    def move_to(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.scale, self.scale_inv, self.amax_history = (t.to(device) for t in (self.scale, self.scale_inv, self.amax_history))

    def make_quantizers(self) -> List[Quantizer]:
        return [Float8Quantizer(self, i) for i in range(self.num_quantizers)]

    def traced_quantizers(self, amaxes: Optional[torch.Tensor] = None) -> List[Quantizer]:
        """Quantizers of this forward state for one call that torch.compile traces.

        The scale's entries are kept (:func:`~.kept_scale.kept_scales`) once for all of them, rather than
        copied per cast, with their reciprocals as the operands' scale_inv (the same values; see
        ``Float8Quantizer._recording``): 0-d tensors that Inductor computes in one kernel. ``amaxes``: a
        float32 [N] buffer their casts max their amaxes into, for an update in the same trace to fold
        (:func:`~.delayed_update.reduce_and_update`); None: each cast folds its amax into H[0]."""
        kept, inverses = kept_scales(self.scale)
        return [Float8Quantizer(self, i, (kept[i], inverses[i]), amaxes) for i in range(self.num_quantizers)]

    def make_observers(self) -> List[Quantizer]:
        return [AmaxObserver(q) for q in self.make_quantizers()]


class Float8CurrentScalingRecipeState(RecipeState):
    """Current scaling: no tensors; each slot's quantizer uses the recipe's QParams for its role."""

    @property
    def split_accumulator(self) -> SplitAccumulator:
        r = self.recipe
        flags = (r.fp8_gemm_fprop.use_split_accumulator, r.fp8_gemm_dgrad.use_split_accumulator, r.fp8_gemm_wgrad.use_split_accumulator)
        return _SPLITS.get(flags) or SplitAccumulator(*flags)

    def _qparams(self, index: int):
        if self.mode == "backward":
            return self.recipe.fp8_quant_bwd_grad
        if FWD_ROLES[index % len(FWD_ROLES)] is Role.WEIGHT:
            return self.recipe.fp8_quant_fwd_weight
        return self.recipe.fp8_quant_fwd_inp

    def make_quantizers(self) -> List[Quantizer]:
        return [Float8CurrentScalingQuantizer(self.fp8_dtype, self._qparams(i)) for i in range(self.num_quantizers)]


class Float8BlockScalingRecipeState(RecipeState):
    """Block scaling: no tensors; each slot's quantizer uses its role's tile (``*_block_scaling_dim``) and QParams."""

    @property
    def split_accumulator(self) -> SplitAccumulator:
        return ALL_SPLIT  # enforced by the recipe

    def _block_dim_and_qparams(self, index: int):
        r = self.recipe
        if self.mode == "backward":
            return r.grad_block_scaling_dim, r.fp8_quant_bwd_grad
        if FWD_ROLES[index % len(FWD_ROLES)] is Role.WEIGHT:
            return r.w_block_scaling_dim, r.fp8_quant_fwd_weight
        return r.x_block_scaling_dim, r.fp8_quant_fwd_inp

    def make_quantizers(self) -> List[Quantizer]:
        return [Float8BlockQuantizer(self.fp8_dtype, *self._block_dim_and_qparams(i)) for i in range(self.num_quantizers)]


class MXFP8BlockScalingRecipeState(RecipeState):
    """MXFP8: no tensors; every slot casts blocks of 32 with E8M0 scales, E4M3 (backward E5M2 under HYBRID)."""

    @property
    def split_accumulator(self) -> SplitAccumulator:
        return ALL_SPLIT  # MXFP8 GEMMs accumulate in float32 (emulated: a float32 GEMM)

    def make_quantizers(self) -> List[Quantizer]:
        return [MXFP8Quantizer(self.fp8_dtype) for _ in range(self.num_quantizers)]


class NVFP4BlockScalingRecipeState(RecipeState):
    """NVFP4: no tensors; each slot's quantizer follows its role's QParams (TE's defaults: inputs RHT on the
    column-wise copy, weights 16 x 16 tiles, gradients RHT and stochastic rounding).

    4over6, as NVIDIA TE's ``NVFP4BlockScalingRecipeState``: the forward slots ``nvfp4_4over6`` selects ("weights":
    the weight slots; "activations": the input and output slots; "all": every forward slot) quantize with 4over6
    and ``nvfp4_4over6_err_mode``, under the global scale bound 256 where ``nvfp4_4over6_e4m3_use_256`` also selects
    them (else 448); gradient slots never do.
    """

    @property
    def split_accumulator(self) -> SplitAccumulator:
        return ALL_SPLIT  # emulated: a float32 GEMM

    def _qparams(self, index: int):
        if self.mode == "backward":
            return self.recipe.fp4_quant_bwd_grad
        if FWD_ROLES[index % len(FWD_ROLES)] is Role.WEIGHT:
            return self.recipe.fp4_quant_fwd_weight
        return self.recipe.fp4_quant_fwd_inp

    def _four_over_six(self, index: int) -> Tuple[Optional[str], int]:
        """(four_over_six, e4m3_max) of slot ``index``: (err mode, 256 or 448) where 4over6 applies, else (None, 448)."""
        if self.mode == "backward":
            return None, 448
        weight = FWD_ROLES[index % len(FWD_ROLES)] is Role.WEIGHT
        if not _selects(self.recipe.nvfp4_4over6, weight=weight):
            return None, 448
        return self.recipe.nvfp4_4over6_err_mode, 256 if _selects(self.recipe.nvfp4_4over6_e4m3_use_256, weight=weight) else 448

    def make_quantizers(self) -> List[Quantizer]:
        quantizers = []
        for i in range(self.num_quantizers):
            q, (four_over_six, e4m3_max) = self._qparams(i), self._four_over_six(i)
            quantizers.append(NVFP4Quantizer(rht=q.random_hadamard_transform, block_2d=q.fp4_2d_quantization,
                                             stochastic_rounding=q.stochastic_rounding, four_over_six=four_over_six, e4m3_max=e4m3_max))
        return quantizers


def _selects(scope: str, *, weight: bool) -> bool:
    """Whether an NVFP4 4over6 scope ("none", "weights", "activations", "all") selects a forward slot (a weight's or not)."""
    return scope == "all" or scope == ("weights" if weight else "activations")


#: TE's role names of the slots, per GEMM, that ``CustomRecipe.qfactory`` is asked for
_CUSTOM_ROLES = {"forward": ("linear_input", "linear_weight", "linear_output"), "backward": ("linear_grad_output", "linear_grad_input")}


class CustomRecipeState(RecipeState):
    """CustomRecipe: slot i casts with the quantizer ``recipe.qfactory(role)`` returns for its role
    ("linear_input", "linear_weight", "linear_output"; backward "linear_grad_output", "linear_grad_input").

    The factory returns TE's public quantizers (``Float8Quantizer``: its scale, amax max-accumulated into
    its amax; ``Float8CurrentScalingQuantizer``, ``Float8BlockQuantizer``, ``MXFP8Quantizer``, ``NVFP4Quantizer``: their
    rules); each gives the module-side quantizer that casts alike (``module_quantizer()``). No state of its own: nothing
    for autocast to update.

    Attributes:
        factory_quantizers: what the factory returned for each slot at the last :meth:`make_quantizers` (the module's
            public ``quantizers``).
    """

    factory_quantizers: Tuple = ()

    @property
    def split_accumulator(self) -> SplitAccumulator:
        return FAST_FPROP  # TE's defaults where a recipe names none

    def make_quantizers(self) -> List[Quantizer]:
        roles = _CUSTOM_ROLES[self.mode]
        self.factory_quantizers = tuple(self.recipe.qfactory(roles[i % len(roles)]) for i in range(self.num_quantizers))
        return [self._module_quantizer(made, roles[i % len(roles)]) for i, made in enumerate(self.factory_quantizers)]

    @staticmethod
    def _module_quantizer(made, role: str) -> Quantizer:
        convert = getattr(made, "module_quantizer", None)
        if convert is None:
            raise TypeError(
                f"CustomRecipe.qfactory({role!r}) returned {type(made).__name__}; return a Float8Quantizer, "
                "Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer or NVFP4Quantizer of transformer_engine.pytorch "
                "(other quantizers are not implemented yet)"
            )
        return convert()
