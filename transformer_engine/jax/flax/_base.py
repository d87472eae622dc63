"""Pieces shared by the Flax modules: parameters with logical axes, FP8 state variables, checks.

FP8 state (delayed scaling only) lives in the ``"fp8_metas"`` collection, per GEMM:
``{x,kernel,grad}{postfix}_scale`` (shape (1,), ones) and ``{x,kernel,grad}{postfix}_amax_history``
(shape (amax_history_len,), zeros). The module passes them into the GEMM's quantizer set; the
gradient of the loss w.r.t. these variables *is* their next value (see ``transformer_engine.jax.dense``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..quantize import NVTE_FP8_COLLECTION_NAME, QuantizeMeta, QuantizeMetaSet, QuantizerFactory, QuantizerSet

__all__: list = []  # private helpers of transformer_engine.jax.flax

Initializer = Callable[..., jax.Array]

_ROLES = ("x", "kernel", "grad")


def canonicalize_tuple(value: Union[int, Iterable[int]]) -> Tuple[int, ...]:
    """An int or an iterable of ints as a tuple."""
    return tuple(value) if isinstance(value, Iterable) else (value,)


def logical_param(module: nn.Module, name: str, init: Initializer, shape, dtype, axes: Sequence[Optional[str]]):
    """``module.param`` carrying logical axis names (``nn.with_logical_partitioning``) when given.

    Raises:
        ValueError: ``axes`` is non-empty and its length differs from the parameter's rank.
    """
    axes = tuple(axes or ())
    if axes and len(axes) != len(shape):
        raise ValueError(
            f"{type(module).__name__}.{name}: {len(axes)} logical axes {axes} for a parameter of shape "
            f"{tuple(shape)}; give one name (or None) per dimension"
        )
    if axes:
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, tuple(shape), dtype)


def _meta_variables(module: nn.Module, prefix: str, initial: QuantizeMeta, collection: str = NVTE_FP8_COLLECTION_NAME) -> QuantizeMeta:
    """The delayed-scaling state ``{prefix}_scale`` and ``{prefix}_amax_history`` of ``module`` in ``collection``."""
    scale = module.variable(collection, f"{prefix}_scale", lambda: initial.scale)
    history = module.variable(collection, f"{prefix}_amax_history", lambda: initial.amax_history)
    return QuantizeMeta(scale.value, history.value)


def quantizer_set(module: nn.Module, postfix: str = "") -> QuantizerSet:
    """The quantizer set of one GEMM of ``module`` under the active autocast recipe.

    Creates the delayed-scaling variables on first use; returns the no-op set when FP8 is off.
    """
    initial = QuantizerFactory.create_meta_set()
    if initial is None:
        return QuantizerFactory.create_set()
    metas = QuantizeMetaSet(*(_meta_variables(module, role + postfix, m) for role, m in zip(_ROLES, initial)))
    return QuantizerFactory.create_set(meta_set=metas)


def check_output_dtype(module: nn.Module, inputs: jax.Array, outputs: jax.Array) -> None:
    """The compute dtype is the input's: the output must come back in it (internal invariant)."""
    assert outputs.dtype == inputs.dtype, (
        f"{type(module).__name__}: output dtype {outputs.dtype} differs from input dtype {inputs.dtype}"
    )


def check_no_lora(module: nn.Module, enabled: bool) -> None:
    """LoRA is not implemented yet: refuse it clearly.

    Raises:
        NotImplementedError: ``enabled`` is True.
    """
    if enabled:
        raise NotImplementedError(
            f"{type(module).__name__}: low-rank adaptation (LoRA) is not implemented; "
            "set enable_low_rank_adaptation=False / low_rank_adaptation_scope='none'"
        )


def stacked_init(init: Initializer, n: int, axis: int = -2) -> Initializer:
    """An initializer that draws ``n`` independent kernels of shape ``shape`` minus ``axis`` and stacks them."""

    def _init(key, shape, dtype=jnp.float32):
        sub_shape = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
        keys = jax.random.split(key, n)
        return jnp.stack([init(k, sub_shape, dtype) for k in keys], axis=axis)

    return _init
