"""The autograd Function of ``LayerNormLinear``: y = norm(x) @ W^T + b, FP8 GEMMs under autocast.

Forward: the norm writes its output directly as the FP8 GEMM operand (fused cast), unless the
high-precision norm output is returned too (``return_layernorm_output``), then it is cast after.
Saved: x (for the norm backward), gamma, the statistics, the transposed FP8 norm output (what wgrad
reads) and W (backward casts W^T again for dgrad, see ``DeferredTranspose``).
Backward: dy -> FP8 (E5M2 under HYBRID) with dy^T; dgrad and wgrad as in Linear; the norm backward takes the
dgrad result (plus the gradient of the returned norm output).
Tensor / sequence parallelism: ``args.comm`` is called at the marked points (``# comm``), see
:mod:`..parallel.linear_comm`: under sequence parallelism the norm runs on this rank's rows and its
(FP8) output is all-gathered for the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quantization.quantizer import IDENTITY
from ..parallel.linear_comm import LinearComm
from .._functions.common import (
    Operand, backward_frees_graph, cast, for_backward, grad_output_operand, no_torch_autocast, quantize_operand, rows_of, save, saved,
    unflatten, without_operands,
)
from .._functions.fp8_meta import ForwardQuantization
from .._functions.gemm import WgradTarget, fprop_with_comm, linear_backward
from .._functions.wgrad_store import backward_batch
from .._functions.norm import NormConfig, norm_backward, norm_forward

__all__ = ["LayerNormLinearArgs", "LayerNormLinearFunction", "norm_then_quantize"]


@dataclass(frozen=True)
class LayerNormLinearArgs:
    """Non-tensor arguments of :class:`LayerNormLinearFunction` (see ``LinearArgs``)."""

    dtype: torch.dtype
    quantization: ForwardQuantization
    weight_operand: Operand
    wgrad: WgradTarget
    norm: NormConfig
    return_layernorm_output: bool
    comm: LinearComm


def norm_then_quantize(x, gamma, beta, norm: NormConfig, quantizer, dtype, return_hp: bool, columnwise: bool,
                       comm: LinearComm):
    """(GEMM operand, norm output to return or None, stats): fused norm + cast, or norm then cast when the
    output is returned or must be gathered before its cast; the operand is all-gathered when ``comm`` says
    so (column + SP). ``columnwise``: the wgrad GEMM reads the operand's transpose."""
    gather_first = comm.gathers_input and not quantizer.gathers_quantized
    if not (return_hp or gather_first):
        ln_op, stats = norm_forward(x, gamma, beta, norm, quantizer, dtype, columnwise=columnwise and not comm.gathers_input)
        return comm.gather_input(ln_op), None, stats  # comm
    ln_out, stats = norm_forward(x, gamma, beta, norm, IDENTITY, dtype)
    ln_op = quantize_operand(quantizer, ln_out, comm.gather_input, gathered=comm.gathers_input, columnwise=columnwise)  # comm
    return ln_op, ln_out, stats


class LayerNormLinearFunction(torch.autograd.Function):
    """y = norm(x) @ W^T + b (and norm(x) with return_layernorm_output)."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias: Optional[torch.Tensor], args: LayerNormLinearArgs):
        q, dtype, comm = args.quantization, args.dtype, args.comm
        x = cast(rows_of(inp), dtype)
        gamma = cast(ln_weight, dtype)
        need_dw = weight.requires_grad and q.for_training
        with no_torch_autocast(inp.device):
            quantizer = q.gemms[0].input
            gather = comm.pipelines_gather(quantizer)
            ln_op, ln_out, stats = norm_then_quantize(
                x, gamma, cast(ln_bias, dtype), args.norm, quantizer, dtype, return_hp=args.return_layernorm_output,
                columnwise=need_dw and not gather, comm=comm.for_cast(quantizer),
            )
            w_op = cast(args.weight_operand, dtype)
            y, ln_op = fprop_with_comm(ln_op, w_op, cast(bias, dtype), dtype, split_accumulator=q.split_accumulator.fprop,  # comm
                                       comm=comm, gather=gather, columnwise=need_dw)
            save(ctx, x, gamma, for_backward(ln_op) if need_dw else None, for_backward(w_op) if q.for_training else None, *stats)
        ctx.args = without_operands(args, "weight_operand")
        ctx.meta = (inp.shape, inp.dtype, ln_weight.dtype, None if ln_bias is None else ln_bias.dtype, None if bias is None else bias.dtype)
        y = unflatten(y, inp.shape)
        return (y, ln_out.reshape(inp.shape)) if args.return_layernorm_output else y

    @staticmethod
    def backward(ctx, dy, *d_ln_out):
        args, (inp_shape, inp_dtype, gamma_dtype, beta_dtype, bias_dtype) = ctx.args, ctx.meta
        q, comm = args.quantization, args.comm
        x, gamma, ln_op, w_op, *stats = saved(ctx)
        amaxes = []  # of the traced grad casts, for the update
        with no_torch_autocast(dy.device), backward_batch(args.wgrad.delayed):
            dy_hp = cast(rows_of(dy), args.dtype)
            need_dw, need_db = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
            dy_op, db, gather_dy = grad_output_operand(q.gemms[0].grad_output, dy_hp, comm, need_dw=need_dw,  # comm
                                                        db_dtype=bias_dtype if need_db else None, amaxes=amaxes)
            need = (any(ctx.needs_input_grad[:3]), need_dw)
            d_ln, dw = linear_backward(dy_op, ln_op, w_op, need, args.wgrad, q.split_accumulator, args.dtype,
                                       release_wgrad_operands=backward_frees_graph(), comm=comm, gather_dy=gather_dy)  # comm
            db = comm.reduce_bias_grad(db)  # comm
            dx = dgamma = dbeta = None
            if d_ln is not None:
                if args.return_layernorm_output:
                    d_ln = d_ln + cast(d_ln_out[0].reshape(d_ln.shape), args.dtype)
                dx, dgamma, dbeta = norm_backward(d_ln, x, tuple(stats), gamma, args.norm)
                dgamma, dbeta = comm.reduce_norm_grads(dgamma, dbeta)  # comm
        if q.backward_update is not None:
            q.backward_update(amaxes)
        dx = None if dx is None else cast(dx.view(*inp_shape), inp_dtype)
        return dx, cast(dgamma, gamma_dtype), cast(dbeta, beta_dtype), dw, cast(db, bias_dtype), None
