"""The autograd Function of ``GroupedLinear``: y_i = x_i @ W_i^T + b_i over the row splits x = [x_0; ...; x_{n-1}].

The rows of x [M, K] are split by ``m_splits`` (M = sum m_i); split i is the linear of GEMM i, with GEMM i's
quantizers, exactly as a ``Linear`` holding W_i would run it on x_i:

    fprop  y_i  = x_i @ W_i^T + b_i          y  = [y_0; ...; y_{n-1}]   [M, N]
    dgrad  dx_i = dy_i @ W_i                 dx = [dx_0; ...; dx_{n-1}] [M, K]
    wgrad  dW_i = dy_i^T @ x_i,  db_i = sum_rows(dy_i)

An empty split (m_i = 0) gives no rows of y and zero dW_i, db_i. One autograd node covers the n GEMMs;
the delayed-scaling update of the gradients' scales runs once, after the last split's backward.
Saved for backward, per split: x_i^T (FP8 under autocast) and W_i (see :mod:`.._functions.linear_function`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..parallel.linear_comm import NO_COMM
from .._functions.common import (
    Operand, backward_frees_graph, cast, for_backward, grad_output_operand, no_torch_autocast, quantize_operand, rows_of, save, saved,
    unflatten, without_operands,
)
from .._functions.fp8_meta import ForwardQuantization
from .._functions.gemm import WgradTarget, fprop, linear_backward
from .._functions.wgrad_store import backward_batch

__all__ = ["GroupedLinearArgs", "GroupedLinearFunction"]


def _no_gather(x: Operand) -> Operand:
    """The input's all-gather of :func:`quantize_operand`: none (the MoE dispatcher moved the rows already)."""
    return x


@dataclass(frozen=True)
class GroupedLinearArgs:
    """Non-tensor arguments of :class:`GroupedLinearFunction`.

    Attributes:
        dtype: activation dtype (of the GEMM outputs).
        quantization: the quantizers of this call (GEMM i's for split i).
        m_splits: rows of each split (non-negative, summing to the input's rows).
        weight_operands: W_i as GEMM operands (FP8 or the high-precision weights).
        wgrads: where each dW_i goes.
        save_original_input: keep the input as given for backward, whose wgrads cast each x_i^T again (FP8 only;
            the caller checked that the input casts depend on the input alone).
        out, dgrad_out: caller's buffers that receive y [M, N] and dx [M, K] (checked by the caller), or None.
    """

    dtype: torch.dtype
    quantization: ForwardQuantization
    m_splits: Tuple[int, ...]
    weight_operands: Tuple[Operand, ...]
    wgrads: Tuple[WgradTarget, ...]
    save_original_input: bool = False
    out: Optional[torch.Tensor] = None
    dgrad_out: Optional[torch.Tensor] = None


def _row_splits(rows: torch.Tensor, m_splits: Sequence[int]):
    """The views rows[o_i : o_i + m_i] of a contiguous [M, *] tensor (each contiguous)."""
    return rows.split(list(m_splits))


class GroupedLinearFunction(torch.autograd.Function):
    """y_i = x_i @ W_i^T + b_i over the row splits; see the module docstring.

    ``apply(inp, args, *weights, *biases)``: n weights, then n biases (None where there is none).
    """

    @staticmethod
    def forward(ctx, inp: torch.Tensor, args: GroupedLinearArgs, *params: Optional[torch.Tensor]):
        q, n = args.quantization, len(args.m_splits)
        weights, biases = params[:n], params[n:]
        x_ops, w_ops, ys = [], [], []
        keep_input = args.save_original_input and q.gemms[0].input.is_fp8  # backward casts each x_i^T from x_i
        with no_torch_autocast(inp.device):
            for i, x_i in enumerate(_row_splits(cast(rows_of(inp), args.dtype), args.m_splits)):
                need_dw = weights[i].requires_grad and q.for_training
                x_op = quantize_operand(q.gemms[i].input, x_i, _no_gather, gathered=False, columnwise=need_dw and not keep_input)
                w_op = cast(args.weight_operands[i], args.dtype)
                ys.append(fprop(x_op, w_op, cast(biases[i], args.dtype), args.dtype, split_accumulator=q.split_accumulator.fprop))
                x_ops.append((x_i if keep_input else for_backward(x_op)) if need_dw else None)
                w_ops.append(for_backward(w_op) if inp.requires_grad and q.for_training else None)
            save(ctx, *x_ops, *w_ops)
        ctx.args = without_operands(args, "weight_operands", "out")
        ctx.inp_meta = (inp.shape, inp.dtype)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        if args.out is not None:  # the splits' outputs copied into the caller's buffer, which is returned
            return torch.cat(ys, out=args.out)
        return unflatten(torch.cat(ys), inp.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        args, (inp_shape, inp_dtype) = ctx.args, ctx.inp_meta
        q, n = args.quantization, len(args.m_splits)
        operands = saved(ctx)
        need_dx, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2:2 + n], ctx.needs_input_grad[2 + n:]
        frees_graph = backward_frees_graph()
        dxs, dws, dbs, amaxes = [], [], [], []  # amaxes: of the traced grad casts, for the update
        with no_torch_autocast(dy.device), backward_batch(args.wgrads[0].delayed if args.wgrads else None):
            for i, dy_i in enumerate(_row_splits(cast(rows_of(dy), args.dtype), args.m_splits)):
                db_dtype = ctx.bias_dtypes[i] if need_b[i] else None
                dy_op, db, _ = grad_output_operand(q.gemms[i].grad_output, dy_i, NO_COMM, need_dw=need_w[i], db_dtype=db_dtype,
                                                   amaxes=amaxes)
                if operands[i] is not None and args.save_original_input and q.gemms[i].input.is_fp8:
                    operands[i] = q.gemms[i].input.quantize_transposed(operands[i])
                dx_i, dw = linear_backward(dy_op, operands[i], operands[n + i], (need_dx, need_w[i]), args.wgrads[i],
                                           q.split_accumulator, args.dtype, release_wgrad_operands=frees_graph)
                dxs.append(dx_i)
                dws.append(dw)
                dbs.append(cast(db, db_dtype))
        if q.backward_update is not None:
            q.backward_update(amaxes)
        if need_dx and args.dgrad_out is not None:
            dx = torch.cat([dx_i.to(args.dgrad_out.dtype) for dx_i in dxs], out=args.dgrad_out)
        else:
            dx = cast(torch.cat(dxs).view(*inp_shape), inp_dtype) if need_dx else None
        return (dx, None, *dws, *dbs)
