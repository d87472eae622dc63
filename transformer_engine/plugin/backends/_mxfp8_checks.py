"""Argument checks of the MXFP8 ops (plugin/catalog/mxfp8.py), shared by the reference and flagos backends.

Raised before any work, naming the value and the rule; a backend that implements an MXFP8 op calls these so
that its errors are the reference's.
"""

from __future__ import annotations

import torch

from transformer_engine.plugin.backends._checks import check_gemm_output, gemm_result_dtype
from transformer_engine.plugin.backends._fp8 import check_bool, check_fp8_dtype, check_high_precision, check_tensor, is_fp8

__all__ = ["MXFP8_BLOCK", "check_gemm_mxfp8", "check_mxfp8_operand", "check_quantize_mxfp8"]

#: elements per MXFP8 block (OCP MX v1.0; TE's MXFP8_BLOCK_SCALING_SIZE)
MXFP8_BLOCK = 32


def _check_aligned(x: torch.Tensor, dim: int, copy: str) -> None:
    size = x.shape[dim]
    if size % MXFP8_BLOCK:
        which = "last" if dim == 1 else "first"
        raise ValueError(
            f"MXFP8 {copy} copy of x with shape {tuple(x.shape)}: its {which} dim ({size}) must be divisible by {MXFP8_BLOCK} "
            f"(one E8M0 scale per {MXFP8_BLOCK} consecutive elements along it, as in NVIDIA TE); pad it to a multiple of {MXFP8_BLOCK}"
        )


def check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise) -> None:
    """The arguments of ``quantize_mxfp8``: x a 2-D float32/bfloat16/float16 tensor, an FP8 dtype, bool flags (at least
    one set), N % 32 == 0 for the row-wise copy and M % 32 == 0 for the column-wise one."""
    check_high_precision(x)
    if x.dim() != 2:
        raise ValueError(f"quantize_mxfp8 takes a 2-D x [M, N], got shape {tuple(x.shape)}; reshape it to 2-D first")
    check_fp8_dtype(fp8_dtype)
    check_bool(rowwise, "rowwise")
    check_bool(columnwise, "columnwise")
    if not (rowwise or columnwise):
        raise ValueError("quantize_mxfp8 with rowwise=False and columnwise=False writes nothing; ask for at least one copy")
    if rowwise:
        _check_aligned(x, 1, "row-wise")
    if columnwise:
        _check_aligned(x, 0, "column-wise")


def check_mxfp8_operand(q, scale_e8m0, name: str) -> None:
    """One MXFP8 operand: q FP8 [M, K] with K % 32 == 0, scale_e8m0 uint8 [M, K / 32] (biased exponents)."""
    check_tensor(q, name)
    if not is_fp8(q):
        raise TypeError(f"{name} has dtype {q.dtype}; it must be FP8 (torch.float8_e4m3fn or torch.float8_e5m2)")
    if q.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(q.shape)}")
    check_tensor(scale_e8m0, f"{name} scale")
    if scale_e8m0.dtype != torch.uint8:
        raise TypeError(f"the E8M0 scale of {name} has dtype {scale_e8m0.dtype}; it must be torch.uint8 (biased exponents)")
    m, k = q.shape
    if k % MXFP8_BLOCK or tuple(scale_e8m0.shape) != (m, k // MXFP8_BLOCK):
        raise ValueError(
            f"{name} {tuple(q.shape)} with E8M0 scales {tuple(scale_e8m0.shape)}: MXFP8 needs K % {MXFP8_BLOCK} == 0 and "
            f"scales [{m}, K / {MXFP8_BLOCK}]"
        )


def _check_gemm_shapes(a, b, bias, out) -> None:
    """ValueError unless a [M, K] and b [N, K] share K, bias is [N] and out [M, N]."""
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"gemm_mxfp8 inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (D = A @ B^T "
                         f"reads both along K); quantize both operands along the same K")
    check_gemm_output(m, n, bias, out)


def check_gemm_mxfp8(a, b, a_scale_e8m0, b_scale_e8m0, out_dtype, bias, out, accumulate) -> torch.dtype:
    """The arguments of ``gemm_mxfp8`` (both operands, accumulate / out / out_dtype, the shapes); returns D's dtype.

    D's dtype is out_dtype, else out's dtype, else float32; accumulate needs out; bias is [N], out [M, N].
    """
    check_mxfp8_operand(a, a_scale_e8m0, "a")
    check_mxfp8_operand(b, b_scale_e8m0, "b")
    dtype = gemm_result_dtype(out_dtype, out, accumulate, default=torch.float32)
    _check_gemm_shapes(a, b, bias, out)
    return dtype
