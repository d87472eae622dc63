"""Dense (GEMM) with optional FP8: ``y = x . W + b`` over the given contracting dimensions.

The three GEMMs of a dense layer, with x of shape (batch..., K...) and W of shape (K..., N...):

    fprop  y  = x . W           contract x's K axes with W's K axes     -> (batch..., N...)
    dgrad  dx = dy . W^T        contract dy's N axes with W's N axes    -> (batch..., K...)
    wgrad  dW = x^T . dy        contract x's batch axes with dy's       -> (K..., N...)

With a quantizer set, x and W are quantized in the forward pass (saved as FP8 for the backward)
and dy in the backward pass (e5m2 under HYBRID), so every GEMM multiplies two FP8 operands
(e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2). The op is a ``jax.custom_vjp`` whose quantizer-set
argument receives, as its "cotangent", the quantizers with their updated delayed-scaling state.
Without quantizers, W is cast to x's dtype and a plain ``dot_general`` runs (autodiff as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from .quantize import QuantizerSet, noop_quantizer_set, scaled_dot_general
from .sharding import with_sharding_constraint_by_logical_axes

__all__ = ["dense", "noop_collective_op_set"]

noop_collective_op_set = None  # collective GEMM overlap (all-gather / reduce-scatter) is not implemented


@dataclass(frozen=True)
class _GemmDims:
    """Axis bookkeeping of the three GEMMs (static: hashable, the custom_vjp's nondiff argument)."""

    x_contract: Tuple[int, ...]
    k_contract: Tuple[int, ...]
    x_ndim: int
    k_ndim: int

    @property
    def x_batch(self) -> Tuple[int, ...]:
        return tuple(a for a in range(self.x_ndim) if a not in self.x_contract)

    @property
    def k_free(self) -> Tuple[int, ...]:
        return tuple(a for a in range(self.k_ndim) if a not in self.k_contract)

    @property
    def fprop(self):
        return (self.x_contract, self.k_contract), ((), ())

    @property
    def dgrad(self):
        nb = len(self.x_batch)
        return (tuple(range(nb, nb + len(self.k_free))), self.k_free), ((), ())

    @property
    def wgrad(self):
        return (self.x_batch, tuple(range(len(self.x_batch)))), ((), ())

    def dgrad_to_x(self) -> Tuple[int, ...]:
        """Permutation from the dgrad result (batch..., K...) to x's axis order."""
        return tuple((self.x_batch + self.x_contract).index(a) for a in range(self.x_ndim))

    def wgrad_to_kernel(self) -> Tuple[int, ...]:
        """Permutation from the wgrad result (K..., N...) to the kernel's axis order."""
        return tuple((self.k_contract + self.k_free).index(a) for a in range(self.k_ndim))


def _last(axes: Tuple[int, ...]) -> Optional[int]:
    return axes[-1] if axes else None


def _canonical_dims(x: jax.Array, kernel: jax.Array, contracting_dims) -> _GemmDims:
    try:
        x_c, k_c = (tuple(int(a) for a in axes) for axes in contracting_dims)
    except (TypeError, ValueError):
        raise ValueError(
            f"contracting_dims must be a pair of axis tuples like ((1,), (0,)), got {contracting_dims!r}"
        ) from None
    x_c = tuple(a % x.ndim for a in x_c)
    k_c = tuple(a % kernel.ndim for a in k_c)
    x_sizes = tuple(x.shape[a] for a in x_c)
    k_sizes = tuple(kernel.shape[a] for a in k_c)
    if len(x_c) != len(k_c) or x_sizes != k_sizes:
        raise ValueError(
            f"dense: x{tuple(x.shape)} axes {x_c} (sizes {x_sizes}) do not match "
            f"kernel{tuple(kernel.shape)} axes {k_c} (sizes {k_sizes}): fix contracting_dims or the shapes"
        )
    return _GemmDims(x_c, k_c, x.ndim, kernel.ndim)


def _check_floating(**arrays) -> None:
    for name, value in arrays.items():
        if value is not None and not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"dense: {name} must be a floating-point array, got dtype {value.dtype}")


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: Optional[jax.Array] = None,
    contracting_dims=((1,), (0,)),
    transpose_batch_sequence: bool = False,
    input_axes: Optional[Sequence[str]] = None,
    kernel_axes: Optional[Sequence[str]] = None,
    output_axes: Optional[Sequence[str]] = None,
    collective_op_set=noop_collective_op_set,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """y = x . kernel (+ bias), in FP8 when ``quantizer_set`` holds quantizers.

    Args:
        x: input; kernel: weight; bias: shape of the kernel's non-contracted axes, added after the GEMM.
        contracting_dims: (x axes, kernel axes) to contract.
        transpose_batch_sequence: x is (seq, batch, ...) rather than (batch, seq, ...); only
            affects sharding, never the math.
        input_axes, kernel_axes, output_axes: logical axis names for sharding constraints.
        collective_op_set: must be ``noop_collective_op_set`` (None).
        quantizer_set: from ``QuantizerFactory.create_set``; ``noop_quantizer_set`` = no FP8.

    Returns:
        y of shape (x's non-contracted axes..., kernel's non-contracted axes...) in x.dtype.

    Raises:
        ValueError: contracting sizes differ, or the bias shape is wrong.
        TypeError: a non-floating input. NotImplementedError: a collective op set.

    Example:
        >>> y = dense(jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> y.shape, float(y[0, 0])
        ((2, 4), 3.0)
    """
    del transpose_batch_sequence
    if collective_op_set is not noop_collective_op_set:
        raise NotImplementedError("dense: collective GEMM overlap is not implemented; pass noop_collective_op_set")
    _check_floating(x=x, kernel=kernel, bias=bias)
    dims = _canonical_dims(x, kernel, contracting_dims)
    free_shape = tuple(kernel.shape[a] for a in dims.k_free)
    if bias is not None and tuple(bias.shape) != free_shape:
        raise ValueError(f"dense: bias shape {tuple(bias.shape)} must equal the kernel's output shape {free_shape}")
    x = with_sharding_constraint_by_logical_axes(x, input_axes)
    kernel = with_sharding_constraint_by_logical_axes(kernel, kernel_axes)
    if quantizer_set.x is None:
        out = lax.dot_general(x, kernel.astype(x.dtype), dims.fprop)
    else:
        out = _fp8_dense(x, kernel, quantizer_set, dims)
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return with_sharding_constraint_by_logical_axes(out, output_axes)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_dense(x, kernel, quantizer_set, dims):
    out, _ = _fp8_dense_fwd(x, kernel, quantizer_set, dims)
    return out


