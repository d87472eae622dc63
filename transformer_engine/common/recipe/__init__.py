"""FP8 / FP4 training recipes (pure Python, importable without torch).

A recipe says how tensors are quantized inside ``transformer_engine.pytorch.autocast``:

- :class:`DelayedScaling`: per-tensor scale from the amax history of earlier steps,
  scale = (fp8_max / amax) / 2^margin;
- :class:`Float8CurrentScaling`: per-tensor scale from the tensor itself, scale = fp8_max / amax;
- :class:`Float8BlockScaling`, :class:`MXFP8BlockScaling`, :class:`NVFP4BlockScaling`: one scale per
  block of elements (1x128 / 128x128, 1x32 with E8M0 scales, 1x16 with E4M3 scales);
- :class:`CustomRecipe`: quantizers from a user factory.

Recipes are frozen dataclasses validated once at construction; equal fields mean equal recipes.
Fields removed from NVIDIA TE (``interval``, ``override_linear_precision``) are accepted with the value
every recipe honours (1; (False, False, False), as Megatron-Core passes it) and raise a ``TypeError``
that says so for any other.

Example:
    >>> from transformer_engine.common.recipe import DelayedScaling, Format
    >>> r = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    >>> (r.margin, r.amax_compute_algo, r.delayed(), r.float8_current_scaling())
    (0, 'max', True, False)
    >>> Format.HYBRID.value.max_fwd, Format.HYBRID.value.max_bwd
    (448, 57344)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

from ..env import read_choice, read_switch

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]

_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_NVFP4_4OVER6_TARGETS = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")
# Fields that NVIDIA TE removed (its pydantic recipes still accept and drop them; Megatron-Core passes
# override_linear_precision): the value that states what every recipe does is accepted, any other is an
# error that names the release.
_REMOVED_FIELDS = {
    "interval": (1, "was deprecated in TE 2.0 and removed in TE 2.2 (the scale is updated every step: only interval=1)"),
    "override_linear_precision": ((False, False, False), "was removed in TE 2.0 (every GEMM of a linear runs in FP8: only "
                                  "(False, False, False), no GEMM in high precision)"),
}


@functools.lru_cache(maxsize=None)
def _warn_ignored(recipe: str, names: Tuple[str, ...]) -> None:
    warnings.warn(f"{recipe} ignores the arguments {list(names)}: they are not fields of the recipe (NVIDIA TE's "
                  "recipes drop unknown arguments too); check their spelling", UserWarning, stacklevel=3)


def _recipe(cls):
    """``@dataclass(frozen=True)`` for a recipe, whose ``__init__`` also takes keyword arguments that are no
    field of it, as NVIDIA TE's (pydantic) recipes do (Megatron-Core's ``TEDelayedScaling`` passes its
    module arguments ``params_dtype`` / ``device`` on to ``super().__init__``):

    - a removed field given the value every recipe honours is dropped; any other value is a TypeError;
    - any other unknown argument is dropped with a warning that names it (once per class and names).
    """
    cls = dataclass(frozen=True)(cls)
    init = cls.__init__
    fields = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name, (honoured, why) in _REMOVED_FIELDS.items():
            if name in kwargs:
                value = kwargs.pop(name)
                if (tuple(value) if isinstance(value, (tuple, list)) else value) != honoured:
                    raise TypeError(f"{cls.__name__}: the argument {name}={value!r} {why}; remove it from the call")
        unknown = tuple(sorted(name for name in kwargs if name not in fields))
        if unknown:
            _warn_ignored(cls.__name__, unknown)
            for name in unknown:
                del kwargs[name]
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


class _FormatHelper(NamedTuple):
    """Largest finite values of the forward and backward FP8/FP4 formats of a :class:`Format`."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 / FP4 formats; each value holds (max_fwd, max_bwd).

    E4M3: every tensor in E4M3 (max 448). E5M2: every tensor in E5M2 (max 57344; not a training
    format, rejected by every recipe). HYBRID: E4M3 forward (input, weight, output), E5M2 backward
    (grad output, grad input). E2M1: FP4 (max 6), used by NVFP4.
    """

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclass(frozen=True)
class MMParams:
    """GEMM settings: ``use_split_accumulator`` asks Hopper FP8 GEMMs for the exact accumulation."""

    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    """Quantization settings of one tensor role (current and block scaling, NVFP4).

    scale = fp8_max / max(amax, amax_epsilon), rounded down to a power of two if ``power_2_scale``.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


