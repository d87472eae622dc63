"""The autograd Function of ``LayerNormMLP``: y = fc2(act(fc1(norm(x)))), all four GEMMs' operands FP8 under autocast.

Forward: norm -> FP8 (fused cast, slot GEMM1_INPUT); h = fc1 fprop (high precision, kept for the
activation backward); a = act(h) -> FP8 by the fused activation cast (slot GEMM2_INPUT); y = fc2 fprop.
Saved: x, gamma, statistics, h, the transposed FP8 norm output and activation output (what wgrad
reads) and both weights (backward casts W^T again for dgrad, see ``DeferredTranspose``).
Backward: dy -> FP8 (GRAD_OUTPUT2) with dy^T; fc2 wgrad/dgrad; dh = dact(da, h) -> FP8 (GRAD_OUTPUT1)
with dh^T; fc1 wgrad/dgrad; norm backward. With ``checkpoint`` (TE's selective recomputation) forward keeps
none of the [tokens, F] activations: it saves fc1's bias and its fprop operand (W1 as fprop reads it) and the
norm's input, and backward recomputes norm -> cast -> fc1 -> act -> cast (not fc2) with forward's scales
(``Quantizer.for_recompute``), the same values bit for bit. Peak memory: when the backward frees its graph (the usual
``retain_graph=False``), act(h)^T goes after fc2's wgrad, dh is written over h and h goes once dh is
cast, so the [tokens, F]-sized tensors never pile up.
Tensor / sequence parallelism: fc1 is column-parallel (``args.fc1_comm``), fc2 row-parallel
(``args.fc2_comm``), called at the marked points (``# comm``), see :mod:`..parallel.linear_comm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._functions.activation import ActivationConfig
from ..parallel.linear_comm import LinearComm
from .._functions.common import (
    Operand, backward_frees_graph, cast, for_backward, grad_output_operand, no_torch_autocast, release, rows_of, save, saved,
    unflatten, without_operands,
)
from .._functions.fp8_meta import ForwardQuantization
from .._functions.gemm import WgradTarget, fprop_with_comm, linear_backward
from .._functions.wgrad_store import backward_batch
from ._layernorm_linear_function import norm_then_quantize
from .._functions.norm import NormConfig, norm_backward

__all__ = ["LayerNormMLPArgs", "LayerNormMLPFunction"]


@dataclass(frozen=True)
class LayerNormMLPArgs:
    """Non-tensor arguments of :class:`LayerNormMLPFunction`; fc1 is GEMM 1, fc2 GEMM 2."""

    dtype: torch.dtype
    quantization: ForwardQuantization
    fc1_operand: Operand
    fc2_operand: Operand
    fc1_wgrad: WgradTarget
    fc2_wgrad: WgradTarget
    norm: NormConfig
    activation: ActivationConfig
    fc1_comm: LinearComm  # no default: torch 2.11's Dynamo cannot rebuild an object default of a dataclass made in a traced call
    fc2_comm: LinearComm
    return_layernorm_output: bool = False
    checkpoint: bool = False


class LayerNormMLPFunction(torch.autograd.Function):
    """y = fc2(act(fc1(norm(x)))) (and norm(x) with return_layernorm_output)."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, args: LayerNormMLPArgs):
        q, dtype, comm1, comm2 = args.quantization, args.dtype, args.fc1_comm, args.fc2_comm
        g1, g2 = q.gemms
        x = cast(rows_of(inp), dtype)
        gamma = cast(ln_weight, dtype)
        need_dw1, need_dw2 = (w.requires_grad and q.for_training for w in (fc1_weight, fc2_weight))
        with no_torch_autocast(inp.device):
            gather = comm1.pipelines_gather(g1.input)
            ln_op, ln_out, stats = norm_then_quantize(
                x, gamma, cast(ln_bias, dtype), args.norm, g1.input, dtype, return_hp=args.return_layernorm_output,
                columnwise=need_dw1 and not gather, comm=comm1.for_cast(g1.input),
            )
            w1, w2 = cast(args.fc1_operand, dtype), cast(args.fc2_operand, dtype)
            h, ln_op = fprop_with_comm(ln_op, w1, cast(fc1_bias, dtype), dtype, split_accumulator=q.split_accumulator.fprop, comm=comm1,
                                       gather=gather, columnwise=need_dw1)
            a_op, _ = g2.input.produce(args.activation.producer(h), columnwise=need_dw2)
            y, _ = fprop_with_comm(a_op, w2, cast(fc2_bias, dtype), dtype, split_accumulator=q.split_accumulator.fprop, comm=comm2,
                                   gather=False, columnwise=False)
            w1_t, w2_t = (for_backward(w) if q.for_training else None for w in (w1, w2))
            if args.checkpoint and q.for_training:  # recomputed in backward from the norm's input (see the module docstring)
                ctx.recompute = (g1.input.for_recompute(), g2.input.for_recompute(), need_dw1, need_dw2)
                save(ctx, x, gamma, None, w1_t, None, None, w2_t, cast(ln_bias, dtype), cast(fc1_bias, dtype), w1, *stats)
            else:
                save(ctx, x, gamma, for_backward(ln_op) if need_dw1 else None, w1_t, h,
                     for_backward(a_op) if need_dw2 else None, w2_t, None, None, None, *stats)
        ctx.args = without_operands(args, "fc1_operand", "fc2_operand")
        ctx.dtypes = (inp.dtype, ln_weight.dtype) + tuple(None if t is None else t.dtype for t in (ln_bias, fc1_bias, fc2_bias))
        ctx.inp_shape = inp.shape
        y = unflatten(y, inp.shape)
        return (y, ln_out.reshape(inp.shape)) if args.return_layernorm_output else y

    @staticmethod
    def backward(ctx, dy, *d_ln_out):
        args, needs = ctx.args, ctx.needs_input_grad
        q, dtype, comm1, comm2 = args.quantization, args.dtype, args.fc1_comm, args.fc2_comm
        g1, g2 = q.gemms
        inp_dtype, gamma_dtype, beta_dtype, b1_dtype, b2_dtype = ctx.dtypes
        x, gamma, ln_op, w1, h, a_op, w2, beta, b1, w1_fprop, *stats = saved(ctx)
        frees_graph = backward_frees_graph()
        amaxes = []  # of the traced grad casts, for the update
        with no_torch_autocast(dy.device), backward_batch(args.fc1_wgrad.delayed):
            if args.checkpoint:
                ln_op, h, a_op = _recompute(x, gamma, beta, w1_fprop, b1, args, ctx.recompute)
            dy_hp = cast(rows_of(dy), dtype)
            dy_op, db2, gather_dy = grad_output_operand(g2.grad_output, dy_hp, comm2, need_dw=needs[5],  # comm
                                                        db_dtype=b2_dtype if needs[6] else None, amaxes=amaxes)
            da, dw2 = linear_backward(dy_op, a_op, w2, (True, needs[5]), args.fc2_wgrad, q.split_accumulator, dtype,
                                      release_wgrad_operands=frees_graph, comm=comm2, gather_dy=gather_dy)  # comm
            db2 = comm2.reduce_bias_grad(db2)  # comm
            del dy_op, dy_hp
            dh = args.activation.backward(da, h, overwrite_h=frees_graph)
            del da
            dh_op, db1, gather_dh = grad_output_operand(g1.grad_output, dh, comm1, need_dw=needs[3],  # comm
                                                        db_dtype=b1_dtype if needs[4] else None, amaxes=amaxes)
            if frees_graph and dh_op is not dh:  # dh is cast: h's storage goes (the saved h would keep it)
                release(dh, owned=True)
            del dh
            d_ln, dw1 = linear_backward(dh_op, ln_op, w1, (True, needs[3]), args.fc1_wgrad, q.split_accumulator, dtype,
                                        release_wgrad_operands=frees_graph, comm=comm1, gather_dy=gather_dh)  # comm
            del dh_op
            if args.return_layernorm_output:
                d_ln = d_ln + cast(d_ln_out[0].reshape(d_ln.shape), dtype)
            dx, dgamma, dbeta = norm_backward(d_ln, x, tuple(stats), gamma, args.norm)
            dgamma, dbeta = comm1.reduce_norm_grads(dgamma, dbeta)  # comm
        if q.backward_update is not None:
            q.backward_update(amaxes)
        return (cast(dx.view(*ctx.inp_shape), inp_dtype), cast(dgamma, gamma_dtype), cast(dbeta, beta_dtype),
                dw1, cast(db1, b1_dtype), dw2, cast(db2, b2_dtype), None)


def _recompute(x, gamma, beta, w1, b1, args: LayerNormMLPArgs, recompute):
    """(norm output's wgrad operand, h, act(h)'s wgrad operand) as forward made them: the norm and its cast, fc1's
    fprop and the activation's cast again, with forward's scales (no tensor parallelism: the module refuses it)."""
    quantizer1, quantizer2, need_dw1, need_dw2 = recompute
    dtype, comm1 = args.dtype, args.fc1_comm
    ln_op, _, _ = norm_then_quantize(x, gamma, beta, args.norm, quantizer1, dtype, return_hp=args.return_layernorm_output,
                                     columnwise=need_dw1, comm=comm1.for_cast(quantizer1))
    h, ln_op = fprop_with_comm(ln_op, w1, b1, dtype, split_accumulator=args.quantization.split_accumulator.fprop, comm=comm1,
                               gather=False, columnwise=need_dw1)
    a_op, _ = quantizer2.produce(args.activation.producer(h), columnwise=need_dw2)
    return for_backward(ln_op) if need_dw1 else None, h, for_backward(a_op) if need_dw2 else None