def _fp8_dense_fwd(x, kernel, quantizer_set, dims: _GemmDims):
    (x_fprop, x_wgrad), new_qx = quantizer_set.x.quantize(x, (_last(dims.x_contract), _last(dims.x_batch)))
    (k_fprop, k_dgrad), new_qk = quantizer_set.kernel.quantize(
        kernel, (_last(dims.k_contract), _last(dims.k_free))
    )
    out = scaled_dot_general(x_fprop, k_fprop, dims.fprop, x.dtype)
    return out, (x_wgrad, k_dgrad, new_qx, new_qk, quantizer_set.dgrad)


def _fp8_dense_bwd(dims: _GemmDims, residuals, grad):
    x_wgrad, k_dgrad, new_qx, new_qk, q_grad = residuals
    nb, nf = len(dims.x_batch), len(dims.k_free)
    (g_dgrad, g_wgrad), new_qg = q_grad.quantize(grad, (nb + nf - 1 if nf else None, nb - 1 if nb else None))
    dx = scaled_dot_general(g_dgrad, k_dgrad, dims.dgrad, x_wgrad.dq_dtype)
    dk = scaled_dot_general(x_wgrad, g_wgrad, dims.wgrad, k_dgrad.dq_dtype)
    dx = jnp.transpose(dx, dims.dgrad_to_x())
    dk = jnp.transpose(dk, dims.wgrad_to_kernel())
    return dx, dk, QuantizerSet(new_qx, new_qk, new_qg)


_fp8_dense.defvjp(_fp8_dense_fwd, _fp8_dense_bwd)