# The NVTE_* defaults below are declared in transformer_engine.common.env (type, default, meaning) and read
# when a recipe is made, by NVIDIA TE's rules: a switch (read_switch) is on exactly when it is "1"; a choice
# (read_choice: the value as set, else the declared default) is checked by __post_init__.
def _env_backward_override() -> Optional[str]:
    return read_choice("NVTE_BACKWARD_OVERRIDE") or None


def _fail(cls_name: str, message: str, exc: type = ValueError):
    raise exc(f"{cls_name}: {message}")


def _check_type(obj: Any, name: str, types, what: str) -> None:
    value = getattr(obj, name)
    bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    if bad_bool or not isinstance(value, types):
        _fail(type(obj).__name__, f"{name} must be {what}, got {value!r} ({type(value).__name__})", TypeError)


def _check_choice(obj: Any, name: str, choices) -> None:
    value = getattr(obj, name)
    if value not in choices:
        _fail(type(obj).__name__, f"{name} must be one of {list(choices)}, got {value!r}")


class Recipe:
    """Base class of the recipes; the classmethod predicates tell recipes apart.

    Raises:
        TypeError: for a field that NVIDIA TE removed (``interval``, ``override_linear_precision``) given
            another value than the one every recipe honours (1, (False, False, False)).
    """

    @classmethod
    def nvfp4(cls) -> bool:
        """True for :class:`NVFP4BlockScaling`."""
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        """True for :class:`MXFP8BlockScaling`."""
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def delayed(cls) -> bool:
        """True for :class:`DelayedScaling`."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """True for :class:`Float8CurrentScaling`."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """True for the per-tensor FP8 recipes (delayed and current scaling)."""
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """True for :class:`Float8BlockScaling`."""
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        """True for :class:`CustomRecipe`."""
        return issubclass(cls, CustomRecipe)

    def _check_common(self, formats) -> None:
        """Validate ``fp8_format``, ``fp8_dpa``/``fp8_mha`` and ``backward_override``."""
        _check_type(self, "fp8_format", Format, "a transformer_engine.common.recipe.Format")
        if self.fp8_format == Format.E5M2:
            _fail(type(self).__name__, "Pure E5M2 training is not supported; use Format.HYBRID or Format.E4M3")
        _check_choice(self, "fp8_format", formats)
        for name in ("fp8_dpa", "fp8_mha"):
            _check_type(self, name, bool, "a bool")
        _check_choice(self, "backward_override", _BACKWARD_OVERRIDES)


@_recipe
class DelayedScaling(Recipe):
    """Per-tensor FP8 scaling from the amax history of earlier iterations (TE's default recipe).

    At each update: amax = max(amax_history) ("max"), amax_history[0] ("most_recent"), or
    ``amax_compute_algo(history)``; scale = (fp8_max / amax) / 2^margin, or
    ``scaling_factor_compute_algo(amax, scale, fp8_max, recipe)``.

    Args:
        margin: the scale is divided by 2^margin (headroom against overflow); int >= 0.
        fp8_format: ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) or ``Format.E4M3``.
        amax_history_len: rows of the amax history window; int >= 1.
        amax_compute_algo: "max", "most_recent", or a callable(history [L, N]) -> amax [N].
        scaling_factor_compute_algo: None or a callable(amax, scale, fp8_max, recipe) -> scale.
        reduce_amax: MAX-reduce the amaxes over the autocast's ``amax_reduction_group``.
        fp8_dpa: FP8 dot-product attention (PyTorch: ``DotProductAttention`` computes in FP8, see its docstring; JAX's
            ``te.autocast`` refuses it); fp8_mha: FP8 across the attention's boundaries (implies fp8_dpa), not
            implemented: ``te.autocast`` refuses it.
        backward_override: must be None for delayed scaling.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def __post_init__(self):
        self._check_common((Format.HYBRID, Format.E4M3))
        _check_type(self, "margin", int, "an int >= 0")
        if self.margin < 0:
            _fail("DelayedScaling", f"margin must be >= 0, got {self.margin}")
        _check_type(self, "amax_history_len", int, "an int >= 1")
        if self.amax_history_len < 1:
            _fail("DelayedScaling", f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if not callable(self.amax_compute_algo):
            _check_choice(self, "amax_compute_algo", ("max", "most_recent"))
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            _fail("DelayedScaling", "scaling_factor_compute_algo must be None or a callable", TypeError)
        _check_type(self, "reduce_amax", bool, "a bool")
        if self.backward_override is not None:
            _fail("DelayedScaling", f"backward_override={self.backward_override!r} is not supported with "
                  "delayed scaling; unset NVTE_BACKWARD_OVERRIDE or use Float8CurrentScaling")


@_recipe
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 scaling computed from each tensor when it is cast ("just in time").

    scale = fp8_max / max(amax, amax_epsilon) (1 if amax is 0, inf or NaN; an infinite scale becomes
    float32 max), rounded down to 2^k when ``use_power_2_scales``.

    Args:
        use_power_2_scales: power-of-two scales (env ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``).
        fp8_format: ``Format.HYBRID`` or ``Format.E4M3``.
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: :class:`MMParams` of the three GEMMs.
        fp8_dpa, fp8_mha: FP8 attention switches (not implemented with this recipe yet: ``te.autocast`` refuses them;
            ``DelayedScaling(fp8_dpa=True)`` runs FP8 attention).
        backward_override: None, "high_precision" or "dequantized" (env ``NVTE_BACKWARD_OVERRIDE``).
    """

    use_power_2_scales: bool = field(default_factory=lambda: read_switch("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"))
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    fp8_quant_fwd_inp = QParams(power_2_scale=False, amax_epsilon=0.0)
    fp8_quant_fwd_weight = QParams(power_2_scale=False, amax_epsilon=0.0)
    fp8_quant_bwd_grad = QParams(power_2_scale=False, amax_epsilon=0.0)

    def __post_init__(self):
        self._check_common((Format.HYBRID, Format.E4M3))
        _check_type(self, "use_power_2_scales", bool, "a bool")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            _check_type(self, name, MMParams, "an MMParams")


@_recipe
class MXFP8BlockScaling(Recipe):
    """MXFP8: blocks of 32 consecutive elements share one E8M0 (power-of-two) scale.

    scale_inv = 2^ceil(log2(amax_block / fp8_max)); row-wise and column-wise copies are each
    quantized from the high-precision tensor.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    enable_2d_quantization: bool = False

    def __post_init__(self):
        self._check_common((Format.E4M3, Format.HYBRID))
        _check_type(self, "margin", int, "an int >= 0")
        _check_type(self, "enable_2d_quantization", bool, "a bool")


@_recipe
class Float8BlockScaling(Recipe):
    """DeepSeek-style block FP8: 1x128 tiles (dim 1) or 128x128 tiles (dim 2), FP32 scales.

    Scales are powers of two unless ``use_f32_scales`` (env ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``).
    The two operands of one GEMM cannot both use 2-D tiles; every GEMM uses split accumulation.
    """

    use_f32_scales: bool = field(default_factory=lambda: read_switch("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def __post_init__(self):
        self._check_common((Format.E4M3, Format.HYBRID))
        _check_type(self, "use_f32_scales", bool, "a bool")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_choice(self, name, (1, 2))
        if self.x_block_scaling_dim == 2 and self.w_block_scaling_dim == 2:
            _fail("Float8BlockScaling", "x and w cannot both use 2-D (128x128) blocks: one operand of a GEMM must be 1-D")
        if self.grad_block_scaling_dim == 2 and 2 in (self.x_block_scaling_dim, self.w_block_scaling_dim):
            _fail("Float8BlockScaling", "grad cannot use 2-D blocks when x or w does: one operand of a GEMM must be 1-D")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if getattr(self, name) != MMParams(use_split_accumulator=True):
                _fail("Float8BlockScaling", f"{name} must be MMParams(use_split_accumulator=True)")
        if self.fp8_dpa or self.fp8_mha:
            _fail("Float8BlockScaling", "fp8_dpa and fp8_mha are not supported with block scaling")

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        return QParams(power_2_scale=not self.use_f32_scales)

    @property
    def fp8_quant_fwd_weight(self) -> QParams:
        return QParams(power_2_scale=not self.use_f32_scales)

    @property
    def fp8_quant_bwd_grad(self) -> QParams:
        return QParams(power_2_scale=not self.use_f32_scales)


@_recipe
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 data in blocks of 16 elements, each with an E4M3 scale, plus an FP32 global scale.

    global_encode = (448 * 6) / global_amax; block decode scale = e4m3(block_amax / 6 * global_encode).
    Inputs use the random Hadamard transform (column-wise only), weights 16x16 2-D quantization,
    gradients RHT and stochastic rounding, unless disabled (env ``NVTE_NVFP4_DISABLE_*``).
    ``nvfp4_4over6_e4m3_use_256`` picks, among the tensors ``nvfp4_4over6`` selects, those whose global scale
    uses the bound 256 instead of 448 (NVIDIA TE's default: all of them); it means nothing without 4over6.
    """

    disable_rht: bool = field(default_factory=lambda: read_switch("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(
        default_factory=lambda: read_switch("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    disable_2d_quantization: bool = field(default_factory=lambda: read_switch("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    row_scaled_activation: bool = field(default_factory=lambda: read_switch("NVTE_NVFP4_ROW_SCALED_ACTIVATION"))
    nvfp4_4over6: str = field(default_factory=lambda: read_choice("NVTE_NVFP4_4OVER6"))
    nvfp4_4over6_e4m3_use_256: str = field(default_factory=lambda: read_choice("NVTE_NVFP4_4OVER6_E4M3_USE_256"))
    nvfp4_4over6_err_mode: str = field(default_factory=lambda: read_choice("NVTE_NVFP4_4OVER6_ERR_MODE"))
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def __post_init__(self):
        self._check_common((Format.E4M3,))
        if self.fp4_format != Format.E2M1:
            _fail("NVFP4BlockScaling", f"fp4_format must be Format.E2M1, got {self.fp4_format!r}")
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "row_scaled_activation"):
            _check_type(self, name, bool, "a bool")
        _check_choice(self, "nvfp4_4over6", _NVFP4_4OVER6_TARGETS)
        _check_choice(self, "nvfp4_4over6_e4m3_use_256", _NVFP4_4OVER6_TARGETS)
        _check_choice(self, "nvfp4_4over6_err_mode", _NVFP4_4OVER6_ERR_MODES)
        if self.nvfp4_4over6 != "none" and read_switch("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH"):
            warnings.warn("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH=1 is not implemented in TransformerEngine-FL: 4over6 picks each "
                          "block's candidate by the float32 error (NVIDIA TE's default), not TE's fp16 fast-math one", stacklevel=3)
        if self.fp8_dpa or self.fp8_mha:
            _fail("NVFP4BlockScaling", "fp8_dpa and fp8_mha are not supported with NVFP4")

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        return QParams(random_hadamard_transform=not self.disable_rht)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        return QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        return QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )


@_recipe
class CustomRecipe(Recipe):
    """Experimental: ``qfactory(role)`` returns the quantizer (or request) of each tensor role."""

    qfactory: Optional[Callable] = None
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    quantization_alignment: int = 128

    def __post_init__(self):
        self._check_common((Format.HYBRID, Format.E4M3))
        if not callable(self.qfactory):
            _fail("CustomRecipe", "qfactory must be a callable(role) -> quantizer", TypeError)

