"""Flax ``LayerNormMLP``: y = dropout(act(norm(x) . W_i + b_i)) . W_o + b_o; returns ``(y, ln_out)`` (no norm with
``enable_layernorm=False``).

Parameters: ``scale``, ``ln_bias`` (the norm), ``wi_kernel`` (hidden, n_acts, intermediate) with one
independently initialised kernel per activation, ``wo_kernel`` (intermediate, hidden), and with
``use_bias`` ``wi_bias`` (n_acts, intermediate) and ``wo_bias`` (hidden,). Under delayed scaling the
two GEMMs own the FP8 variables ``{x,kernel,grad}_0_*`` and ``{x,kernel,grad}_1_*``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..activation import canonicalize_activations
from ..layernorm import layernorm
from ..layernorm_mlp import mlp_after_norm
from ..sharding import with_sharding_constraint_by_logical_axes
from ._base import Initializer, check_no_lora, check_output_dtype, logical_param, quantizer_set, stacked_init
from .layernorm import norm_params

__all__ = ["LayerNormMLP"]


class LayerNormMLP(nn.Module):
    """LayerNorm followed by a (gated) MLP.

    Attributes:
        intermediate_dim: width of the hidden layer.
        enable_layernorm: apply the norm (else the MLP reads x itself and there are no norm parameters).
        layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes, ln_bias_init,
            ln_bias_axes: the norm (see :class:`LayerNorm`).
        kernel_init: None = variance_scaling(1.0, "fan_in", "truncated_normal").
        kernel_axes_1, kernel_axes_2: logical axes of wi_kernel and wo_kernel.
        use_bias, bias_init, bias_axes_1, bias_axes_2: the biases.
        return_layernorm_output: also return the normalized input (else None).
        activations: e.g. ("gelu",) or ("gelu", "linear") (GeGLU); activation_params must be None.
        intermediate_dropout_rng_name, intermediate_dropout_rate, intermediate_hidden_dropout_dims:
            dropout after the activation.
        enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
            (not implemented: enabling it raises).
        axis: must be -1. dtype: parameter dtype.
        layernorm_input_axes, dot_1_input_axes, dot_2_input_axes: logical axes of the activations.
        ffn1_ckpt_name, ffn2_ckpt_name: checkpoint names of the two GEMM outputs.
        transpose_batch_sequence, quantization_checkpoint_name: accepted, no effect on the math.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> mlp = LayerNormMLP(intermediate_dim=16, activations=("gelu", "linear"))
        >>> variables = mlp.init(jax.random.PRNGKey(0), jnp.ones((2, 8)), deterministic=True)
        >>> nn.meta.unbox(variables)["params"]["wi_kernel"].shape  # params carry logical axis names
        (8, 2, 16)
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[str, ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes_1: Tuple[str, ...] = ("embed", "act", "mlp")
    kernel_axes_2: Tuple[str, ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Tuple[str, ...] = ("act", "mlp")
    bias_axes_2: Tuple[str, ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Sequence[str] = ("gelu",)
    activation_params: Optional[dict] = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: int = -1
    dtype: jnp.dtype = jnp.float32
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_1_input_axes: Optional[Tuple[str, ...]] = None
    dot_2_input_axes: Optional[Tuple[str, ...]] = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    def _kernels_and_biases(self, hidden: int, n_acts: int, dtype):
        init = self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        shape_1 = (hidden, n_acts, self.intermediate_dim)
        wi = logical_param(self, "wi_kernel", stacked_init(init, n_acts), shape_1, self.dtype, self.kernel_axes_1)
        wo = logical_param(self, "wo_kernel", init, (self.intermediate_dim, hidden), self.dtype, self.kernel_axes_2)
        biases = (None, None)
        if self.use_bias:
            bi = logical_param(self, "wi_bias", self.bias_init, shape_1[1:], self.dtype, self.bias_axes_1)
            bo = logical_param(self, "wo_bias", self.bias_init, (hidden,), self.dtype, self.bias_axes_2)
            biases = (bi.astype(dtype), bo.astype(dtype))
        return (wi.astype(dtype), wo.astype(dtype)), biases

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False):
        """Returns ``(y, ln_out)`` with y of the inputs' shape and dtype."""
        check_no_lora(self, self.enable_low_rank_adaptation)
        if self.axis != -1 or self.activation_params is not None:
            raise NotImplementedError("LayerNormMLP: only axis=-1 and activation_params=None are implemented")
        names = canonicalize_activations(self.activations)
        x = with_sharding_constraint_by_logical_axes(inputs, self.layernorm_input_axes)
        normed = x
        if self.enable_layernorm:
            gamma, beta = norm_params(self, x.shape[-1], self.ln_bias_init, self.ln_bias_axes)
            beta = None if beta is None else beta.astype(x.dtype)
            normed = layernorm(x, gamma.astype(x.dtype), beta, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        kernels, biases = self._kernels_and_biases(x.shape[-1], len(names), x.dtype)
        dropout = nn.Dropout(
            rate=self.intermediate_dropout_rate, broadcast_dims=self.intermediate_hidden_dropout_dims,
            rng_collection=self.intermediate_dropout_rng_name,
        )
        axes = (self.dot_1_input_axes, self.dot_2_input_axes, self.kernel_axes_1, self.kernel_axes_2,
                self.ffn1_ckpt_name, self.ffn2_ckpt_name)
        y = mlp_after_norm(
            normed, kernels, biases, names, (quantizer_set(self, "_0"), quantizer_set(self, "_1")), axes,
            lambda h: dropout(h, deterministic=deterministic),
        )
        check_output_dtype(self, inputs, y)
        return y, (normed if self.return_layernorm_output else None)
