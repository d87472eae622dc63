"""cuBLAS / cuBLASLt GEMM through PyTorch. See plugin/catalog/gemm.py for the op's contract.

Math: D = op(a) @ op(b) + bias with op(t) = t^T when its ``trans_*`` flag is set, accumulated in
float32; FP8 operands are dequantized by their per-tensor scales,
D = (a_scale_inv * b_scale_inv) * (a_fp8 @ b_fp8) + bias, and with ``accumulate`` D = out + D.
(The VJP is not an op of its own: a linear layer's dgrad and wgrad are two more ``gemm`` calls.)

Paths:
- FP8 (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3) runs ``torch._scaled_mm`` (cuBLASLt, compute
  capability >= 8.9). cuBLASLt's FP8 kernels need the "TN" layout: mat1 = op(a) [M, K] row-major,
  mat2 = op(b) [K, N] column-major, K and N multiples of 16, leading dimensions 16-byte aligned.
  For row-major inputs that means a is used as is unless ``trans_a`` and b is used as is only when
  ``trans_b`` (the fprop layout, y = x W^T); any other operand gets one transposed contiguous copy.
  ``use_fast_accum = not use_split_accumulator``.
- bf16 / fp16 / fp32 run ``torch.mm`` / ``torch.addmm`` (cuBLAS, fp32 accumulation; the bias rides
  the cuBLASLt epilogue, which adds it in fp32 before the cast).
- ``gemm_blockwise`` (Float8BlockScaling) runs ``torch._scaled_mm`` with block scales (cuBLASLt >= 12.9
  on sm_90): E4M3 operands, tiles 1x128 or 128x128 with at most one operand 2-D. cuBLASLt reads 1x128
  scales column-major and 128x128 scales row-major (a copy is made only when a scale_inv comes in
  another layout); the accumulation is always the split (exact) one. The rows of 128x128 scales must
  be 16-byte aligned, which PyTorch's strides allow only for K a multiple of 512 (measured on the H200:
  K = 256 or 640 gives wrong products); other K go to the reference backend.
Whenever the bias dtype, ``out_dtype`` or ``accumulate`` do not fit those epilogues, the product is
taken in float32, the bias added in float32, then the result is cast (or added into ``out``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.plugin.backends._device import cuda_properties
from transformer_engine.plugin.core import Reject

__all__ = ["gemm", "gemm_blockwise"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_MIN_CAPABILITY = (8, 9)
_ALIGN = 16  # cuBLASLt FP8: K, N, leading dimensions and base pointers in multiples of 16 (bytes = elements)


def gemm(a, b, bias=None, a_scale_inv=None, b_scale_inv=None, trans_a=False, trans_b=False, out_dtype=None, out=None, accumulate=False,
         use_split_accumulator=True):
    """D = op(a) @ op(b) + bias on cuBLAS(Lt); FP8 operands through ``torch._scaled_mm``.

    Args: as in plugin/catalog/gemm.py.

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        NotImplementedError: arguments this backend declines (``SUPPORTS``).
    """
    _require(_supports_gemm(a, b, bias, a_scale_inv, b_scale_inv, trans_a, trans_b, out_dtype, out, accumulate), "gemm")
    return _gemm(a, b, bias, a_scale_inv, b_scale_inv, trans_a, trans_b, out_dtype, out, accumulate, use_split_accumulator)


def _require(verdict, op: str) -> None:
    """NotImplementedError when a direct call passes arguments ``SUPPORTS`` declines."""
    if not verdict:
        raise NotImplementedError(f"vendor.cuda {op}: {verdict.reason}; use the reference backend for this call")


def _gemm(a, b, bias=None, a_scale_inv=None, b_scale_inv=None, trans_a=False, trans_b=False, out_dtype=None, out=None, accumulate=False,
          use_split_accumulator=True):
    """:func:`gemm` on arguments ``_supports_gemm`` accepted (the dispatcher's entry, ``DISPATCHED``)."""
    x, y = _operands(a, b, trans_a, trans_b)
    dtype = _result_dtype(a, out_dtype, out)
    direct = None if accumulate else out  # written by the product itself where it can be
    if x.dtype in FP8_DTYPES:
        d = _mm_fp8(x, y, bias, (_scale(a_scale_inv), _scale(b_scale_inv)), dtype, accumulate, use_split_accumulator, direct)
    else:
        d = _mm_hp(x, y, bias, dtype, accumulate, direct)
    return d if d is direct else _store(d, dtype, out, accumulate)


# -- the two products ---------------------------------------------------------------------------
def _mm_fp8(x, y, bias, scales, dtype, accumulate, use_split_accumulator, out=None):
    """x @ y dequantized by ``scales`` (scale_a, scale_b in ``torch._scaled_mm``'s layout) [+ bias] in
    ``dtype`` (into a contiguous ``out`` of that dtype when given), or in fp32 when the bias or
    ``accumulate`` cannot ride the epilogue."""
    in_epilogue = bias is not None and not accumulate and bias.dtype == dtype and dtype != torch.float32
    fp32_tail = accumulate or (bias is not None and not in_epilogue)
    direct = {} if fp32_tail or out is None or not out.is_contiguous() else {"out": out}
    d = torch._scaled_mm(
        _as_row_major(x),
        _as_col_major(y),
        scale_a=scales[0],
        scale_b=scales[1],
        bias=bias if in_epilogue else None,
        out_dtype=torch.float32 if fp32_tail else dtype,
        use_fast_accum=not use_split_accumulator,
        **direct,
    )
    if bias is not None and not in_epilogue:
        d += bias.float()
    return d


def _mm_hp(x, y, bias, dtype, accumulate, out=None):
    """x @ y [+ bias] for bf16 / fp16 / fp32 operands, in ``dtype`` (into ``out`` when given) or in fp32 (see module doc)."""
    if not accumulate and dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        direct = {} if out is None else {"out": out}
        return torch.mm(x, y, **direct) if bias is None else torch.addmm(bias, x, y, **direct)
    d = torch.mm(x, y) if x.dtype == torch.float32 else torch.mm(x, y, out_dtype=torch.float32)
    if bias is not None:
        d += bias.float()
    return d


def _store(d, dtype, out, accumulate):
    """D = out + d (``accumulate``, d in fp32), else d cast to ``dtype`` (written into ``out`` if given)."""
    if accumulate:
        return out.add_(d)
    if out is not None:
        return out.copy_(d)
    return d if d.dtype == dtype else d.to(dtype)  # no call when it already is: a no-op .to costs host time


# -- layouts ------------------------------------------------------------------------------------
def _operands(a, b, trans_a, trans_b) -> Tuple[torch.Tensor, torch.Tensor]:
    """op(a) [M, K] and op(b) [K, N] as views (no copy)."""
    return (a.t() if trans_a else a), (b.t() if trans_b else b)


def _fits_lt(t: torch.Tensor, ld: int, inner: int) -> bool:
    """True when a leading dimension ``ld`` over ``inner`` elements and t's base pointer suit cuBLASLt FP8
    (traced by torch.compile, the pointer is not known: Inductor's own ``_scaled_mm`` lowering lays out
    and aligns its operands)."""
    aligned = torch.compiler.is_compiling() or t.data_ptr() % _ALIGN == 0
    return ld >= max(1, inner) and ld % _ALIGN == 0 and aligned


def _as_row_major(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] itself when row-major with an aligned leading dimension, else a contiguous copy."""
    if x.stride(1) == 1 and _fits_lt(x, x.stride(0), x.size(1)):
        return x
    return x.contiguous()


def _as_col_major(y: torch.Tensor) -> torch.Tensor:
    """y [K, N] itself when column-major with an aligned leading dimension, else a copy laid out so."""
    if y.stride(0) == 1 and _fits_lt(y, y.stride(1), y.size(0)):
        return y
    return y.t().contiguous().t()


def _scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale_inv as the float32 scalar tensor ``torch._scaled_mm`` multiplies by."""
    return scale_inv if scale_inv.dtype == torch.float32 else scale_inv.float()


def _result_dtype(a, out_dtype, out) -> Optional[torch.dtype]:
    """``out_dtype``, else ``out``'s dtype, else a's dtype (None if that is FP8: an error)."""
    if out_dtype is not None:
        return out_dtype
    if out is not None:
        return out.dtype
    return None if a.dtype in FP8_DTYPES else a.dtype


# -- what this backend declines -----------------------------------------------------------------
def _capability_of(t: torch.Tensor) -> Tuple[int, int]:
    """(major, minor) compute capability of t's CUDA device."""
    properties = cuda_properties(t.device)
    return properties.major, properties.minor


def _op_shape(shape: torch.Size, trans: bool) -> Tuple[int, int]:
    """The shape of op(t) from t's [rows, cols]: swapped when ``trans`` (no view is made)."""
    rows, cols = shape
    return (cols, rows) if trans else (rows, cols)


def _supports_gemm(a, b, bias=None, a_scale_inv=None, b_scale_inv=None, trans_a=False, trans_b=False, out_dtype=None, out=None,
                   accumulate=False, use_split_accumulator=True):
    """True, or a Reject saying why this backend declines the call: device, shapes, then dtypes.

    The dispatcher runs it before every call (then calls ``_gemm``), a direct call of :func:`gemm`
    too: it reads shapes and dtypes only (no transposed views, no device objects).
    """
    if not (getattr(a, "is_cuda", False) and getattr(b, "is_cuda", False)):
        return Reject("operands are not on a CUDA device")
    a_shape, b_shape = a.shape, b.shape
    if len(a_shape) != 2 or len(b_shape) != 2:
        return Reject(f"operands must be 2-D, got a {tuple(a_shape)} and b {tuple(b_shape)}")
    y_shape = _op_shape(b_shape, trans_b)
    dtype = _result_dtype(a, out_dtype, out)
    reason = _shape_reason(_op_shape(a_shape, trans_a), y_shape, bias, out, accumulate)
    if reason is None and out is not None and out.dtype != dtype:
        reason = f"out has dtype {out.dtype} but out_dtype is {dtype}"
    dtypes = (a.dtype, b.dtype)
    if reason is None and (dtypes[0] in FP8_DTYPES or dtypes[1] in FP8_DTYPES):
        reason = _fp8_reason(dtypes, y_shape, bias, (a_scale_inv, b_scale_inv), dtype, _capability_of(a))
    elif reason is None:
        reason = _hp_reason(dtypes, bias, dtype)
    return Reject(reason) if reason else True


def _shape_reason(x_shape, y_shape, bias, out, accumulate) -> Optional[str]:
    """op(a) [M, K] @ op(b) [K, N]; bias [N]; out [M, N] (required with ``accumulate``)."""
    (m, k), (k2, n) = x_shape, y_shape
    if k != k2:
        return f"op(a) is [{m}, {k}] but op(b) is [{k2}, {n}]: inner dimensions differ"
    if bias is not None and tuple(bias.shape) != (n,):
        return f"bias has shape {tuple(bias.shape)}, expected [{n}]"
    if accumulate and out is None:
        return "accumulate=True needs out"
    if out is not None and tuple(out.shape) != (m, n):
        return f"out has shape {tuple(out.shape)}, expected [{m}, {n}]"
    return None


def _fp8_reason(dtypes, y_shape, bias, scale_invs, dtype, capability) -> Optional[str]:
    """The FP8 path's limits: (a, b) dtype pair, scales, output dtype, op(b) [K, N] alignment, compute capability."""
    if dtypes[0] not in FP8_DTYPES or dtypes[1] not in FP8_DTYPES:
        return f"FP8 GEMM needs two FP8 operands of {FP8_DTYPES}, got {dtypes[0]} and {dtypes[1]}"
    if dtypes[0] == dtypes[1] == torch.float8_e5m2:
        return "cuBLASLt has no E5M2 x E5M2 GEMM"
    if capability < FP8_MIN_CAPABILITY:
        return f"FP8 GEMM needs compute capability >= 8.9, device has {capability[0]}.{capability[1]}"
    for scale_inv in scale_invs:
        if scale_inv is None or scale_inv.numel() != 1:
            return "FP8 operands need per-tensor (one-element) a_scale_inv and b_scale_inv"
    if dtype not in HP_DTYPES:
        return f"out_dtype {dtype} is not one of {HP_DTYPES}"
    if bias is not None and bias.dtype not in HP_DTYPES:
        return f"bias dtype {bias.dtype} is not one of {HP_DTYPES}"
    k, n = y_shape
    if k % _ALIGN or n % _ALIGN:
        return f"FP8 GEMM needs K and N multiples of {_ALIGN}, got K={k}, N={n}"
    return None


def _hp_reason(dtypes, bias, dtype) -> Optional[str]:
    """The cuBLAS path: both operands (dtypes of a, b) of one dtype in bf16 / fp16 / fp32, output in those too."""
    if dtypes[0] != dtypes[1] or dtypes[0] not in HP_DTYPES:
        return f"operands must share one dtype of {HP_DTYPES}, got {dtypes[0]} and {dtypes[1]}"
    if dtype not in HP_DTYPES:
        return f"out_dtype {dtype} is not one of {HP_DTYPES}"
    if bias is not None and bias.dtype not in HP_DTYPES:
        return f"bias dtype {bias.dtype} is not one of {HP_DTYPES}"
    return None


# -- block-scaled FP8 (Float8BlockScaling) -----------------------------------------------------
_BLOCK_1D, _BLOCK_2D = (1, 128), (128, 128)
_BLOCK_PAIRS = ((_BLOCK_1D, _BLOCK_2D), (_BLOCK_2D, _BLOCK_1D), (_BLOCK_1D, _BLOCK_1D))
BLOCK_CAPABILITY = (9, 0)  # cuBLASLt's 1x128 / 128x128 block-scaled kernels: Hopper
_BLOCK_2D_K = 512  # K / 128 float32 scales per row of a 128x128-tiled operand: a multiple of 4 (16 bytes)


def gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias=None, out=None, accumulate=False):
    """D = A @ B^T + bias on block-scaled E4M3 operands through ``torch._scaled_mm`` (cuBLASLt).

    Args: as in plugin/catalog/gemm.py.

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        NotImplementedError: arguments this backend declines (``SUPPORTS``).
    """
    _require(_supports_gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias, out, accumulate), "gemm_blockwise")
    return _gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias, out, accumulate)


