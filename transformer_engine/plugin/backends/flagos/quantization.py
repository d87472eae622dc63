"""Per-tensor FP8 casts in Triton: quantize, dequantize, cast_transpose(_dbias), quantize_transposed,
fp8_transpose, compute_amax, current_scale (the delayed-scaling update: ``delayed_scaling.py``; block
scaling: ``quantization_blockwise.py``; the grouped forms over row splits: ``quantization_grouped.py``).

Math (plugin/catalog/quantization.py), float32 throughout:

    quantize        q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),  scale_inv = 1 / scale,
                    amax = max |x| over the finite elements of x
    dequantize      x = q * scale_inv, cast to out_dtype
    cast_transpose  q as quantize and q_t = q^T, both written from one read of each x tile
    quantize_transposed
                    q_t alone (the same kernel, the row-major store left out)
    cast_transpose_dbias
                    cast_transpose plus dbias[j] = sum_i x[i, j] in float32: each tile writes its
                    column sums to partials [cdiv(M, BLOCK_M), N], which ``column_sums`` adds over
                    dim 0 in a fixed order (no atomics: the result is deterministic)
    fp8_transpose   q_t[j, i] = q[i, j]
    compute_amax    amax = max |x| over the finite elements of x
    current_scale   amax as compute_amax and scale = fp8_max / max(amax, eps) in one launch (the last
                    program to finish writes both)

There is no VJP: these are casts (the module layer treats them as straight-through). The cast is
``_fp8_encode`` (bit-identical to torch's saturating round-to-nearest-even cast, see _common.py).
Every kernel handles one block (or tile) per program, so the hardware keeps every SM full whatever a
kernel's register count; a program reduces max |x| over its block and commits it with one relaxed
atomic (a fire-and-forget RED: no fence, nothing waits on it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import (
    check_amax_epsilon,
    check_dbias_dtype,
)
from transformer_engine.plugin.backends._fp8 import (
    check_2d,
    check_dequantize_args,
    check_fp8_dtype,
    check_fp8_tensor,
    check_high_precision,
    check_quantize_args,
)
from transformer_engine.plugin.core import Reject

from ._column_sums import column_sums
from ._common import (
    NO_FP8,
    _amax_commit,
    _finite_abs,
    _fp8_decode,
    _fp8_encode,
    _scale_inv_store,
    _tile_offsets,
    cdiv,
    device_guard,
    fp8_format,
    fp8_outputs,
    hw_fp8_cast,
    rows_contiguous,
    stream_counters,
)
from ._launch import cached_launch

__all__ = [
    "quantize", "dequantize", "cast_transpose", "quantize_transposed", "cast_transpose_dbias",
    "fp8_transpose", "compute_amax", "current_scale",
]

_BLOCK = 8192  # elements per program of the 1-D kernels (32 per thread at 8 warps; measured best, benchmarks/sweep_fp8_casts.py)
_TILE = 64  # square tile of fp8_transpose
# tile (rows, columns) of _cast_transpose_kernel at 4 warps: the best of benchmarks/sweep_fp8_casts.py for all three ops
_CT_TILE_M, _CT_TILE_N = 128, 64


@cached_launch
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
def _current_scale_of(amax_bits, amax_epsilon, FP8_MAX: tl.constexpr, POWER_2: tl.constexpr):
    """``scale_from_amax`` of amaxes given as int32 bit patterns (any shape; finite and >= 0 by construction).

    scale = fp8_max / max(amax, eps), 1 for amax = 0, float32 max on overflow, with POWER_2 2^floor(log2(scale)).
    """
    # the correctly rounded float32 quotient via float64, as in the delayed-scaling update; usable
    # amax on the bit pattern: 0 < amax < inf (finite by construction, a subnormal counts)
    usable = amax_bits > 0
    amax = amax_bits.to(tl.float32, bitcast=True)
    quotient = FP8_MAX / tl.where(usable, tl.maximum(amax, amax_epsilon), 1.0).to(tl.float64)
    scale = tl.minimum(quotient, 3.4028234663852886e38).to(tl.float32)  # overflow: float32 max
    scale = tl.where(usable, scale, 1.0)
    if POWER_2:  # 2^floor(log2(scale)): the exponent bits alone (every reachable scale is normal)
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@cached_launch
@triton.jit
def _current_scale_kernel(
    x_ptr,  # *x, contiguous, n elements
    counters_ptr,  # *int32 [2], zero: the bits of max |x| so far, programs finished (left zero again)
    amax_ptr,  # *float32, 0-d: receives max |x| (finite)
    scale_ptr,  # *float32, 0-d: receives the scale
    n,  # number of elements
    amax_epsilon,  # lower bound of the amax the scale divides by
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    POWER_2: tl.constexpr,
):
    """amax as ``_quantize_kernel`` without q; the last program to finish turns it into the scale.

    Each program commits its max, then (after a barrier, so the commit of whichever thread made it
    comes first) counts itself done with an acq_rel atomic: the program that counts last sees every
    committed max, takes amax and zeroes both counters for the next launch on the stream (no other
    program touches them again), and writes amax and its scale (``_current_scale_of``).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    _amax_commit(counters_ptr, _finite_abs(x))
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        amax_bits = tl.atomic_xchg(counters_ptr, 0, sem="acquire")  # the final value, the counter zeroed
        tl.atomic_xchg(counters_ptr + 1, 0)
        tl.store(amax_ptr, amax_bits.to(tl.float32, bitcast=True))
        tl.store(scale_ptr, _current_scale_of(amax_bits, amax_epsilon, FP8_MAX, POWER_2))


