"""LayerNorm + MLP: y = act(norm(x) . W1 + b1) . W2 + b2, with gated activations.

W1 has shape (hidden, n_acts, intermediate): one slice per activation, combined as in
:func:`activation.activation` (e.g. ("gelu", "linear") = GeGLU). W2 has shape (intermediate, hidden).
Each GEMM has its own quantizer set (delayed-scaling state "..._0" and "..._1" in the Flax module).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from .activation import activation
from .dense import dense, noop_collective_op_set
from .layernorm import layernorm
from .quantize import noop_quantizer_set
from .sharding import with_sharding_constraint_by_logical_axes

__all__ = ["layernorm_mlp", "mlp_after_norm"]


def _check_pairs(**pairs) -> None:
    for name, value in pairs.items():
        if len(value) != 2:
            raise ValueError(f"layernorm_mlp: {name} must hold 2 entries (one per GEMM), got {len(value)}")


def mlp_after_norm(normed, kernels, biases, activation_type, quantizer_sets, axes, intermediate_fn: Callable):
    """The two GEMMs and the activation: dense2(intermediate_fn(act(dense1(normed)))); what ``layernorm_mlp`` runs
    after its norm, and the Flax ``LayerNormMLP`` too (which puts its dropout in ``intermediate_fn``).

    ``axes`` = (dot_1_input_axes, dot_2_input_axes, kernel_1_axes, kernel_2_axes, ffn1_ckpt, ffn2_ckpt).
    """
    dot_1_axes, dot_2_axes, kernel_1_axes, kernel_2_axes, ffn1_name, ffn2_name = axes
    hidden = dense(
        normed, kernels[0], biases[0], contracting_dims=((normed.ndim - 1,), (0,)),
        input_axes=dot_1_axes, kernel_axes=kernel_1_axes, quantizer_set=quantizer_sets[0],
    )
    hidden = checkpoint_name(hidden, ffn1_name)
    act = intermediate_fn(activation(hidden, activation_type))
    act = with_sharding_constraint_by_logical_axes(act, dot_2_axes)
    out = dense(
        act, kernels[1], biases[1], contracting_dims=((act.ndim - 1,), (0,)),
        kernel_axes=kernel_2_axes, quantizer_set=quantizer_sets[1],
    )
    return checkpoint_name(out, ffn2_name)


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: Optional[jax.Array],
    kernels: Sequence[jax.Array],
    biases: Sequence[Optional[jax.Array]],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: Optional[Sequence[str]] = None,
    dot_1_input_axes: Optional[Sequence[str]] = None,
    dot_2_input_axes: Optional[Sequence[str]] = None,
    kernel_1_axes: Optional[Sequence[str]] = None,
    kernel_2_axes: Optional[Sequence[str]] = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str] = ("gelu",),
    activation_params=None,
    collective_op_sets=(noop_collective_op_set, noop_collective_op_set),
    quantizer_sets=(noop_quantizer_set, noop_quantizer_set),
) -> jax.Array:
    """y = act(norm(x) . W1 + b1) . W2 + b2 for x (..., hidden); returns (..., hidden) in x.dtype.

    Args follow :func:`layernorm`, :func:`dense` and :func:`activation`: ``kernels`` = (W1, W2),
    ``biases`` = (b1 or None, b2 or None), one collective op set and quantizer set per GEMM.
    ``ffn1_ckpt_name``/``ffn2_ckpt_name`` name the GEMM outputs for ``jax.checkpoint`` policies.

    Raises:
        ValueError: not exactly two kernels / biases / quantizer sets, or inconsistent shapes.
        NotImplementedError: activation_params or collective op sets.

    Example:
        >>> import jax.numpy as jnp
        >>> w1, w2 = jnp.ones((4, 1, 8)), jnp.ones((8, 4))
        >>> layernorm_mlp(jnp.ones((2, 4)), jnp.ones(4), jnp.zeros(4), (w1, w2), (None, None), "layernorm").shape
        (2, 4)
    """
    del transpose_batch_sequence
    _check_pairs(kernels=kernels, biases=biases, quantizer_sets=quantizer_sets, collective_op_sets=collective_op_sets)
    if any(c is not noop_collective_op_set for c in collective_op_sets):
        raise NotImplementedError("layernorm_mlp: collective GEMM overlap is not implemented")
    if activation_params is not None:
        raise NotImplementedError("layernorm_mlp: activation_params (clamped activations) are not implemented")
    x = with_sharding_constraint_by_logical_axes(x, norm_input_axes)
    normed = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    axes = (dot_1_input_axes, dot_2_input_axes, kernel_1_axes, kernel_2_axes, ffn1_ckpt_name, ffn2_ckpt_name)
    return mlp_after_norm(normed, kernels, biases, activation_type, quantizer_sets, axes, lambda h: h)
