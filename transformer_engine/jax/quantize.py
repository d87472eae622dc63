"""FP8 quantization in plain JAX: the scaling pipeline, quantizers and the scaled GEMM.

Delayed scaling of one tensor x (all in float32; fp8_max is 448 for e4m3fn, 57344 for e5m2):

    x_fp8      = clip(x * scale, -fp8_max, fp8_max).astype(fp8)     (without the clip, 500 -> NaN in e4m3fn)
    scale_inv  = 1 / scale
    history[0] = amax = max|x|;   a = max(history) ("max") or history[0] ("most_recent")
    scale'     = fp8_max / a / 2**margin       (the old scale is kept when a <= 0 or a is not finite)
    history'   = roll(history, -1) with history'[0] = 0

so the scale used at step t was computed at step t-1. Current scaling uses
scale = fp8_max / max(amax, amax_epsilon) of the tensor itself (1 when amax is 0 or not finite).
MXFP8 (emulated) gives each block of 32 elements along the contraction axis its own power-of-two
scale_inv = 2**ceil(log2(block_amax / fp8_max)).

The GEMM on two tensor-scaled operands is the pattern XLA rewrites into a cuBLASLt FP8 GEMM on
Hopper and later (and emulates in float32 on CPU):

    y = dot_general(a_fp8, b_fp8, preferred_element_type=float32) * (a_scale_inv * b_scale_inv)

Quantizers are pytrees whose leaves are the delayed-scaling state (scale, amax_history): they enter
each GEMM's ``custom_vjp`` as a differentiable argument and the backward rule returns the *updated*
quantizers as their cotangent, so ``jax.grad`` hands back the next state (see ``dense``).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ._autocast import (
    NVTE_FP8_COLLECTION_NAME,
    QuantizeConfig,
    ScalingMode,
    autocast,
    fp8_autocast,
    get_global_quantize_config,
    get_global_quantize_recipe,
    get_quantization_recipe,
    get_quantize_config_with_recipe,
    get_supported_quantization_recipes,
    is_scaling_mode_supported,
    update_collections,
)

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "ScalingMode",
    "QuantizeConfig",
    "TensorSource",
    "QuantizeMeta",
    "QuantizeMetaSet",
    "ScaledTensor",
    "Quantizer",
    "QuantizerSet",
    "QuantizerFactory",
    "noop_quantizer_set",
    "autocast",
    "fp8_autocast",
    "update_collections",
    "get_global_quantize_recipe",
    "get_global_quantize_config",
    "get_quantize_config_with_recipe",
    "get_quantization_recipe",
    "get_supported_quantization_recipes",
    "is_scaling_mode_supported",
    "compute_amax",
    "cast_to_fp8",
    "scale_from_amax_history",
    "roll_amax_history",
    "current_scale",
    "mxfp8_scale_inv",
    "scaled_dot_general",
]

_F32 = jnp.float32
_F32_MAX = float(jnp.finfo(jnp.float32).max)


class TensorSource(Enum):
    """The three tensors of a GEMM that get quantized: input, weight, output gradient."""

    X = 0
    KERNEL = 1
    DGRAD = 2


class QuantizeMeta(NamedTuple):
    """Delayed-scaling state of one tensor: ``scale`` (1,) and ``amax_history`` (L,), float32."""

    scale: jax.Array
    amax_history: jax.Array

    @classmethod
    def initial(cls, amax_history_len: int) -> "QuantizeMeta":
        """scale = 1, history = zeros (TE's initial state)."""
        return cls(jnp.ones((1,), _F32), jnp.zeros((amax_history_len,), _F32))


class QuantizeMetaSet(NamedTuple):
    """Delayed-scaling state of the three tensors of one GEMM."""

    x: Optional[QuantizeMeta]
    kernel: Optional[QuantizeMeta]
    grad: Optional[QuantizeMeta]


# ---------------------------------------------------------------------------------------------
# The scaling pipeline: small pure functions, each one formula.
# ---------------------------------------------------------------------------------------------


def _fp8_max(q_dtype) -> float:
    return float(jnp.finfo(q_dtype).max)


def compute_amax(x: jax.Array) -> jax.Array:
    """amax = max|x| as a float32 array of shape (1,)."""
    return jnp.max(jnp.abs(x.astype(_F32))).reshape(1)


def cast_to_fp8(x: jax.Array, scale: jax.Array, q_dtype) -> jax.Array:
    """Saturating cast: clip(x * scale, -fp8_max, fp8_max).astype(q_dtype)."""
    limit = _fp8_max(q_dtype)
    return jnp.clip(x.astype(_F32) * scale.astype(_F32), -limit, limit).astype(q_dtype)


def _finite_scale(scale: jax.Array) -> jax.Array:
    return jnp.minimum(scale, _F32_MAX)  # a denormal amax would otherwise give an infinite scale


def scale_from_amax_history(history: jax.Array, scale: jax.Array, q_dtype, config: QuantizeConfig) -> jax.Array:
    """scale' = fp8_max / a / 2**margin, a = max(history) or history[0]; old scale if a <= 0 or not finite."""
    amax = history[:1] if config.amax_compute_algo == "most_recent" else jnp.max(history, keepdims=True)
    new_scale = _finite_scale(_fp8_max(q_dtype) / amax / (2.0**config.margin))
    return jnp.where((amax > 0.0) & jnp.isfinite(amax), new_scale, scale)


def roll_amax_history(history: jax.Array) -> jax.Array:
    """history' = roll(history, -1) with history'[0] = 0 (the slot for the next amax)."""
    return jnp.roll(history, -1).at[0].set(0.0)


def current_scale(amax: jax.Array, q_dtype, config: QuantizeConfig) -> jax.Array:
    """scale = fp8_max / max(amax, eps) (1 if that is 0 or not finite), optionally 2**floor(log2(.))."""
    amax = jnp.maximum(amax, config.amax_epsilon)
    scale = _finite_scale(_fp8_max(q_dtype) / amax)
    scale = jnp.where((amax > 0.0) & jnp.isfinite(amax), scale, 1.0)
    return jnp.exp2(jnp.floor(jnp.log2(scale))) if config.power_2_scale else scale


def mxfp8_scale_inv(block_amax: jax.Array, q_dtype) -> jax.Array:
    """E8M0 block scale: scale_inv = 2**ceil(log2(block_amax / fp8_max)), 1 for empty blocks."""
    exponent = jnp.ceil(jnp.log2(block_amax / _fp8_max(q_dtype)))
    exponent = jnp.where((block_amax > 0.0) & jnp.isfinite(block_amax), exponent, 0.0)
    return jnp.exp2(jnp.clip(exponent, -127.0, 127.0))


# ---------------------------------------------------------------------------------------------
# Scaled tensors and quantizers (pytrees).
# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class ScaledTensor:
    """FP8 ``data`` with its ``scale_inv``: x ~= data * scale_inv.

    ``block_axis`` None means one tensor-wide scale_inv (shape (1,)); otherwise ``scale_inv`` has
    ``data.shape`` with ``block_axis`` divided by ``block_size`` (one scale per block).
    ``dq_dtype`` is the dtype of the tensor before quantization.
    """

    def __init__(self, data, scale_inv, dq_dtype, block_axis=None, block_size=32):
        self.data, self.scale_inv = data, scale_inv
        self.dq_dtype, self.block_axis, self.block_size = dq_dtype, block_axis, block_size

    def tree_flatten(self):
        return (self.data, self.scale_inv), (self.dq_dtype, self.block_axis, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def dequantize(self, dtype=None) -> jax.Array:
        """x = data * scale_inv (per block when block-scaled), in ``dtype`` (default dq_dtype)."""
        dtype = self.dq_dtype if dtype is None else dtype
        data = self.data.astype(_F32)
        if self.block_axis is None:
            return (data * self.scale_inv.reshape(())).astype(dtype)
        axis, shape = self.block_axis, self.data.shape
        blocks = data.reshape(shape[:axis] + (shape[axis] // self.block_size, self.block_size) + shape[axis + 1 :])
        return (blocks * jnp.expand_dims(self.scale_inv, axis + 1)).reshape(shape).astype(dtype)


def _mxfp8_quantize(x: jax.Array, axis: int, q_dtype, block: int) -> ScaledTensor:
    n = x.shape[axis]
    if n % block:
        raise ValueError(
            f"MXFP8 quantizes blocks of {block} along axis {axis} of a tensor of shape {x.shape}, "
            f"but that axis has {n} elements: use sizes divisible by {block} or another recipe"
        )
    blocks = x.astype(_F32).reshape(x.shape[:axis] + (n // block, block) + x.shape[axis + 1 :])
    scale_inv = mxfp8_scale_inv(jnp.max(jnp.abs(blocks), axis=axis + 1), q_dtype)
    data = cast_to_fp8(blocks, 1.0 / jnp.expand_dims(scale_inv, axis + 1), q_dtype).reshape(x.shape)
    return ScaledTensor(data, scale_inv, x.dtype, axis, block)


@jax.tree_util.register_pytree_node_class
class Quantizer:
    """Quantizes one tensor role of a GEMM under one :class:`QuantizeConfig`.

    Leaves: ``meta`` (a :class:`QuantizeMeta` for delayed scaling, else None). Static: ``config``
    and ``q_dtype``.
    """

    def __init__(self, config: QuantizeConfig, q_dtype, meta: Optional[QuantizeMeta] = None):
        self.config, self.q_dtype, self.meta = config, q_dtype, meta

    def tree_flatten(self):
        return (self.meta,), (self.config, self.q_dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], aux[1], children[0])

    def quantize(self, x: jax.Array, block_axes: Sequence[Optional[int]]):
        """Quantize ``x`` once per entry of ``block_axes`` (the contraction axis of each use).

        Tensor scaling returns the same ScaledTensor for every entry; MXFP8 quantizes along each.

        Returns:
            (tuple of ScaledTensor, the updated Quantizer: new scale and history for delayed scaling)
        """
        return _QUANTIZE[self.config.scaling_mode](self, x, tuple(block_axes))


def _quantize_delayed(q: Quantizer, x, block_axes):
    scale, history = q.meta
    tensor = ScaledTensor(cast_to_fp8(x, scale, q.q_dtype), 1.0 / scale, x.dtype)
    history = history.at[0].set(compute_amax(x)[0])
    new_scale = scale_from_amax_history(history, scale, q.q_dtype, q.config)
    new_meta = QuantizeMeta(new_scale, roll_amax_history(history))
    return (tensor,) * len(block_axes), Quantizer(q.config, q.q_dtype, new_meta)


def _quantize_current(q: Quantizer, x, block_axes):
    scale = current_scale(compute_amax(x), q.q_dtype, q.config)
    tensor = ScaledTensor(cast_to_fp8(x, scale, q.q_dtype), 1.0 / scale, x.dtype)
    return (tensor,) * len(block_axes), q


def _quantize_mxfp8(q: Quantizer, x, block_axes):
    if None in block_axes:
        raise ValueError(f"MXFP8 needs a block axis for every use of a tensor of shape {x.shape}: "
                         "a GEMM operand must keep at least one non-contracted axis")
    tensors = tuple(_mxfp8_quantize(x, a % x.ndim, q.q_dtype, q.config.block_size) for a in block_axes)
    return tensors, q


_QUANTIZE = {
    ScalingMode.DELAYED_TENSOR_SCALING: _quantize_delayed,
    ScalingMode.CURRENT_TENSOR_SCALING: _quantize_current,
    ScalingMode.MXFP8_1D_SCALING: _quantize_mxfp8,
}


class QuantizerSet(NamedTuple):
    """The quantizers of one GEMM: input ``x``, weight ``kernel``, output gradient ``dgrad``."""

    x: Optional[Quantizer]
    kernel: Optional[Quantizer]
    dgrad: Optional[Quantizer]


noop_quantizer_set = QuantizerSet(None, None, None)


def _resolve_config(recipe) -> Optional[QuantizeConfig]:
    return get_global_quantize_config() if recipe is None else get_quantize_config_with_recipe(recipe)


class QuantizerFactory:
    """Builds quantizer sets from a recipe (None = the recipe of the active autocast)."""

    @staticmethod
    def create_meta_set(recipe=None) -> Optional[QuantizeMetaSet]:
        """Initial delayed-scaling state for one GEMM, or None when the recipe keeps no state."""
        config = _resolve_config(recipe)
        if config is None or config.scaling_mode != ScalingMode.DELAYED_TENSOR_SCALING:
            return None
        return QuantizeMetaSet(*(QuantizeMeta.initial(config.amax_history_len) for _ in range(3)))

    @staticmethod
    def create_set(recipe=None, meta_set: Optional[QuantizeMetaSet] = None) -> QuantizerSet:
        """The :class:`QuantizerSet` of one GEMM; ``noop_quantizer_set`` when FP8 is off.

        Raises:
            ValueError: delayed scaling without ``meta_set`` (its state must come from somewhere).

        Example:
            >>> from transformer_engine.common.recipe import Float8CurrentScaling
            >>> qs = QuantizerFactory.create_set(Float8CurrentScaling())
            >>> qs.dgrad.q_dtype.__name__
            'float8_e5m2'
        """
        config = _resolve_config(recipe)
        if config is None:
            return noop_quantizer_set
        if config.scaling_mode == ScalingMode.DELAYED_TENSOR_SCALING and meta_set is None:
            raise ValueError(
                "delayed scaling keeps state: pass meta_set=QuantizerFactory.create_meta_set(recipe) "
                "and feed back the state that jax.grad returns for it"
            )
        metas = meta_set if meta_set is not None else QuantizeMetaSet(None, None, None)
        return QuantizerSet(
            Quantizer(config, config.fwd_dtype, metas.x),
            Quantizer(config, config.fwd_dtype, metas.kernel),
            Quantizer(config, config.bwd_dtype, metas.grad),
        )


def scaled_dot_general(lhs: ScaledTensor, rhs: ScaledTensor, dimension_numbers, out_dtype) -> jax.Array:
    """dot_general of two quantized operands, returned in ``out_dtype``.

    Tensor-scaled: dot(lhs_fp8, rhs_fp8) in float32 times lhs_scale_inv * rhs_scale_inv (an FP8
    GEMM on Hopper+). Block-scaled (MXFP8, emulated): dequantize both, then a float32 dot.
    """
    if lhs.block_axis is None and rhs.block_axis is None:
        out = lax.dot_general(lhs.data, rhs.data, dimension_numbers, preferred_element_type=_F32)
        return (out * (lhs.scale_inv * rhs.scale_inv).reshape(())).astype(out_dtype)
    out = lax.dot_general(
        lhs.dequantize(_F32), rhs.dequantize(_F32), dimension_numbers,
        precision=lax.Precision.HIGHEST, preferred_element_type=_F32,
    )
    return out.astype(out_dtype)
