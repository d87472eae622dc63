"""``GroupedLinear`` under per-tensor FP8 scaling in one call per pass: every split's cast in one launch, the G GEMMs
of each pass in one grouped GEMM (y_i = x_i @ W_i^T + b_i over the row splits x = [x_0; ...; x_{G-1}]).

    forward   q_x, x^T = cast_transpose_grouped(x, splits, s_x)        s_x[g]: split g's input scale
              q_W, W^T = cast_transpose_grouped([W_0; ...; W_{G-1}], (N,) * G, s_W)    (cast_weights; or cached)
              y        = gemm_grouped(q_x, q_W [G, N, K]) + b
    backward  q_dy, dy^T = cast_transpose_grouped(dy, splits, s_dy)
              dx  = gemm_grouped(q_dy, W^T [G, K, N]),  dW = gemm_grouped_wgrad(dy^T, x^T),  db = column_sums_grouped(dy)

The scales per split: delayed scaling's are GEMM g's slots of the state, the amaxes max-ed into its history
(:class:`DelayedSplits`); current scaling's come from each split's own amax (``current_scale_grouped``,
:class:`CurrentSplits`). Either way split g is cast as the per-split path (``_grouped_linear_function``) casts it,
so the two give the same results (bit for bit on the reference backend); what differs is the host work: a handful
of op calls for all splits instead of about ten per split. W^T is kept from the forward cast (one FP8 byte per
weight element from forward to backward, as NVIDIA TE keeps it). The module takes this path only where it applies
(``GroupedLinear._split_casters``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from transformer_engine.plugin import ops

from ..quantization.quantizer import Float8CurrentScalingQuantizer
from ..quantization.recipe_state import SplitAccumulator
from ..quantization.roles import BWD_ROLES, FWD_ROLES, Role, slot
from .._functions.common import cast, no_torch_autocast, rows_of, unflatten

__all__ = [
    "CurrentSplits", "DelayedSplits", "GroupedFp8Args", "GroupedFp8Function", "GroupedFp8Weights", "SplitCaster", "cast_weights",
    "stacked_weights",
]


@dataclass(frozen=True)
class DelayedSplits:
    """Delayed scaling of one role: split g cast with scale[slot(g, role)], its amax max-ed into the history's row 0."""

    state: object
    role: Role

    def cast(self, x: torch.Tensor, m_splits: Tuple[int, ...]):
        """(q, q_t, scale_inv [G]) of x's row splits."""
        roles = FWD_ROLES if self.role in FWD_ROLES else BWD_ROLES
        first, state = slot(0, self.role), self.state
        scale, amax_slots = state.scale[first::len(roles)], state.amax_history[0, first::len(roles)]  # strided [G] views
        q, q_t, scale_inv, _ = ops.cast_transpose_grouped(x, m_splits, scale=scale, fp8_dtype=state.fp8_dtype, amax_out=amax_slots)
        return q, q_t, scale_inv


@dataclass(frozen=True)
class CurrentSplits:
    """Current scaling of one role: split g cast with fp8_max / max|x_g| (the role's quantizer's rule)."""

    quantizer: Float8CurrentScalingQuantizer

    def cast(self, x: torch.Tensor, m_splits: Tuple[int, ...]):
        """(q, q_t, scale_inv [G]) of x's row splits."""
        fp8_dtype, qparams = self.quantizer.fp8_dtype, self.quantizer.qparams
        scale, amax = ops.current_scale_grouped(x, m_splits, fp8_dtype, amax_epsilon=qparams.amax_epsilon,
                                                power_2_scale=qparams.power_2_scale)
        # amax holds max|x_g| already
        q, q_t, scale_inv, _ = ops.cast_transpose_grouped(x, m_splits, scale=scale, fp8_dtype=fp8_dtype, amax_out=amax)
        return q, q_t, scale_inv


SplitCaster = Union[DelayedSplits, CurrentSplits]


@dataclass(frozen=True)
class GroupedFp8Weights:
    """The G weights [N, K] in FP8, cast in one launch: q [G, N, K], q_t = [W_0; ...; W_{G-1}]^T [K, G N] (W_g^T is
    q_t[:, g N : (g + 1) N]) and scale_inv [G]."""

    q: torch.Tensor
    q_t: torch.Tensor
    scale_inv: torch.Tensor


@dataclass(frozen=True)
class GroupedFp8Args:
    """Non-tensor arguments of :class:`GroupedFp8Function`.

    Attributes:
        dtype: activation dtype (of the GEMM outputs).
        m_splits: rows of each split (multiples of 16, summing to the input's rows).
        weights: the weights in FP8 (:func:`cast_weights`, or the module's cache of them).
        inputs, grad_outputs: the casts of x's and dy's splits.
        split_accumulator: ``use_split_accumulator`` of the fprop, dgrad and wgrad GEMMs.
        backward_update: the update of the gradients' scales, run at the end of backward, or None.
    """

    dtype: torch.dtype
    m_splits: Tuple[int, ...]
    weights: GroupedFp8Weights
    inputs: SplitCaster
    grad_outputs: SplitCaster
    split_accumulator: SplitAccumulator
    backward_update: Optional[Callable[..., None]] = None


