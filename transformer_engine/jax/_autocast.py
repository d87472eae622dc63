"""The FP8 autocast context: which recipe is active, what it means for JAX, and the state collection.

``autocast(enabled=True, recipe=...)`` sets a module-global recipe that the Flax modules read when
they are *traced* (``init``, ``apply``, and ``jax.jit`` tracing must all run inside the context).
The recipe is translated once into a frozen :class:`QuantizeConfig` (scaling mode, FP8 dtypes of the
forward and backward tensors, margin, history length, ...), which the quantizers carry as static data.

Recipes the JAX path runs (``Format.HYBRID`` = e4m3 forward, e5m2 gradients; ``Format.E4M3`` = e4m3
everywhere):

    DelayedScaling        per-tensor scale from the amax history (state in the "fp8_metas" collection)
    Float8CurrentScaling  per-tensor scale from the tensor being cast (no state)
    MXFP8BlockScaling     1x32 blocks with power-of-two scales, emulated (dequantize, then a wide dot)

Float8BlockScaling, NVFP4BlockScaling and CustomRecipe are refused with an error naming the recipe.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import jax.numpy as jnp
from flax.core.frozen_dict import FrozenDict

from transformer_engine.common import recipe as _recipe

from .sharding import MeshResource, global_shard_guard

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "ScalingMode",
    "QuantizeConfig",
    "autocast",
    "fp8_autocast",
    "update_collections",
    "get_global_quantize_recipe",
    "get_global_quantize_config",
    "get_quantize_config_with_recipe",
    "is_scaling_mode_supported",
    "get_supported_quantization_recipes",
    "get_quantization_recipe",
]

NVTE_FP8_COLLECTION_NAME = "fp8_metas"

# The JAX dtypes of each recipe format: (forward tensors x and kernel, backward tensor grad).
_FORMAT_DTYPES = {
    _recipe.Format.E4M3: (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    _recipe.Format.HYBRID: (jnp.float8_e4m3fn, jnp.float8_e5m2),
}


class ScalingMode(Enum):
    """How a tensor is scaled before the FP8 cast (values follow TE's JAX enum)."""

    NO_SCALING = 0
    DELAYED_TENSOR_SCALING = 1
    MXFP8_1D_SCALING = 2
    CURRENT_TENSOR_SCALING = 3
    NVFP4_1D_SCALING = 4
    NVFP4_2D_SCALING = 5


@dataclass(frozen=True)
class QuantizeConfig:
    """What a recipe means for the JAX quantizers (hashable: it is static pytree data).

    Attributes:
        scaling_mode: the :class:`ScalingMode`.
        fwd_dtype: FP8 dtype of x and kernel; bwd_dtype: FP8 dtype of the output gradient.
        margin: delayed scaling divides the scale by 2**margin.
        amax_history_len: rows of the delayed-scaling amax history.
        amax_compute_algo: "max" (max over the history) or "most_recent" (history[0]).
        power_2_scale: current scaling rounds the scale down to a power of two.
        amax_epsilon: current scaling uses max(amax, amax_epsilon).
        block_size: MXFP8 block length (32 consecutive elements along the contraction axis).
    """

    scaling_mode: ScalingMode
    fwd_dtype: type = jnp.float8_e4m3fn
    bwd_dtype: type = jnp.float8_e5m2
    margin: float = 0.0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    block_size: int = 32


def _refuse(recipe, why: str) -> None:
    raise NotImplementedError(
        f"{type(recipe).__name__} {why} on the JAX path; use DelayedScaling, Float8CurrentScaling "
        "or MXFP8BlockScaling from transformer_engine.common.recipe"
    )


def _check_common(recipe) -> tuple:
    if recipe.fp8_dpa or recipe.fp8_mha:
        _refuse(recipe, f"with fp8_dpa={recipe.fp8_dpa}, fp8_mha={recipe.fp8_mha} (FP8 attention) is not supported")
    if recipe.backward_override is not None:
        _refuse(recipe, f"with backward_override={recipe.backward_override!r} is not supported")
    return _FORMAT_DTYPES[recipe.fp8_format]


def _delayed_config(recipe) -> QuantizeConfig:
    if recipe.amax_compute_algo not in ("max", "most_recent"):
        _refuse(recipe, f"with amax_compute_algo={recipe.amax_compute_algo!r} (a callable) is not supported")
    if recipe.scaling_factor_compute_algo is not None:
        _refuse(recipe, "with a custom scaling_factor_compute_algo is not supported (it must be None)")
    if not recipe.reduce_amax:
        _refuse(recipe, "with reduce_amax=False is not supported (the amax is always global under jit)")
    fwd, bwd = _check_common(recipe)
    return QuantizeConfig(
        ScalingMode.DELAYED_TENSOR_SCALING, fwd, bwd, margin=float(recipe.margin),
        amax_history_len=recipe.amax_history_len, amax_compute_algo=recipe.amax_compute_algo,
    )


def _current_config(recipe) -> QuantizeConfig:
    fwd, bwd = _check_common(recipe)
    qparams = recipe.fp8_quant_fwd_inp
    return QuantizeConfig(
        ScalingMode.CURRENT_TENSOR_SCALING, fwd, bwd,
        power_2_scale=bool(recipe.use_power_2_scales or qparams.power_2_scale),
        amax_epsilon=float(qparams.amax_epsilon),
    )


def _mxfp8_config(recipe) -> QuantizeConfig:
    if recipe.enable_2d_quantization:
        _refuse(recipe, "with enable_2d_quantization=True is not supported")
    fwd, bwd = _check_common(recipe)
    return QuantizeConfig(ScalingMode.MXFP8_1D_SCALING, fwd, bwd)


_CONFIG_BUILDERS = (
    (_recipe.DelayedScaling, _delayed_config),
    (_recipe.Float8CurrentScaling, _current_config),
    (_recipe.MXFP8BlockScaling, _mxfp8_config),
)


def get_quantize_config_with_recipe(recipe) -> QuantizeConfig:
    """Translate a recipe into the :class:`QuantizeConfig` of the JAX quantizers.

    Raises:
        TypeError: ``recipe`` is not a ``transformer_engine.common.recipe.Recipe``.
        NotImplementedError: the recipe (or one of its settings) has no JAX implementation.

    Example:
        >>> from transformer_engine.common.recipe import DelayedScaling
        >>> get_quantize_config_with_recipe(DelayedScaling(amax_history_len=16)).amax_history_len
        16
    """
    if not isinstance(recipe, _recipe.Recipe):
        raise TypeError(
            f"recipe must be a transformer_engine.common.recipe.Recipe, got {type(recipe).__name__}: "
            "pass e.g. recipe=DelayedScaling()"
        )
    for cls, build in _CONFIG_BUILDERS:
        if isinstance(recipe, cls):
            return build(recipe)
    _refuse(recipe, "is not implemented")


@dataclass(frozen=True)
class _AutocastState:
    recipe: Optional[_recipe.Recipe] = None
    config: Optional[QuantizeConfig] = None


_STATE = _AutocastState()


@contextmanager
def autocast(enabled: bool = False, recipe=None, mesh_resource: Optional[MeshResource] = None):
    """Run the enclosed tracing with FP8 (``enabled=True``) and/or a ``MeshResource``.

    ``recipe=None`` means ``DelayedScaling()``. Inside ``enabled=False`` FP8 is off, even when an
    outer context enabled it. The previous recipe and mesh resource are restored on exit.

    Args:
        enabled: quantize the GEMMs of the TE modules traced inside.
        recipe: a recipe from ``transformer_engine.common.recipe``.
        mesh_resource: roles of the mesh axes for sharded runs (see :class:`MeshResource`).

    Raises:
        TypeError / NotImplementedError: the recipe cannot run on the JAX path (only when enabled).

    Example:
        >>> with autocast(enabled=True):
        ...     type(get_global_quantize_recipe()).__name__
        'DelayedScaling'
    """
    global _STATE
    recipe = _recipe.DelayedScaling() if recipe is None else recipe
    new_state = _AutocastState(recipe, get_quantize_config_with_recipe(recipe)) if enabled else _AutocastState()
    previous = _STATE
    with global_shard_guard(mesh_resource):
        _STATE = new_state
        try:
            yield
        finally:
            _STATE = previous


@contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe=None, mesh_resource: Optional[MeshResource] = None):
    """Deprecated alias of :func:`autocast` (``fp8_recipe`` is ``recipe``)."""
    warnings.warn(
        "fp8_autocast is deprecated; use transformer_engine.jax.autocast(enabled=..., recipe=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield


def get_global_quantize_recipe():
    """The recipe of the innermost enabled autocast, or None when FP8 is off."""
    return _STATE.recipe


def get_global_quantize_config() -> Optional[QuantizeConfig]:
    """The :class:`QuantizeConfig` of the active recipe, or None when FP8 is off."""
    return _STATE.config


def update_collections(new, original):
    """Shallow merge of Flax variable collections: keys of ``new`` replace those of ``original``.

    The result has the container type of ``original`` (dict or FrozenDict).

    Raises:
        TypeError: either argument is not a dict or FrozenDict.

    Example:
        >>> update_collections({"fp8_metas": 1}, {"params": 0, "fp8_metas": 0})
        {'params': 0, 'fp8_metas': 1}
    """
    for name, value in (("new", new), ("original", original)):
        if not isinstance(value, (dict, FrozenDict)):
            raise TypeError(f"update_collections: {name} must be a dict or FrozenDict, got {type(value).__name__}")
    merged = {**dict(original), **dict(new)}
    return FrozenDict(merged) if isinstance(original, FrozenDict) else merged


def is_scaling_mode_supported(scaling_mode: ScalingMode, gpu_id=None) -> tuple:
    """Whether this package can run ``scaling_mode``: ``(supported, reason)``.

    Tensor scaling runs everywhere (XLA emulates FP8 dots where the hardware has none; on Hopper and
    later it emits cuBLASLt FP8 GEMMs); MXFP8 is emulated; NVFP4 is not implemented.
    """
    del gpu_id  # the answer does not depend on the device: unsupported hardware is emulated
    if scaling_mode in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING):
        return False, f"{scaling_mode.name} is not implemented on the JAX path"
    return True, ""


_SUPPORTED_RECIPES = (_recipe.DelayedScaling, _recipe.Float8CurrentScaling, _recipe.MXFP8BlockScaling)


def get_supported_quantization_recipes() -> list:
    """One default instance of each recipe the JAX path runs."""
    return [cls() for cls in _SUPPORTED_RECIPES]


def get_quantization_recipe(name: str):
    """A default recipe by class name (case-insensitive), e.g. ``"DelayedScaling"``.

    Raises:
        ValueError: no supported recipe has that name.
    """
    for cls in _SUPPORTED_RECIPES:
        if cls.__name__.lower() == str(name).lower():
            return cls()
    raise ValueError(
        f"unknown quantization recipe {name!r}: choose one of {[c.__name__ for c in _SUPPORTED_RECIPES]}"
    )
