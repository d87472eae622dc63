"""What the emulated block-scaled formats (flagos/mxfp8.py, nvfp4.py, nvfp4_gemm.py) share: exact float32 / bfloat16
element helpers, the GEMM on bfloat16 tensor cores with its float32 epilogue, and the device check of their
``SUPPORTS`` predicates.

An emulated GEMM decodes each operand to values exact in bfloat16 (an FP8 or E2M1 value times its block scale), runs
``mm_f32`` (bfloat16 tensor cores, float32 output) and finishes with one epilogue launch (:func:`finish_gemm`):

    D = fp32(acc * (a_amax * c) * (b_amax * c)) + bias (+ out)      (the per-tensor factor in float64, one rounding)

with the factor only where the format has per-tensor scales (NVFP4: c = fp32(1 / 2688)); without it D = acc + bias
(+ out), in the reference's order, rounded once to D's dtype. Without the factor and ``out``, on the GPU
(:func:`unscaled_gemm`), cuBLAS writes D itself where its epilogue is that same math: a bfloat16 D (the bias, if
any, bfloat16), or a float32 D without bias: no float32 product written and read again, no epilogue launch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.core import Reject

from ._common import _tile_offsets, cdiv, device_guard
from ._launch import cached_launch

__all__ = ["finish_gemm", "mm_f32", "on_device", "unscaled_gemm"]

_EPILOGUE_TILE = (32, 128)


# -- element helpers ---------------------------------------------------------------------------------
@triton.jit
def _magnitude_bits(v):
    """int32 bit pattern of |v| (float32), NaN -> 0: ordered as |v| is (+inf counted, NaN ignored as TE's fmaxf)."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits > 0x7F800000, 0, bits)


@triton.jit
def _bf16_bits(y):
    """int32 bits of float32 y rounded to bfloat16 (nearest even; the low 16 bits zero, NaN -> 0x7FC00000)."""
    bits = y.to(tl.int32, bitcast=True)
    return tl.where(y == y, (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536, 0x7FC00000)


@triton.jit
def _to_float32(x):
    """Loaded x as float32, exactly. bfloat16 is widened on its bits, here and in _store_rounded narrowed on
    them: the interpreter's bfloat16 casts truncate and mishandle subnormals, the GPU's are exact."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _store_rounded(ptrs, x, mask):
    """Store float32 x at ``ptrs`` in their dtype, rounded to nearest even."""
    ty: tl.constexpr = ptrs.dtype.element_ty
    if ty == tl.bfloat16:
        tl.store(ptrs, (_bf16_bits(x) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x.to(ty), mask=mask)


@cached_launch
@triton.jit
def _epilogue_kernel(
    acc_ptr,  # *float32 [M, N], contiguous: the product of the decoded operands
    a_amax_ptr,  # *float32, one element (unused without SCALED)
    b_amax_ptr,  # *float32, one element (unused without SCALED)
    bias_ptr,  # *bias [N] (unused without HAS_BIAS)
    out_ptr,  # *out [M, N], strides (stride_om, stride_on): receives D (and holds the addend with ACCUMULATE)
    M,  # rows of D
    N,  # columns of D
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    BM: tl.constexpr,
    BN: tl.constexpr,
    SCALED: tl.constexpr,
    AMAX_FACTOR: tl.constexpr,  # c of the per-tensor factor (a_amax * c) * (b_amax * c), a float32 value (with SCALED)
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """D = fp32(acc * factor) (SCALED) + bias (+ out), rounded once to out's dtype (see the module docstring)."""
    rows, cols, mask = _tile_offsets(tl.program_id(0), M, N, BM, BN)
    d = tl.load(acc_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    if SCALED:
        factor = (tl.load(a_amax_ptr).to(tl.float64) * AMAX_FACTOR) * (tl.load(b_amax_ptr).to(tl.float64) * AMAX_FACTOR)
        d = (d.to(tl.float64) * factor).to(tl.float32)
    if HAS_BIAS:
        d = d + _to_float32(tl.load(bias_ptr + cols, mask=cols < N, other=0.0))[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    if ACCUMULATE:
        d = d + _to_float32(tl.load(out_ptrs, mask=mask, other=0.0))
    _store_rounded(out_ptrs, d, mask)


# -- host side ----------------------------------------------------------------------------------------
def mm_f32(v_a: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """v_a @ v_b^T in float32 from bfloat16 operands: cuBLAS with float32 output on the GPU (tensor cores,
    float32 accumulation), a float32 GEMM elsewhere (the interpreter's CPU)."""
    if v_a.is_cuda:
        return torch.mm(v_a, v_b.t(), out_dtype=torch.float32)
    return torch.mm(v_a.float(), v_b.float().t())


def unscaled_gemm(v_a: torch.Tensor, v_b: torch.Tensor, result: torch.Tensor, *, bias: Optional[torch.Tensor],
                  accumulate: bool) -> None:
    """result = v_a @ v_b^T + bias (+ result when ``accumulate``) from bfloat16 operands, float32 accumulation, one
    rounding to result's dtype: one cuBLAS call on the GPU where its epilogue does exactly that (bfloat16 result
    with no bias or a bfloat16 one: cuBLASLt adds the bias to the float32 accumulator before the rounding; float32
    result without bias), else :func:`mm_f32` and :func:`finish_gemm`."""
    if v_a.is_cuda and not accumulate:
        if result.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
            if bias is None:
                torch.mm(v_a, v_b.t(), out=result)
            else:
                torch.addmm(bias, v_a, v_b.t(), out=result)
            return
        if result.dtype == torch.float32 and bias is None:
            torch.mm(v_a, v_b.t(), out_dtype=torch.float32, out=result)
            return
    finish_gemm(mm_f32(v_a, v_b), result, bias=bias, accumulate=accumulate)


def finish_gemm(acc: torch.Tensor, result: torch.Tensor, *, bias: Optional[torch.Tensor], accumulate: bool,
                amaxes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, amax_factor: float = 1.0) -> None:
    """result = fp32(acc * (a_amax * c) * (b_amax * c)) (with ``amaxes``, c = ``amax_factor``) + bias (+ result when
    ``accumulate``), cast to result's dtype: one launch."""
    (m, n), (tile_m, tile_n) = acc.shape, _EPILOGUE_TILE
    a_amax, b_amax = amaxes if amaxes is not None else (acc, acc)
    with device_guard(acc):
        _epilogue_kernel[(cdiv(m, tile_m) * cdiv(n, tile_n),)](
            acc, a_amax, b_amax, acc if bias is None else bias, result, m, n, result.stride(0), result.stride(1),
            BM=tile_m, BN=tile_n, SCALED=amaxes is not None, AMAX_FACTOR=float(amax_factor), HAS_BIAS=bias is not None,
            ACCUMULATE=bool(accumulate), num_warps=4,
        )  # fmt: skip


# -- what the emulations decline -----------------------------------------------------------------
def on_device(device, **tensors):
    """True when every tensor given is on ``device``, else a Reject naming the first that is not."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            return Reject(f"{name} is on {t.device}, x / the operands on {device}: the flagos kernels read it there")
    return True
