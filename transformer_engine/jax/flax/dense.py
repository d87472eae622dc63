"""Flax ``DenseGeneral`` and ``LayerNormDenseGeneral``: y = [norm](x) . W (+ b), FP8 under autocast.

The kernel has shape (*x.shape[axis], *features) (``DenseGeneral``) or (hidden, *features)
(``LayerNormDenseGeneral``); parameters are stored in ``dtype`` and cast to the input's dtype.
Inside ``te.autocast(enabled=True, recipe=DelayedScaling())`` each module also owns the FP8 state
variables ``x_scale``, ``x_amax_history``, ``kernel_*`` and ``grad_*`` in the "fp8_metas" collection.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..dense import dense
from ..layernorm import layernorm
from ..sharding import with_sharding_constraint_by_logical_axes
from ._base import Initializer, canonicalize_tuple, check_no_lora, check_output_dtype, logical_param, quantizer_set
from .layernorm import norm_params

__all__ = ["DenseGeneral", "LayerNormDenseGeneral"]


def _default_kernel_init() -> Initializer:
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _project(module: nn.Module, x: jax.Array, axis: Tuple[int, ...], input_axes) -> jax.Array:
    """x . kernel (+ bias) with the module's kernel / bias fields and its FP8 quantizer set."""
    features = canonicalize_tuple(module.features)
    kernel_shape = tuple(x.shape[a] for a in axis) + features
    kernel_init = module.kernel_init or _default_kernel_init()
    kernel = logical_param(module, "kernel", kernel_init, kernel_shape, module.dtype, module.kernel_axes)
    bias = None
    if module.use_bias:
        bias = logical_param(module, "bias", module.bias_init, features, module.dtype, module.bias_axes)
        bias = bias.astype(x.dtype)
    return dense(
        x, kernel.astype(x.dtype), bias, contracting_dims=(axis, tuple(range(len(axis)))),
        transpose_batch_sequence=module.transpose_batch_sequence, input_axes=input_axes,
        kernel_axes=module.kernel_axes, quantizer_set=quantizer_set(module),
    )


class DenseGeneral(nn.Module):
    """A dense layer over one or more input axes: y = x . W + b, W of shape (*x.shape[axis], *features).

    Attributes:
        features: output shape (int or tuple).
        kernel_init: None = variance_scaling(1.0, "fan_in", "truncated_normal").
        kernel_axes: logical axes of the kernel; bias_axes: of the bias.
        use_bias: add a bias (default True); bias_init: its initializer.
        enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
            (not implemented: enabling it raises).
        axis: input axes to contract (int or tuple).
        dtype: parameter dtype.
        input_axes: logical axes of the input (sharding constraint).
        transpose_batch_sequence: inputs are (seq, batch, ...); no effect on the math.
        quantization_checkpoint_name: accepted for compatibility.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layer = DenseGeneral(features=4)
        >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
        >>> variables["params"]["kernel"].shape, layer.apply(variables, jnp.ones((2, 3))).shape
        ((3, 4), (2, 4))
    """

    features: Union[Iterable[int], int]
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[str, ...] = ()
    use_bias: bool = True
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[Iterable[int], int] = -1
    dtype: jnp.dtype = jnp.float32
    input_axes: Tuple[str, ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """y = inputs . kernel + bias, in the inputs' dtype."""
        check_no_lora(self, self.enable_low_rank_adaptation)
        axis = tuple(a % inputs.ndim for a in canonicalize_tuple(self.axis))
        y = _project(self, inputs, axis, self.input_axes)
        check_output_dtype(self, inputs, y)
        return y


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm (or RMSNorm) then a dense layer: y = norm(x) . W (+ b); returns ``(y, ln_out)``.

    Attributes:
        features: output shape. enable_layernorm: apply the norm (else y = x . W).
        layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes: the norm
            (see :class:`LayerNorm`); ln_bias_init, ln_bias_axes: its beta.
        kernel_init, kernel_axes, use_bias (default False), bias_init, bias_axes: the dense.
        return_layernorm_output: also return the normalized input (else None).
        enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
            (not implemented: enabling it raises).
        axis: must be -1. dtype: parameter dtype.
        layernorm_input_axes, dot_input_axes: logical axes of the input and of the normalized input.
        depth_scaling: y is divided by it when set.
        transpose_batch_sequence, quantization_checkpoint_name: accepted, no effect on the math.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layer = LayerNormDenseGeneral(features=(3, 4))
        >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
        >>> y, ln_out = layer.apply(variables, jnp.ones((2, 8)))
        >>> y.shape, ln_out is None
        ((2, 3, 4), True)
    """

    features: Union[Iterable[int], int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[str, ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[str, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[Iterable[int], int] = -1
    dtype: jnp.dtype = jnp.float32
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_input_axes: Optional[Tuple[str, ...]] = None
    depth_scaling: Optional[float] = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    def __call__(self, inputs: jax.Array):
        """Returns ``(y, ln_out)``: ln_out is the norm's output (inputs if the norm is off) or None."""
        check_no_lora(self, self.enable_low_rank_adaptation)
        if canonicalize_tuple(self.axis) != (-1,):
            raise ValueError(f"LayerNormDenseGeneral: axis must be -1 (the normalized axis), got {self.axis!r}")
        x = with_sharding_constraint_by_logical_axes(inputs, self.layernorm_input_axes)
        if self.enable_layernorm:
            gamma, beta = norm_params(self, x.shape[-1], self.ln_bias_init, self.ln_bias_axes)
            beta = None if beta is None else beta.astype(x.dtype)
            x = layernorm(x, gamma.astype(x.dtype), beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        y = _project(self, x, (x.ndim - 1,), self.dot_input_axes)
        if self.depth_scaling is not None:
            y = (y / self.depth_scaling).astype(inputs.dtype)
        check_output_dtype(self, inputs, y)
        return y, (x if self.return_layernorm_output else None)
