"""The autograd Function of ``Linear``: y = x @ W^T + b with its three GEMMs in FP8 under autocast.

Forward: x is cast by the input quantizer (FP8: E4M3, with x^T in the same pass), W arrives as its
operand (FP8; with W^T when cached across micro-batches); fprop y = gemm(x, W^T) + b in the activation
dtype. Saved for backward: x^T (FP8 under autocast: neither the high-precision x nor the row-major FP8
copy is kept; with ``save_original_input`` x as given, whose x^T backward casts again) and W itself, from
which backward casts W^T again (a cached operand: its W^T).
Backward: dy is cast by the grad-output quantizer (E5M2 under HYBRID) with dy^T; wgrad dW = dy^T @ x
(into ``main_grad`` with fuse_wgrad_accumulation), then dgrad dx = dy @ W, db = sum_rows(dy). When the
backward frees its graph, x^T and dy^T go before dgrad allocates dx (see ``gemm.linear_backward``).
Tensor / sequence parallelism: ``args.comm`` is called at the marked points (``# comm``), see
:mod:`..parallel.linear_comm`; without it each call returns its argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..parallel.linear_comm import LinearComm
from .common import (
    Operand, backward_frees_graph, cast, for_backward, grad_output_operand, no_torch_autocast, quantize_operand, rows_of, save, saved,
    unflatten, without_operands,
)
from .fp8_meta import ForwardQuantization
from .gemm import WgradTarget, fprop_with_comm, linear_backward
from .wgrad_store import backward_batch

__all__ = ["LinearArgs", "LinearFunction"]


@dataclass(frozen=True)
class LinearArgs:
    """Non-tensor arguments of :class:`LinearFunction`.

    Attributes:
        dtype: activation dtype (of the GEMM outputs).
        quantization: the quantizers of this call.
        weight_operand: W as GEMM operand (FP8 or the high-precision weight).
        wgrad: where dW goes.
        comm: the tensor-parallel communication (``NO_COMM`` without tensor parallelism).
        save_original_input: keep the input as given for backward, whose wgrad casts x^T again (FP8 only;
            the caller checked that the input's cast depends on the input alone).
    """

    dtype: torch.dtype
    quantization: ForwardQuantization
    weight_operand: Operand
    wgrad: WgradTarget
    comm: LinearComm
    save_original_input: bool = False


class LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b; see the module docstring."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: LinearArgs):
        q, comm = args.quantization, args.comm
        x = rows_of(inp)
        need_dw = weight.requires_grad and q.for_training
        with no_torch_autocast(inp.device):
            quantizer = q.gemms[0].input
            keep_input = args.save_original_input and quantizer.is_fp8  # backward casts x^T from x
            gather, cast_comm = comm.pipelines_gather(quantizer), comm.for_cast(quantizer)
            x_op = quantize_operand(quantizer, cast(x, args.dtype), cast_comm.gather_input, gathered=cast_comm.gathers_input,  # comm
                                    columnwise=need_dw and not gather and not keep_input)
            w_op = cast(args.weight_operand, args.dtype)
            y, x_op = fprop_with_comm(x_op, w_op, cast(bias, args.dtype), args.dtype, split_accumulator=q.split_accumulator.fprop,  # comm
                                      comm=comm, gather=gather, columnwise=need_dw and not keep_input)
            saved_x = (x if keep_input else for_backward(x_op)) if need_dw else None
            save(ctx, saved_x, for_backward(w_op) if inp.requires_grad and q.for_training else None)
        ctx.args = without_operands(args, "weight_operand")
        ctx.inp_meta, ctx.bias_dtype = (inp.shape, inp.dtype), None if bias is None else bias.dtype
        return unflatten(y, inp.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        args, (inp_shape, inp_dtype) = ctx.args, ctx.inp_meta
        q, comm = args.quantization, args.comm
        x_op, w_op = saved(ctx)
        amaxes = []  # of the traced grad casts, for the update
        with no_torch_autocast(dy.device), backward_batch(args.wgrad.delayed):
            if x_op is not None and args.save_original_input and q.gemms[0].input.is_fp8:
                x_op = q.gemms[0].input.quantize_transposed(cast(x_op, args.dtype))
            dy_hp = cast(rows_of(dy), args.dtype)
            need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
            dy_op, db, gather_dy = grad_output_operand(q.gemms[0].grad_output, dy_hp, comm, need_dw=need_dw,  # comm
                                                        db_dtype=ctx.bias_dtype if need_db else None, amaxes=amaxes)
            dx, dw = linear_backward(dy_op, x_op, w_op, (need_dx, need_dw), args.wgrad, q.split_accumulator, args.dtype,
                                     release_wgrad_operands=backward_frees_graph(), comm=comm, gather_dy=gather_dy)  # comm
            db = comm.reduce_bias_grad(db)  # comm
        if q.backward_update is not None:
            q.backward_update(amaxes)
        dx = None if dx is None else cast(dx.view(*inp_shape), inp_dtype)
        return dx, dw, cast(db, ctx.bias_dtype), None
