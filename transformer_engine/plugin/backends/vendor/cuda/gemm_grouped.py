"""Grouped GEMMs of a mixture-of-experts layer on CUDA. See plugin/catalog/gemm.py for the contract.

    gemm_grouped        D[rows of g] = a_g @ b[g]^T (+ bias[g])          a [M, K], b [G, N, K]
    gemm_grouped_wgrad  D[g] = a_t[:, cols of g] @ b_t[:, cols of g]^T   a_t [N, M], b_t [K, M]

Paths:
- E4M3 x E4M3 into bfloat16 without bias, on compute capability 9.0, every split non-empty and a multiple of
  16: one launch of ``torch._scaled_grouped_mm`` (CUTLASS). It scales rows and columns (row-wise scaling), so
  the per-split scale_inv values are spread over the rows of a and the columns of b; the products equal the
  per-split ``torch._scaled_mm`` calls bit for bit on an H100 (probe, 2026-11-27). It takes no E5M2 operand (the
  gradients of DelayedScaling's default HYBRID format), writes bfloat16 only and adds no bias (the contract adds
  the bias in float32 before the one rounding, as cuBLASLt's epilogue does).
- Anything else cuBLASLt's ``gemm`` takes: that GEMM per split, written into slices of one output (E5M2, a bias,
  misaligned or empty splits, other devices, high precision).
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.plugin.backends._splits import split_bounds, split_ends, split_of_rows
from transformer_engine.plugin.core import Reject

from ..._checks import check_gemm_grouped, check_gemm_grouped_wgrad
from .gemm import _capability_of, _fits_lt, _gemm, _require, _supports_gemm

__all__ = ["gemm_grouped", "gemm_grouped_wgrad"]

GROUPED_CAPABILITY = (9, 0)  # torch's CUTLASS grouped FP8 GEMM: sm_90 only
_ALIGN = 16


def _one_launch(a: torch.Tensor, b: torch.Tensor, m_splits, dtype: torch.dtype, bias=None) -> bool:
    """True when ``torch._scaled_grouped_mm`` takes the call (see the module docstring)."""
    return (a.dtype == b.dtype == torch.float8_e4m3fn and dtype == torch.bfloat16 and bias is None
            and hasattr(torch, "_scaled_grouped_mm") and _capability_of(a) == GROUPED_CAPABILITY
            and all(m > 0 and m % _ALIGN == 0 for m in m_splits))


def _aligned(scale_inv: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """scale_inv [G] with each value on its own 16 bytes (cuBLASLt refuses a misaligned 0-d scale pointer)."""
    if scale_inv is None or (scale_inv.stride(0) % 4 == 0 and scale_inv.data_ptr() % 16 == 0):
        return scale_inv
    return torch.empty((scale_inv.shape[0], 4), dtype=torch.float32, device=scale_inv.device)[:, 0].copy_(scale_inv)


def _at(scale_inv: Optional[torch.Tensor], g: int) -> Optional[torch.Tensor]:
    return None if scale_inv is None else scale_inv[g]


def gemm_grouped(a, b, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, bias=None, use_split_accumulator=True):
    """D[rows of g] = a_g @ b[g]^T (+ bias[g]) on cuBLASLt / CUTLASS.

    Raises:
        NotImplementedError: arguments this backend declines (``SUPPORTS``).
    """
    _require(_supports_gemm_grouped(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias), "gemm_grouped")
    return _gemm_grouped(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias, use_split_accumulator)


def _gemm_grouped(a, b, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, bias=None, use_split_accumulator=True):
    dtype = out_dtype or a.dtype
    if _one_launch(a, b, m_splits, dtype, bias):
        groups, n, _ = b.shape
        return torch._scaled_grouped_mm(
            a, b.transpose(-2, -1), scale_a=a_scale_inv[split_of_rows(m_splits, a.device)],
            scale_b=b_scale_inv[:, None].expand(groups, n).contiguous(), offs=split_ends(m_splits, a.device),
            out_dtype=dtype, use_fast_accum=not use_split_accumulator,
        )  # fmt: skip
    d = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    products = [(g, a[start:stop], b[g], d[start:stop]) for g, (start, stop) in enumerate(split_bounds(m_splits)) if stop > start]
    _per_split(products, a_scale_inv, b_scale_inv, bias, dtype, use_split_accumulator)
    return d


def _per_split(products, a_scale_inv, b_scale_inv, bias, dtype, use_split_accumulator) -> None:
    """out_g = a_g @ b_g^T (+ bias[g]) for each (g, a_g, b_g, out_g) of ``products``.

    FP8 operands that cuBLASLt reads as they lie (a_g row-major, b_g^T column-major, 16-byte aligned: the slices of
    a grouped layer's operands) go to ``torch._scaled_mm`` straight, writing each out_g in place; anything else
    goes through :func:`~.gemm.gemm`'s path (layout copies, a float32 tail for the bias).
    """
    a_scale_inv, b_scale_inv = _aligned(a_scale_inv), _aligned(b_scale_inv)
    if products and _lies_as_cublaslt_reads(products[0][1], products[0][2], bias, dtype):
        for g, a_g, b_g, out_g in products:
            torch._scaled_mm(a_g, b_g.t(), scale_a=a_scale_inv[g], scale_b=b_scale_inv[g], bias=None if bias is None else bias[g],
                             out_dtype=dtype, use_fast_accum=not use_split_accumulator, out=out_g)
        return
    for g, a_g, b_g, out_g in products:
        _gemm(a_g, b_g, bias=None if bias is None else bias[g], a_scale_inv=_at(a_scale_inv, g), b_scale_inv=_at(b_scale_inv, g),
              trans_b=True, out_dtype=dtype, out=out_g, use_split_accumulator=use_split_accumulator)


def _lies_as_cublaslt_reads(a_g: torch.Tensor, b_g: torch.Tensor, bias, dtype: torch.dtype) -> bool:
    """True for FP8 operands laid out as cuBLASLt's "TN" GEMM reads them (the first split stands for all: the
    others are slices at offsets of whole rows or of 16 columns) and a bias its epilogue adds in float32."""
    return (a_g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and a_g.stride(1) == 1 and b_g.stride(1) == 1
            and _fits_lt(a_g, a_g.stride(0), a_g.size(1)) and _fits_lt(b_g, b_g.stride(0), b_g.size(1))
            and (bias is None or (bias.dtype == dtype and dtype != torch.float32)))


def gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, use_split_accumulator=True):
    """D[g] = a_t[:, cols of g] @ b_t[:, cols of g]^T on cuBLASLt / CUTLASS.

    Raises:
        NotImplementedError: arguments this backend declines (``SUPPORTS``).
    """
    _require(_supports_gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv, b_scale_inv, out_dtype), "gemm_grouped_wgrad")
    return _gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv, b_scale_inv, out_dtype, use_split_accumulator)


def _gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, use_split_accumulator=True):
    dtype = out_dtype or a_t.dtype
    (n, _), k = a_t.shape, b_t.shape[0]
    if _one_launch(a_t, b_t, m_splits, dtype):
        groups = len(m_splits)
        return torch._scaled_grouped_mm(
            a_t, b_t.t(), scale_a=a_scale_inv[:, None].expand(groups, n).reshape(-1),
            scale_b=b_scale_inv[:, None].expand(groups, k).reshape(-1), offs=split_ends(m_splits, a_t.device),
            out_dtype=dtype, use_fast_accum=not use_split_accumulator,
        )  # fmt: skip
    d = torch.empty((len(m_splits), n, k), dtype=dtype, device=a_t.device)
    bounds = split_bounds(m_splits)
    for g in (g for g, (start, stop) in enumerate(bounds) if stop == start):
        d[g].zero_()
    products = [(g, a_t[:, start:stop], b_t[:, start:stop], d[g]) for g, (start, stop) in enumerate(bounds) if stop > start]
    _per_split(products, a_scale_inv, b_scale_inv, None, dtype, use_split_accumulator)
    return d


def _contract_reason(check, *args) -> Optional[str]:
    """Why ``check`` (the op's contract in ``_checks.py``) refuses the arguments, or None."""
    try:
        check(*args)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _per_split_reason(a_slice, b_slice, a_scale_inv, b_scale_inv, out_dtype, bias_row) -> Optional[str]:
    """Why ``gemm`` would decline one split's product (the first split stands for all: same dtypes, same K and N)."""
    probe = _supports_gemm(a_slice, b_slice, bias_row, _at(a_scale_inv, 0), _at(b_scale_inv, 0), trans_b=True, out_dtype=out_dtype)
    return None if probe else probe.reason


def _supports_gemm_grouped(a, b, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, bias=None, use_split_accumulator=True):
    """True, or a Reject saying why this backend declines the call."""
    if not (getattr(a, "is_cuda", False) and getattr(b, "is_cuda", False)):
        return Reject("operands are not on a CUDA device")
    reason = _contract_reason(check_gemm_grouped, a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias)
    if reason is None:
        reason = _per_split_reason(a[: _ALIGN], b[0], a_scale_inv, b_scale_inv, out_dtype, None if bias is None else bias[0])
    return Reject(reason) if reason else True


def _supports_gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv=None, b_scale_inv=None, out_dtype=None, use_split_accumulator=True):
    """True, or a Reject saying why this backend declines the call (a split not a multiple of 16 columns: cuBLASLt
    needs 16-byte aligned base pointers)."""
    if not (getattr(a_t, "is_cuda", False) and getattr(b_t, "is_cuda", False)):
        return Reject("operands are not on a CUDA device")
    reason = _contract_reason(check_gemm_grouped_wgrad, a_t, b_t, m_splits, a_scale_inv, b_scale_inv, out_dtype)
    if reason is None and any(m % _ALIGN for m in m_splits):
        reason = f"every split must be a multiple of {_ALIGN} columns (16-byte aligned operands), got {list(m_splits)}"
    if reason is None:
        reason = _per_split_reason(a_t[:, :_ALIGN], b_t[:, :_ALIGN], a_scale_inv, b_scale_inv, out_dtype, None)
    return Reject(reason) if reason else True


SUPPORTS = {"gemm_grouped": _supports_gemm_grouped, "gemm_grouped_wgrad": _supports_gemm_grouped_wgrad}
DISPATCHED = {"gemm_grouped": _gemm_grouped, "gemm_grouped_wgrad": _gemm_grouped_wgrad}