@cached_launch
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


@cached_launch
@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # *x [M, N], row stride stride_xm, unit column stride
    q_ptr,  # *uint8 view of q [M, N], contiguous
    qt_ptr,  # *uint8 view of q_t [N, M], contiguous
    scale_ptr,  # *float32, one element
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale
    amax_ptr,  # *int32, 0-d, zeroed: receives the bits of max |x| (finite)
    partials_ptr,  # *float32 [cdiv(M, BLOCK_M), N], contiguous: column sums of each tile row (None without DBIAS)
    M,  # rows of x
    N,  # columns of x
    stride_xm,  # elements between rows of x
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DBIAS: tl.constexpr,  # also write this tile's column sums of x (the bias gradient's partials)
    WRITE_Q: tl.constexpr,  # False: only q_t (quantize_transposed); q_ptr is unused
    LOAD_TRANSPOSED: tl.constexpr,  # q_t encoded from a second load of the tile in transposed order (float32 x)
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
    if WRITE_Q:
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], code, mask=mask)
    if LOAD_TRANSPOSED:
        x_t = tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None], mask=tl.trans(mask), other=0.0).to(tl.float32)
        code_t = _fp8_encode(x_t * scale, FP8_MAX, MBITS, EBIAS, HW_CAST)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], code_t, mask=tl.trans(mask))
    else:
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))
    if DBIAS:  # column sums of the tile: masked lanes hold 0, NaN and inf propagate as in torch's sum
        tile_m = (pid // tiles_n).to(tl.int64)
        tl.store(partials_ptr + tile_m * N + cols, tl.sum(x, axis=0), mask=cols < N)
    _amax_commit(amax_ptr, tl.max(_finite_abs(x), axis=1))  # masked lanes hold 0
    _scale_inv_store(scale_inv_ptr, scale)


@cached_launch
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
    rows, cols, mask = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    tile = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0)
    tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def _launch_quantize(x: torch.Tensor, scale, fp8_dtype, write_q: bool, amax_out=None):
    """Run ``_quantize_kernel`` on x (any shape); returns the Fp8Outputs (q unused without write_q)."""
    x_flat = x.contiguous().view(-1)
    out = fp8_outputs(x.shape if write_q else (0,), fp8_dtype, x.device, amax_out)
    fmt = out.fmt.constexprs(hw_fp8_cast(x.device)) if write_q else NO_FP8
    scale_arg = scale if write_q else out.scale_inv
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _quantize_kernel[(max(1, cdiv(x_flat.numel(), _BLOCK)),)](
            x_flat, out.q_bits, scale_arg, out.scale_inv, out.amax_bits, x_flat.numel(),
            BLOCK=_BLOCK, WRITE_Q=write_q, num_warps=8, **fmt,
        )  # fmt: skip
    return out


def quantize(x, scale, fp8_dtype, amax_out=None):
    """q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)), scale_inv = 1 / scale, amax = max |x| (finite).

    Args:
        x: float32/bfloat16/float16 tensor of any shape.
        scale: one-element float32 tensor on x's device.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: None, or a float32 slot on x's device holding a value >= 0: the kernel's atomic
            max lands there (amax_out = max(amax_out, amax)) and it is returned as amax.

    Returns:
        (q with x's shape in ``fp8_dtype``, scale_inv 0-d float32, amax 0-d float32).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad scale or fp8_dtype.
    """
    check_quantize_args(x, scale, fp8_dtype, amax_out)
    out = _launch_quantize(x, scale, fp8_dtype, write_q=True, amax_out=amax_out)
    return out.q, out.scale_inv, out.amax