def _gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias=None, out=None, accumulate=False):
    """:func:`gemm_blockwise` on arguments ``_supports_gemm_blockwise`` accepted (the dispatcher's entry)."""
    scales = (_cublas_block_scale(a_scale_inv, a_block), _cublas_block_scale(b_scale_inv, b_block).t())
    d = _mm_fp8(a, b.t(), bias, scales, out_dtype, accumulate, use_split_accumulator=True)
    return _store(d, out_dtype, out, accumulate)


def _cublas_block_scale(scale_inv: torch.Tensor, block) -> torch.Tensor:
    """scale_inv [rows, cols] laid out as cuBLASLt reads it: column-major for 1x128 tiles, row-major for 128x128."""
    if tuple(block) == _BLOCK_1D:
        return scale_inv if scale_inv.stride(0) == 1 or scale_inv.size(0) == 1 else scale_inv.t().contiguous().t()
    return scale_inv if scale_inv.stride(1) == 1 or scale_inv.size(1) == 1 else scale_inv.contiguous()


def _supports_gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias=None, out=None, accumulate=False):
    """True, or a Reject saying why cuBLASLt's block-scaled GEMM cannot take the call."""
    if not (getattr(a, "is_cuda", False) and getattr(b, "is_cuda", False)):
        return Reject("operands are not on a CUDA device")
    if a.dim() != 2 or b.dim() != 2 or a.stride(1) != 1 or b.stride(1) != 1:
        return Reject(f"operands must be row-major 2-D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return Reject(f"cuBLASLt block-scaled GEMMs take E4M3 operands only, got {a.dtype} and {b.dtype}")
    if (tuple(a_block), tuple(b_block)) not in _BLOCK_PAIRS:
        return Reject(f"tiles {tuple(a_block)} x {tuple(b_block)}: cuBLASLt takes 1x128 or 128x128, at most one 2-D")
    capability = _capability_of(a)
    if capability[0] != BLOCK_CAPABILITY[0]:
        return Reject(f"block-scaled FP8 GEMM runs on compute capability 9.x here, device has {capability[0]}.{capability[1]}")
    (m, k), (n, k_b) = a.shape, b.shape
    reason = _shape_reason((m, k), (k_b, n), bias, out, accumulate)
    if reason is None and (k % 128 or m % _ALIGN or n % _ALIGN):
        reason = f"block-scaled GEMM needs K a multiple of 128 and M, N multiples of {_ALIGN}, got M={m}, N={n}, K={k}"
    if reason is None and _BLOCK_2D in (tuple(a_block), tuple(b_block)) and k % _BLOCK_2D_K:
        reason = f"a 128x128-tiled operand needs K a multiple of {_BLOCK_2D_K} (16-byte aligned scale rows), got K={k}"
    if reason is None:
        reason = _block_scale_reason(a, a_scale_inv, a_block, "a") or _block_scale_reason(b, b_scale_inv, b_block, "b")
    if reason is None and out_dtype not in HP_DTYPES:
        reason = f"out_dtype {out_dtype} is not one of {HP_DTYPES}"
    if reason is None and out is not None and out.dtype != out_dtype:
        reason = f"out has dtype {out.dtype} but out_dtype is {out_dtype}"
    if reason is None and bias is not None and bias.dtype not in HP_DTYPES:
        reason = f"bias dtype {bias.dtype} is not one of {HP_DTYPES}"
    return Reject(reason) if reason else True


def _block_scale_reason(t, scale_inv, block, name: str) -> Optional[str]:
    """None when ``scale_inv`` is float32 with one entry per ``block`` tile of t, else why not."""
    expected = (-(-t.size(0) // block[0]), -(-t.size(1) // block[1]))
    if scale_inv is None or scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        got = None if scale_inv is None else (tuple(scale_inv.shape), scale_inv.dtype)
        return f"{name}_scale_inv must be float32 {list(expected)} for {tuple(block)} tiles of {name} {tuple(t.shape)}, got {got}"
    return None


SUPPORTS = {"gemm": _supports_gemm, "gemm_blockwise": _supports_gemm_blockwise}
# what the dispatcher calls once SUPPORTS has accepted a call: the public functions check again
DISPATCHED = {"gemm": _gemm, "gemm_blockwise": _gemm_blockwise}
# high-precision operands run torch.mm / torch.addmm (``_mm_hp``): what torch.nn.functional.linear runs
ATEN_DTYPES = {"gemm": HP_DTYPES}
