"""Per-tensor FP8 casts in Triton: quantize, dequantize, cast_transpose, fp8_transpose, compute_amax.

Math (plugin/catalog/quantization.py), float32 throughout:

    quantize        q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),  scale_inv = 1 / scale,
                    amax = max |x| over the finite elements of x
    dequantize      x = q * scale_inv, cast to out_dtype
    cast_transpose  q as quantize and q_t = q^T, both written from one read of each x tile
    fp8_transpose   q_t[j, i] = q[i, j]
    compute_amax    amax = max |x| over the finite elements of x

There is no VJP: these are casts (the module layer treats them as straight-through). The cast is
``_fp8_encode`` (bit-identical to torch's saturating round-to-nearest-even cast, see _common.py).
Every kernel handles one block (or tile) per program, so the hardware keeps every SM full whatever
a kernel's register count; a program reduces max |x| over its block and commits it with one relaxed
atomic (a fire-and-forget RED: no fence, nothing waits on it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends.reference._fp8 import (
    check_fp8_dtype,
    check_high_precision,
    check_out_dtype,
    check_tensor,
    is_fp8,
    scalar_f32,
)
from transformer_engine.plugin.core import Reject

from ._common import (
    NO_FP8,
    _amax_commit,
    _finite_abs,
    _fp8_decode,
    _fp8_encode,
    _scale_inv_store,
    device_guard,
    fp8_format,
    fp8_outputs,
    hw_fp8_cast,
)

__all__ = ["quantize", "dequantize", "cast_transpose", "fp8_transpose", "compute_amax"]

_BLOCK = 4096  # elements per program of the 1-D kernels (16 per thread at 8 warps: two 16-byte loads)
_TILE = 64  # square tile of the transposing kernels


@triton.jit
def _quantize_kernel(
    x_ptr,  # *x, contiguous, n elements
    q_ptr,  # *uint8 view of q, n elements (unused without WRITE_Q)
    scale_ptr,  # *float32, one element: scale
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale
    amax_ptr,  # *int32, 0-d, zeroed: receives the bits of max |x| (finite)
    n,  # number of elements
    BLOCK: tl.constexpr,
    WRITE_Q: tl.constexpr,  # False: compute_amax only
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WRITE_Q:
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(q_ptr + offs, _fp8_encode(x * scale, FP8_MAX, MBITS, EBIAS, HW_CAST), mask=mask)
        _scale_inv_store(scale_inv_ptr, scale)
    _amax_commit(amax_ptr, _finite_abs(x))  # masked lanes hold 0


@triton.jit
def _dequantize_kernel(
    q_ptr,  # *uint8 view of q, n elements
    x_ptr,  # *out_dtype, n elements
    scale_inv_ptr,  # *float32, one element
    n,  # number of elements
    BLOCK: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    code = tl.load(q_ptr + offs, mask=mask, other=0)
    x = _fp8_decode(code, MBITS, EBIAS, HW_CAST) * tl.load(scale_inv_ptr).to(tl.float32)
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous
    scale_ptr,  # *float32, one element
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale
    amax_ptr,  # *int32, 0-d, zeroed: receives the bits of max |x| (finite)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = ((pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    code = _fp8_encode(x * scale, FP8_MAX, MBITS, EBIAS, HW_CAST)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], code, mask=mask)
    tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
    _amax_commit(amax_ptr, tl.max(_finite_abs(x), axis=1))  # masked lanes hold 0
    _scale_inv_store(scale_inv_ptr, scale)


@triton.jit
def _transpose_kernel(
    q_ptr,  # *uint8 [M, N], row stride stride_qm, unit column stride
    qt_ptr,  # *uint8 [N, M], contiguous
    M,  # rows of q
    N,  # columns of q
    stride_qm,  # elements between rows of q
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = ((pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tile = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0)
    tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def _check_scale_args(x, scale, fp8_dtype) -> None:
    check_high_precision(x)
    scalar_f32(scale, "scale")
    check_fp8_dtype(fp8_dtype)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (any row stride works), else a contiguous copy."""
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[-1] else t.contiguous()


def _launch_quantize(x: torch.Tensor, scale, fp8_dtype, write_q: bool):
    """Run ``_quantize_kernel`` on x (any shape); returns the Fp8Outputs (q unused without write_q)."""
    x_flat = x.contiguous().view(-1)
    out = fp8_outputs(x.shape if write_q else (0,), fp8_dtype, x.device)
    fmt = out.fmt.constexprs(hw_fp8_cast(x.device)) if write_q else NO_FP8
    scale_arg = scale if write_q else out.scale_inv
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _quantize_kernel[(max(1, triton.cdiv(x_flat.numel(), _BLOCK)),)](
            x_flat, out.q_bits, scale_arg, out.scale_inv, out.amax_bits, x_flat.numel(),
            BLOCK=_BLOCK, WRITE_Q=write_q, num_warps=8, **fmt,
        )  # fmt: skip
    return out