def compute_amax(x):
    """amax = max |x| over the finite elements of x, a 0-d float32 tensor (0 for an empty x).

    Raises:
        TypeError: x is not a high-precision float tensor.
    """
    check_high_precision(x)
    return _launch_quantize(x, None, torch.float8_e4m3fn, write_q=False).amax


def current_scale(x, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """(scale, amax) of current scaling in one launch (see ``_current_scale_kernel`` and the catalog).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad fp8_dtype or amax_epsilon.
    """
    check_high_precision(x)
    check_fp8_dtype(fp8_dtype)
    check_amax_epsilon(amax_epsilon)
    x_flat = x.contiguous().view(-1)
    scale, amax = torch.empty(2, dtype=torch.float32, device=x.device)  # both written by the kernel: no fill
    with device_guard(x):  # one program even for an empty x: it writes amax (0) and the scale (1)
        _current_scale_kernel[(max(1, cdiv(x_flat.numel(), _BLOCK)),)](
            x_flat, stream_counters(x.device), amax, scale, x_flat.numel(), float(amax_epsilon),
            BLOCK=_BLOCK, FP8_MAX=fp8_format(fp8_dtype).fp8_max, POWER_2=bool(power_2_scale), num_warps=8,
        )  # fmt: skip
    return scale, amax


def dequantize(q, scale_inv, out_dtype):
    """x = q * scale_inv in float32, cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8. ValueError: scale_inv is not one element or out_dtype not a float dtype.
    """
    check_dequantize_args(q, scale_inv, out_dtype)
    codes = q.contiguous().view(torch.uint8).view(-1)
    x = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    fmt = fp8_format(q.dtype)
    if codes.numel():
        with device_guard(q):
            _dequantize_kernel[(cdiv(codes.numel(), _BLOCK),)](
                codes, x.view(-1), scale_inv, codes.numel(), BLOCK=_BLOCK,
                MBITS=fmt.mbits, EBIAS=fmt.ebias, HW_CAST=hw_fp8_cast(q.device), num_warps=8,
            )  # fmt: skip
    return x


def _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias: bool, rowwise: bool = True):
    """Validate, then run ``_cast_transpose_kernel`` on x [M, N].

    Returns:
        (Fp8Outputs, q_t [N, M], partials): the outputs' q is empty without ``rowwise`` (only q_t
        written); partials is float32 [cdiv(M, _CT_TILE_M), N], row t holding the column sums of tile
        row t, with ``dbias``; None without.
    """
    check_quantize_args(x, scale, fp8_dtype, amax_out)
    check_2d(x, "x")
    x = rows_contiguous(x)
    m, n = x.shape
    out = fp8_outputs((m, n) if rowwise else (0,), fp8_dtype, x.device, amax_out)
    q_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    partials = torch.empty((cdiv(m, _CT_TILE_M), n), dtype=torch.float32, device=x.device) if dbias else None
    write_partials = partials is not None and partials.numel() > 0  # an empty x: its column sums are 0 already
    with device_guard(x):  # one program even for an empty x: it writes scale_inv
        _cast_transpose_kernel[(max(1, cdiv(m, _CT_TILE_M) * cdiv(n, _CT_TILE_N)),)](
            x, out.q_bits, q_t.view(torch.uint8), scale, out.scale_inv, out.amax_bits, partials, m, n, x.stride(0),
            BLOCK_M=_CT_TILE_M, BLOCK_N=_CT_TILE_N, DBIAS=write_partials, num_warps=4, WRITE_Q=rowwise,
            # float32 x: Triton 3.6 on sm_90 writes a wrong q_t for full tiles when the tile's codes (or values) are
            # transposed in registers and q is stored too (the gpu test); a second, transposed load of the tile (from
            # cache) is right, at some cost in speed
            LOAD_TRANSPOSED=x.dtype == torch.float32, **out.fmt.constexprs(hw_fp8_cast(x.device)),
        )  # fmt: skip
    return out, q_t, partials