def stacked_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[W_0; ...; W_{G-1}] [G N, K]: a view when the weights lie back to back in one storage (as ``GroupedLinear`` makes
    them), else a copy."""
    first = weights[0].detach()
    (n, k), size = first.shape, first.numel() * first.element_size()
    base = first.untyped_storage().data_ptr()
    if all(w.is_contiguous() and w.dtype == first.dtype and w.untyped_storage().data_ptr() == base
           and w.data_ptr() == first.data_ptr() + g * size for g, w in enumerate(weights)):
        return first.as_strided((len(weights) * n, k), (k, 1))
    return torch.stack([w.detach() for w in weights]).view(len(weights) * n, k)


def cast_weights(caster: SplitCaster, weights: Sequence[torch.Tensor]) -> GroupedFp8Weights:
    """The weights [N, K] stacked (:func:`stacked_weights`) and cast by ``caster`` (the weight role's), from the parameter
    dtype as per split."""
    n, k = weights[0].shape
    with torch.no_grad():
        q, q_t, scale_inv = caster.cast(stacked_weights(weights), (n,) * len(weights))
    return GroupedFp8Weights(q.view(len(weights), n, k), q_t, scale_inv)


class GroupedFp8Function(torch.autograd.Function):
    """y_i = x_i @ W_i^T + b_i over the row splits in FP8; see the module docstring.

    ``apply(inp, args, *weights, *biases)``: G weights [N, K], then G biases [N] (all None without bias).
    """

    @staticmethod
    def forward(ctx, inp: torch.Tensor, args: GroupedFp8Args, *params: Optional[torch.Tensor]):
        biases, w = params[len(args.m_splits):], args.weights
        with no_torch_autocast(inp.device):
            q_x, x_t, x_scale_inv = args.inputs.cast(cast(rows_of(inp), args.dtype), args.m_splits)
            bias = None if biases[0] is None else torch.stack([cast(b.detach(), args.dtype) for b in biases])
            y = ops.gemm_grouped(q_x, w.q, args.m_splits, a_scale_inv=x_scale_inv, b_scale_inv=w.scale_inv,
                                 out_dtype=args.dtype, bias=bias, use_split_accumulator=args.split_accumulator.fprop)
        ctx.save_for_backward(x_t, x_scale_inv, w.q_t, w.scale_inv)
        ctx.args, ctx.inp_meta = dataclasses.replace(args, weights=None), (inp.shape, inp.dtype)
        ctx.param_dtypes = tuple(p.dtype if p is not None else None for p in params)
        return unflatten(y, inp.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        args, (inp_shape, inp_dtype) = ctx.args, ctx.inp_meta
        groups = len(args.m_splits)
        x_t, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors
        need_dx, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2:2 + groups], ctx.needs_input_grad[2 + groups:]
        dx, dws, dbs = None, [None] * groups, [None] * groups
        with no_torch_autocast(dy.device):
            dy = cast(rows_of(dy), args.dtype)
            q_dy, dy_t, dy_scale_inv = args.grad_outputs.cast(dy, args.m_splits)
            if any(need_w):
                dw = ops.gemm_grouped_wgrad(dy_t, x_t, args.m_splits, a_scale_inv=dy_scale_inv, b_scale_inv=x_scale_inv,
                                            out_dtype=ctx.param_dtypes[0], use_split_accumulator=args.split_accumulator.wgrad)
                dws = [part if need else None for part, need in zip(dw.unbind(0), need_w)]
            if need_dx:
                k, n = w_t.shape[0], w_t.shape[1] // groups
                w_t_splits = w_t.view(k, groups, n).permute(1, 0, 2)  # [G, K, N]: W_g^T, rows strided by G N
                dx = ops.gemm_grouped(q_dy, w_t_splits, args.m_splits, a_scale_inv=dy_scale_inv, b_scale_inv=w_scale_inv,
                                      out_dtype=args.dtype, use_split_accumulator=args.split_accumulator.dgrad)
                dx = cast(dx.view(*inp_shape), inp_dtype)
            if any(need_b):
                db = ops.column_sums_grouped(dy, args.m_splits, out_dtype=ctx.param_dtypes[groups])
                dbs = [part if need else None for part, need in zip(db.unbind(0), need_b)]
        if args.backward_update is not None:
            args.backward_update([])
        return (dx, None, *dws, *dbs)
