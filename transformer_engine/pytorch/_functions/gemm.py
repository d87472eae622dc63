"""The three GEMMs of a linear layer on high-precision or FP8 operands, and its shared backward.

    fprop  y  = x @ W^T + b      gemm(x, W, trans_b=True)
    dgrad  dx = dy @ W           gemm(dy, W)
    wgrad  dW = dy^T @ x         gemm(dy, x, trans_a=True)      (accumulated into main_grad when fused)
    bgrad  db = sum_rows(dy)

An FP8 operand is a :class:`Float8Tensor`; the GEMM receives its data and scale_inv. Outputs are in
the activation dtype (weight gradients in the parameter dtype).

Layout: FP8 GEMMs on Hopper read both operands along K ("TN": op(a) row-major, op(b) column-major).
When an FP8 operand carries its transpose ``data_t``, :func:`gemm` passes whichever of ``data`` /
``data_t`` gives that layout (op(t) is the same matrix either way), so dgrad reads W^T and wgrad reads
dy^T and x^T as stored instead of having the backend transpose them per call. Block-scaled operands
(:class:`Float8BlockwiseTensor`) go to ``ops.gemm_blockwise``, which reads both operands along K only:
each side passes the copy quantized along K (``data`` or ``data_t``). MXFP8 operands
(:class:`MXFP8Tensor`, a block-scaled operand of 1 x 32 blocks with E8M0 scales) take the same path
to ``ops.gemm_mxfp8`` (emulated by the reference backend: dequantize, then a float32 GEMM), and NVFP4 operands
(:class:`NVFP4Tensor`: packed E2M1 values, E4M3 block scales, an amax per copy) to ``ops.gemm_nvfp4`` (emulated alike).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from transformer_engine.plugin import ops

from ..parallel.linear_comm import NO_COMM, LinearComm
from ..quantization.float8_blockwise_tensor import Float8BlockwiseTensor
from ..quantization.float8_tensor import DeferredTranspose, Float8Tensor
from ..quantization.mxfp8_tensor import MXFP8Tensor
from ..quantization.nvfp4_tensor import NVFP4Tensor
from ..quantization.recipe_state import SplitAccumulator
from .common import Operand, no_torch_autocast, release
from .wgrad_store import WeightGradStore

__all__ = ["WgradTarget", "dgrad", "fprop", "fprop_with_comm", "gemm", "linear_backward"]


def _stored(t: Operand, trans: bool, want_trans: bool):
    """(tensor, trans flag, scale_inv) for op(t): an FP8 operand stored both ways gives the one whose flag is ``want_trans``."""
    if not isinstance(t, Float8Tensor):
        return t, trans, None
    if t.data_t is not None and (trans != want_trans or t.data is None):
        return t.data_t, not trans, t.scale_inv
    return t.data, trans, t.scale_inv


def gemm(a: Operand, b: Operand, *, trans_a=False, trans_b=False, bias=None, out_dtype=None, out=None,
         accumulate=False, split_accumulator=True) -> torch.Tensor:
    """ops.gemm on operands that may be FP8: D = op(a) @ op(b) + bias, in the TN layout where the operands allow."""
    if isinstance(a, Float8BlockwiseTensor) or isinstance(b, Float8BlockwiseTensor):
        return _gemm_blockwise(a, b, trans_a=trans_a, trans_b=trans_b, bias=bias, out_dtype=out_dtype, out=out, accumulate=accumulate)
    a_data, trans_a, a_scale_inv = _stored(a, trans=trans_a, want_trans=False)
    b_data, trans_b, b_scale_inv = _stored(b, trans=trans_b, want_trans=True)
    return ops.gemm(a_data, b_data, bias=bias, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, trans_a=trans_a, trans_b=trans_b,
                    out_dtype=out_dtype, out=out, accumulate=accumulate, use_split_accumulator=split_accumulator)


def _gemm_blockwise(a: Operand, b: Operand, trans_a: bool, trans_b: bool, bias, out_dtype, out, accumulate) -> torch.Tensor:
    """D = op(a) @ op(b) + bias as ``ops.gemm_blockwise(A, B)`` with A = op(a) and B = op(b)^T, both along K.

    MXFP8 operands go to ``ops.gemm_mxfp8`` (the same A and B, E8M0 scales), NVFP4 operands to ``ops.gemm_nvfp4``
    (packed E2M1 values, E4M3 scales and each copy's amax).

    Raises:
        TypeError: the operands are not of one block-scaled kind (a module quantizes both with one recipe).
    """
    if type(a) is not type(b):  # one of them is block-scaled (gemm's test): the other must be of its kind
        raise TypeError(f"a block-scaled GEMM needs two block-scaled operands of one kind, got {type(a).__name__} and {type(b).__name__}")
    dtype = out_dtype if out_dtype is not None else out.dtype
    if type(a) is NVFP4Tensor:
        a_data, a_scale, a_amax = a.nvfp4_operand(transposed=trans_a)
        b_data, b_scale, b_amax = b.nvfp4_operand(transposed=not trans_b)
        return ops.gemm_nvfp4(a_data, b_data, a_scale=a_scale, b_scale=b_scale, a_amax=a_amax, b_amax=b_amax, out_dtype=dtype,
                              bias=bias, out=out, accumulate=accumulate, a_e4m3_max=a.e4m3_max, b_e4m3_max=b.e4m3_max)
    a_data, a_scale_inv, a_block = a.gemm_operand(transposed=trans_a)
    b_data, b_scale_inv, b_block = b.gemm_operand(transposed=not trans_b)
    if type(a) is MXFP8Tensor:
        return ops.gemm_mxfp8(a_data, b_data, a_scale_e8m0=a_scale_inv, b_scale_e8m0=b_scale_inv, out_dtype=dtype, bias=bias,
                              out=out, accumulate=accumulate)
    return ops.gemm_blockwise(a_data, b_data, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, a_block=a_block, b_block=b_block,
                              out_dtype=dtype, bias=bias, out=out, accumulate=accumulate)


def fprop(x: Operand, w: Operand, bias: Optional[torch.Tensor], out_dtype: torch.dtype, split_accumulator: bool,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T + b, x [M, K], W [N, K] (written into ``out`` when given)."""
    return gemm(x, w, trans_b=True, bias=bias, out_dtype=out_dtype, out=out, split_accumulator=split_accumulator)


def fprop_with_comm(x: Operand, w: Operand, bias: Optional[torch.Tensor], out_dtype: torch.dtype, split_accumulator: bool,
                    comm: LinearComm, gather: bool, columnwise: bool) -> Tuple[torch.Tensor, Operand]:
    """(y, x as wgrad reads it): the fprop with ``comm``'s forward communication (``LinearComm.forward_gemm``).

    ``gather``: x holds this rank's rows and is all-gathered inside the GEMM; the gathered FP8 x then gets
    its transpose (``columnwise``), which a cast of the shard could not provide.
    """
    def block(rows: Operand, out: Optional[torch.Tensor], block_bias: Optional[torch.Tensor] = comm.gemm_bias(bias)) -> torch.Tensor:
        return fprop(rows, w, block_bias, out_dtype, split_accumulator=split_accumulator, out=out)

    y, x = comm.forward_gemm(x, block, w.shape[0], out_dtype, bias, gather=gather)
    if gather and columnwise and isinstance(x, Float8Tensor):
        x = x.with_transpose()
    return y, x


def dgrad(dy: Operand, w: Union[Operand, DeferredTranspose], out_dtype: torch.dtype, split_accumulator: bool,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dx = dy @ W, dy [M, N], W [N, K] (a deferred W^T is cast now and dropped after this GEMM; into ``out`` when given)."""
    if isinstance(w, DeferredTranspose):
        w = w.materialize()
    return gemm(dy, w, out_dtype=out_dtype, out=out, split_accumulator=split_accumulator)


@dataclass(frozen=True)
class WgradTarget:
    """Where a weight gradient goes.

    Attributes:
        dtype: dtype of the returned gradient (the parameter's).
        main_grad_params: with ``fuse_wgrad_accumulation``, the parameters whose ``main_grad`` receive
            dW (split along dim 0 when the weight is several concatenated parameters); else empty.
        delayed: with ``delay_wgrad_compute``, the module's queue: backward queues dW there, which later goes to
            ``main_grad_params`` or, without them, into the ``.grad`` of ``params`` (see :mod:`.wgrad_store`).
        params: the weight parameters (for a delayed dW without ``main_grad_params``).
    """

    dtype: torch.dtype
    main_grad_params: Tuple[torch.nn.Parameter, ...] = ()
    delayed: Optional[WeightGradStore] = None
    params: Tuple[torch.nn.Parameter, ...] = ()


def _wgrad(dy: Operand, x: Operand, target: WgradTarget, split_accumulator: bool) -> Optional[torch.Tensor]:
    """dW = dy^T @ x, returned, or accumulated into main_grad (returning TE's placeholder or None)."""
    params = target.main_grad_params
    if not params:
        return gemm(dy, x, trans_a=True, out_dtype=target.dtype, split_accumulator=split_accumulator)
    if len(params) == 1:
        gemm(dy, x, trans_a=True, out=params[0].main_grad, accumulate=True, split_accumulator=split_accumulator)
    else:
        dw = gemm(dy, x, trans_a=True, out_dtype=torch.float32, split_accumulator=split_accumulator)
        for param, part in zip(params, dw.split([p.shape[0] for p in params])):
            param.main_grad.add_(part)
    return _main_grad_placeholder(params)


def _delayed_wgrad(dy: Operand, x: Operand, target: WgradTarget, split_accumulator: bool) -> None:
    """A queued wgrad: dW = dy^T @ x into main_grad, or added to the weight parameters' ``.grad`` (split along dim 0
    as they are), as autograd would have added it."""
    with torch.no_grad(), no_torch_autocast(target.params[0].device):
        dw = _wgrad(dy, x, target, split_accumulator=split_accumulator)
    if target.main_grad_params:
        return
    with torch.no_grad():
        for param, part in zip(target.params, dw.split([p.shape[0] for p in target.params])):
            param.grad = part.clone() if param.grad is None else param.grad.add_(part)


def _main_grad_placeholder(params) -> Optional[torch.Tensor]:
    """TE's convention: parameters flagged ``grad_added_to_main_grad`` get a dummy grad (zeros if ``zero_out_wgrad``)."""
    if not all(hasattr(p, "grad_added_to_main_grad") for p in params):
        return None
    for p in params:
        p.grad_added_to_main_grad = True
    rows = sum(p.shape[0] for p in params)
    shape = (rows,) + tuple(params[0].shape[1:])
    make = torch.zeros if getattr(params[0], "zero_out_wgrad", False) else torch.empty
    return make(shape, dtype=params[0].dtype, device=params[0].device)


def linear_backward(dy_op: Operand, x: Operand, w: Union[Operand, DeferredTranspose], need: Tuple[bool, bool],
                    target: WgradTarget, split_accumulator: SplitAccumulator, dx_dtype: torch.dtype,
                    release_wgrad_operands: bool = False, comm: LinearComm = NO_COMM, gather_dy: bool = False):
    """(dx, dW) of y = x @ W^T + b; each is None when ``need`` (dx, dW) says so (db comes with dy's cast).

    dx comes back summed over the ranks where ``comm`` says so (column-parallel). Without pipelined
    communication wgrad runs first, so that with ``release_wgrad_operands`` the saved FP8 x^T and dy's
    FP8 transpose (the copies only wgrad reads) are freed before dgrad allocates dx. With it
    (``gather_dy``: dy holds this rank's rows and is all-gathered inside the dgrad, see
    ``LinearComm.pipelines_grad_gather``; or ``comm.pipelines_dgrad``) dgrad runs first, then wgrad
    on the gathered dy (its FP8 transpose made after the gather).

    Args:
        dy_op: dy as GEMM operand (FP8 or high precision), [M, N].
        x, w: the forward operands saved for backward.
        need: which of dx, dW are needed.
        target: where dW goes.
        split_accumulator: of the fprop, dgrad and wgrad GEMMs.
        dx_dtype: dtype of dx (the activation dtype).
        release_wgrad_operands: free those copies once wgrad has read them (a backward that frees its graph, see ``release``).
        comm: the linear's tensor-parallel communication.
        gather_dy: see above.
    """
    need_dx, need_dw = need
    dx = None
    if gather_dy or (need_dx and comm.pipelines_dgrad):
        if need_dx:
            w = w.materialize() if isinstance(w, DeferredTranspose) else w

            def block(rows: Operand, out: Optional[torch.Tensor], bias=None) -> torch.Tensor:
                return dgrad(rows, w, dx_dtype, split_accumulator=split_accumulator.dgrad, out=out)

            dx, dy_op = comm.dgrad_gemm(dy_op, block, w.shape[1], dx_dtype, gather=gather_dy)  # comm
        else:
            dy_op = comm.gather_grad_output(dy_op)  # comm
        if gather_dy and need_dw and isinstance(dy_op, Float8Tensor):
            dy_op = dy_op.with_transpose()
    dw = None
    if need_dw and target.delayed is not None:  # queued: dy and x live until backward_dw
        target.delayed.put(functools.partial(_delayed_wgrad, dy_op, x, target, split_accumulator=split_accumulator.wgrad))
        dw = _main_grad_placeholder(target.main_grad_params) if target.main_grad_params else None
    elif need_dw:
        dw = _wgrad(dy_op, x, target, split_accumulator=split_accumulator.wgrad)
    if release_wgrad_operands and target.delayed is None:
        release(x)
        release(dy_op, transpose_only=True)
    if need_dx and dx is None:
        dx = comm.reduce_grad_input(dgrad(dy_op, w, dx_dtype, split_accumulator=split_accumulator.dgrad))  # comm
    return dx, dw