def cast_transpose(x, scale, fp8_dtype, amax_out=None):
    """q = quantize(x) and its contiguous transpose q_t, from one read of x.

    Args:
        x: [M, N] float32/bfloat16/float16 (rows may be strided, columns unit-stride).
        scale, fp8_dtype, amax_out: as :func:`quantize`.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax) as in :func:`quantize`.

    Raises:
        TypeError / ValueError: as :func:`quantize`, or x not 2-D.
    """
    out, q_t, _ = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=False)
    return out.q, q_t, out.scale_inv, out.amax


def quantize_transposed(x, scale, fp8_dtype, amax_out=None):
    """Only the transposed half of :func:`cast_transpose`: q_t = quantize(x)^T, the row-major q never written.

    Args / Raises: as :func:`cast_transpose`.

    Returns:
        (q_t [N, M], scale_inv, amax) as in :func:`quantize`.
    """
    out, q_t, _ = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=False, rowwise=False)
    return q_t, out.scale_inv, out.amax


def cast_transpose_dbias(x, scale, fp8_dtype, amax_out=None, dbias_dtype=None):
    """:func:`cast_transpose` plus the bias gradient dbias[j] = sum_i x[i, j] in float32, from one read of x.

    The kernel writes each tile row's column sums (tiles of _CT_TILE_M = 128 rows); ``column_sums`` adds
    the cdiv(M, 128) partial rows in a fixed order (no atomics: the result is deterministic).

    Args:
        x: [M, N] float32/bfloat16/float16, dy of a linear layer (rows may be strided).
        scale, fp8_dtype, amax_out: as :func:`quantize`.
        dbias_dtype: dbias's dtype, written by ``column_sums`` (None: float32).

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax, dbias [N]); NaN / inf propagate into dbias.

    Raises:
        TypeError / ValueError: as :func:`cast_transpose`, or a dbias_dtype that is not a float dtype.
    """
    check_dbias_dtype(dbias_dtype)
    out, q_t, partials = _launch_cast_transpose(x, scale, fp8_dtype, amax_out, dbias=True)
    return out.q, q_t, out.scale_inv, out.amax, column_sums(partials, dbias_dtype or torch.float32)[0]


def fp8_transpose(q):
    """Contiguous transpose of a 2-D FP8 tensor, no rescaling: q_t[j, i] = q[i, j].

    Raises:
        TypeError: q is not FP8. ValueError: q is not 2-D.
    """
    check_fp8_tensor(q, "q")
    check_2d(q, "q")
    codes = rows_contiguous(q).view(torch.uint8)
    m, n = codes.shape
    q_t = torch.empty((n, m), dtype=q.dtype, device=q.device)
    if q.numel():
        with device_guard(q):
            grid = (cdiv(m, _TILE) * cdiv(n, _TILE),)
            _transpose_kernel[grid](codes, q_t.view(torch.uint8), m, n, codes.stride(0), BLOCK_M=_TILE, BLOCK_N=_TILE)
    return q_t


def _scale_on_device(x, scale, fp8_dtype, amax_out=None):
    """Reject a scale the kernels would misread: not float32, or on another device than x."""
    if isinstance(scale, torch.Tensor) and isinstance(x, torch.Tensor):
        if scale.dtype != torch.float32 or scale.device != x.device:
            return Reject(f"scale must be float32 on {x.device}, got {scale.dtype} on {scale.device}")
    return True


def _dbias_scale_on_device(x, scale, fp8_dtype, amax_out=None, dbias_dtype=None):
    """``_scale_on_device`` for ``cast_transpose_dbias`` (every dbias_dtype runs: ``column_sums`` writes it)."""
    return _scale_on_device(x, scale, fp8_dtype)


def _scale_inv_on_device(q, scale_inv, out_dtype):
    """Reject a scale_inv that is not float32 on q's device."""
    if isinstance(scale_inv, torch.Tensor) and isinstance(q, torch.Tensor):
        if scale_inv.dtype != torch.float32 or scale_inv.device != q.device:
            return Reject(f"scale_inv must be float32 on {q.device}, got {scale_inv.dtype} on {scale_inv.device}")
    return True


SUPPORTS = {
    "quantize": _scale_on_device,
    "cast_transpose": _scale_on_device,
    "quantize_transposed": _scale_on_device,
    "cast_transpose_dbias": _dbias_scale_on_device,
    "dequantize": _scale_inv_on_device,
}
# under torch.compile the cast with its bias gradient stays this kernel, traced as it is (Inductor launches
# it): Inductor's fusion of the reference's amax and column sums with the activation gradient before them is
# much slower; as a custom op each call pays the dispatcher's host time
UNDER_COMPILE = {"cast_transpose_dbias": "trace"}