def quantize(x, scale, fp8_dtype):
    """q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)), scale_inv = 1 / scale, amax = max |x| (finite).

    Args:
        x: float32/bfloat16/float16 tensor of any shape.
        scale: one-element float32 tensor on x's device.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        (q with x's shape in ``fp8_dtype``, scale_inv 0-d float32, amax 0-d float32).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad scale or fp8_dtype.
    """
    _check_scale_args(x, scale, fp8_dtype)
    out = _launch_quantize(x, scale, fp8_dtype, write_q=True)
    return out.q, out.scale_inv, out.amax


def compute_amax(x):
    """amax = max |x| over the finite elements of x, a 0-d float32 tensor (0 for an empty x).

    Raises:
        TypeError: x is not a high-precision float tensor.
    """
    check_high_precision(x)
    return _launch_quantize(x, None, torch.float8_e4m3fn, write_q=False).amax


def dequantize(q, scale_inv, out_dtype):
    """x = q * scale_inv in float32, cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8. ValueError: scale_inv is not one element or out_dtype not a float dtype.
    """
    check_tensor(q, "q")
    if not is_fp8(q):
        raise TypeError(f"q has dtype {q.dtype}; it must be torch.float8_e4m3fn or torch.float8_e5m2")
    scalar_f32(scale_inv, "scale_inv")
    check_out_dtype(out_dtype)
    codes = q.contiguous().view(torch.uint8).view(-1)
    x = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    fmt = fp8_format(q.dtype)
    if codes.numel():
        with device_guard(q):
            _dequantize_kernel[(triton.cdiv(codes.numel(), _BLOCK),)](
                codes, x.view(-1), scale_inv, codes.numel(), BLOCK=_BLOCK,
                MBITS=fmt.mbits, EBIAS=fmt.ebias, HW_CAST=hw_fp8_cast(q.device), num_warps=8,
            )  # fmt: skip
    return x


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}; reshape it to 2-D first")


def cast_transpose(x, scale, fp8_dtype):
    """q = quantize(x) and its contiguous transpose q_t, from one read of x.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride).
        scale, fp8_dtype: as :func:`quantize`.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax) as in :func:`quantize`.

    Raises:
        TypeError / ValueError: as :func:`quantize`, or x not 2-D.
    """
    _check_scale_args(x, scale, fp8_dtype)
    _check_2d(x, "x")
    x = _rows_contiguous(x)
    m, n = x.shape
    out = fp8_outputs((m, n), fp8_dtype, x.device)
    q_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _cast_transpose_kernel[(max(1, triton.cdiv(m, _TILE) * triton.cdiv(n, _TILE)),)](
            x, out.q_bits, q_t.view(torch.uint8), scale, out.scale_inv, out.amax_bits, m, n, x.stride(0),
            BLOCK_M=_TILE, BLOCK_N=_TILE, num_warps=4, **out.fmt.constexprs(hw_fp8_cast(x.device)),
        )  # fmt: skip
    return out.q, q_t, out.scale_inv, out.amax


def fp8_transpose(q):
    """Contiguous transpose of a 2-D FP8 tensor, no rescaling: q_t[j, i] = q[i, j].

    Raises:
        TypeError: q is not FP8. ValueError: q is not 2-D.
    """
    check_tensor(q, "q")
    if not is_fp8(q):
        raise TypeError(f"q has dtype {q.dtype}; it must be torch.float8_e4m3fn or torch.float8_e5m2")
    _check_2d(q, "q")
    codes = _rows_contiguous(q).view(torch.uint8)
    m, n = codes.shape
    q_t = torch.empty((n, m), dtype=q.dtype, device=q.device)
    if q.numel():
        with device_guard(q):
            grid = (triton.cdiv(m, _TILE) * triton.cdiv(n, _TILE),)
            _transpose_kernel[grid](codes, q_t.view(torch.uint8), m, n, codes.stride(0), BLOCK_M=_TILE, BLOCK_N=_TILE)
    return q_t


def _scale_on_device(x, scale, fp8_dtype):
    """Reject a scale the kernels would misread: not float32, or on another device than x."""
    if isinstance(scale, torch.Tensor) and isinstance(x, torch.Tensor):
        if scale.dtype != torch.float32 or scale.device != x.device:
            return Reject(f"scale must be float32 on {x.device}, got {scale.dtype} on {scale.device}")
    return True


def _scale_inv_on_device(q, scale_inv, out_dtype):
    """Reject a scale_inv that is not float32 on q's device."""
    if isinstance(scale_inv, torch.Tensor) and isinstance(q, torch.Tensor):
        if scale_inv.dtype != torch.float32 or scale_inv.device != q.device:
            return Reject(f"scale_inv must be float32 on {q.device}, got {scale_inv.dtype} on {scale_inv.device}")
    return True


SUPPORTS = {"quantize": _scale_on_device, "cast_transpose": _scale_on_device, "dequantize": _scale_inv_on_device}
