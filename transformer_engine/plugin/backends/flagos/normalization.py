"""LayerNorm and RMSNorm in Triton, forward (optionally writing FP8 + amax) and backward.

x is viewed as [M, H]; every statistic and product is float32. gamma_eff = 1 + gamma with
``zero_centered_gamma``, else gamma.

Forward, one block of ROWS whole rows per program:
    LayerNorm  mean = sum(x) / H,  x_c = x - mean,  rstd = rsqrt(sum(x_c^2) / H + eps)
    RMSNorm    x_c = x,            rstd = rsqrt(sum(x^2) / H + eps)
    y = x_c * rstd * gamma_eff (+ beta);  with FP8: q = cast_fp8(clip(y * scale)), amax = max |y|
VJP, with x_hat = x_c * rstd and g = dy * gamma_eff:
    c1 = sum(g) / H (LayerNorm only),  c2 = sum(g * x_hat) / H
    dx = rstd * (g - c1 - x_hat * c2)          (RMSNorm: c1 = 0)
    dgamma = sum_rows(dy * x_hat),  dbeta = sum_rows(dy)
dgamma / dbeta take two launches without atomics: P persistent programs each sum their rows into
one row of a [P, H] float32 buffer, then ``_column_sums.column_sums`` sums the P rows per column.
The persistent row loop is software-pipelined (``tl.range(num_stages=...)``: the next row blocks
stream into shared memory by cp.async while one is reduced), so the bytes in flight do not depend
on how few programs the registers let reside on an SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import check_norm_bwd, check_norm_fwd
from transformer_engine.plugin.core import Reject

from ._common import (
    MAX_FUSED_SIZE,
    NO_FP8,
    _amax_commit,
    _finite_abs,
    _fp8_encode,
    _scale_inv_store,
    cdiv,
    device_guard,
    fp8_outputs,
    hw_fp8_cast,
    num_programs_hint,
    row_block,
    rows_view,
    warps_for,
)
from ._column_sums import column_sums
from ._launch import cached_launch

__all__ = ["layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd"]

# persistent backward programs per SM: the dx kernel holds a row block's x, dy, gamma and two
# accumulators (~115 registers x 256 threads at H = 4096 on sm_90, scripts/compile_check.py), so two
# are resident per SM; more programs would only run as a second wave and add partial rows
_BWD_PROGRAMS_PER_SM = 2
_BWD_PREFETCH_BYTES = 64 * 1024  # shared memory a dx program may fill with prefetched row blocks


@cached_launch
@triton.jit
def _norm_fwd_kernel(
    x_ptr,  # *x [M, H], row stride stride_x
    y_ptr,  # *y [M, H] contiguous: out_dtype, or the uint8 view of q when FP8_OUT
    w_ptr,  # *gamma [H]
    b_ptr,  # *beta [H] (read only when HAS_BIAS)
    mean_ptr,  # *float32 [M] (written only for LayerNorm)
    rstd_ptr,  # *float32 [M]
    scale_ptr,  # *float32, one element: FP8 scale (FP8_OUT only)
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale (FP8_OUT only)
    amax_ptr,  # *int32, 0-d, zeroed: bits of max |y| (FP8_OUT only)
    M,  # rows
    H,  # hidden size (row length)
    stride_x,  # elements between rows of x
    eps,  # added to the variance
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN_H: tl.constexpr,  # H == BLOCK_H: no padded columns
    IS_RMSNORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < H)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMSNORM:
        x_c = x
    else:
        mean = tl.sum(x, axis=1) / H
        x_c = x - mean[:, None]
        if not EVEN_H:
            x_c = tl.where(mask, x_c, 0.0)  # padded columns stay out of the variance
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = tl.math.rsqrt(tl.sum(x_c * x_c, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    # gamma / beta loaded as [1, BLOCK_H] tiles, so that they take the layout of x and y (a 1-D load
    # broadcast with [None, :] gets a layout of its own, converted through shared memory per program)
    gamma = tl.load(w_ptr + cols[None, :], mask=(cols < H)[None, :], other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    y = x_c * rstd[:, None] * gamma
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols[None, :], mask=(cols < H)[None, :], other=0.0).to(tl.float32)
    y_offs = rows64[:, None] * H + cols[None, :]
    if FP8_OUT:
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(y_ptr + y_offs, _fp8_encode(y * scale, FP8_MAX, MBITS, EBIAS, HW_CAST), mask=mask)
        _amax_commit(amax_ptr, tl.max(_finite_abs(y), axis=1))  # masked lanes: 0 * rstd * 0 + 0
        _scale_inv_store(scale_inv_ptr, scale)
    else:
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _norm_bwd_dx_kernel(
    dy_ptr,  # *dy [M, H], row stride stride_dy
    x_ptr,  # *x [M, H], row stride stride_x
    w_ptr,  # *gamma [H]
    mean_ptr,  # *float32 [M] (LayerNorm only)
    rstd_ptr,  # *float32 [M]
    dx_ptr,  # *dx [M, H] contiguous, x's dtype
    dw_part_ptr,  # *float32 [P, H]: this program's sum_rows(dy * x_hat) goes to row pid
    db_part_ptr,  # *float32 [P, H]: this program's sum_rows(dy) (LayerNorm only)
    M,  # rows
    H,  # hidden size
    stride_dy,  # elements between rows of dy
    stride_x,  # elements between rows of x
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN_H: tl.constexpr,  # H == BLOCK_H: no padded columns
    IS_RMSNORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the row loop
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    gamma = tl.load(w_ptr + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)  # [1, BLOCK_H], as x
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    dw_acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    # software pipeline: the loads of the next STAGES - 1 row blocks are in flight (cp.async into
    # shared memory) while this one is reduced; the registers alone allow only two programs per SM
    for row0 in tl.range(pid * ROWS, M, tl.num_programs(0) * ROWS, num_stages=STAGES):
        rows = row0 + tl.arange(0, ROWS)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if not IS_RMSNORM:
            x = x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = x * rstd[:, None]  # 0 in rows past M (rstd = 0 there)
        if not EVEN_H:
            x_hat = tl.where(mask, x_hat, 0.0)  # padded columns stay out of c2 and dgamma
        g = dy * gamma
        c2 = tl.sum(g * x_hat, axis=1) / H
        if IS_RMSNORM:
            dx = rstd[:, None] * (g - x_hat * c2[:, None])
        else:
            c1 = tl.sum(g, axis=1) / H
            dx = rstd[:, None] * (g - c1[:, None] - x_hat * c2[:, None])
            db_acc += dy
        tl.store(dx_ptr + rows64[:, None] * H + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(dw_part_ptr + pid * H + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if not IS_RMSNORM:
        tl.store(db_part_ptr + pid * H + cols, tl.sum(db_acc, axis=0), mask=col_mask)


def _norm_fwd(x, weight, bias, eps, zero_centered_gamma, fp8, out_dtype, is_rmsnorm):
    """Shared forward launcher; ``fp8`` is (scale, dtype, amax_out) or None. Returns (y, mean, rstd, scale_inv, amax)."""
    x_rows = rows_view(x)
    m, hidden = x_rows.shape
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if fp8 is not None:
        out = fp8_outputs(x.shape, fp8[1], x.device, fp8[2])
        y, y_arg, fp8_args = out.q, out.q_bits, (fp8[0], out.scale_inv, out.amax_bits)
        consts = out.fmt.constexprs(hw_fp8_cast(x.device))
    else:
        y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
        y_arg, fp8_args, consts = y, (rstd, rstd, rstd), NO_FP8
    block_h, rows = row_block(m, hidden)
    warps = warps_for(block_h * rows)
    if fp8 is not None and not is_rmsnorm:
        # LayerNorm + FP8 (three row reductions and the cast) is faster at half the warps; RMSNorm + FP8 is not
        warps = max(4, warps // 2)
    if m:
        with device_guard(x):
            _norm_fwd_kernel[(cdiv(m, rows),)](
                x_rows, y_arg, weight, bias if bias is not None else weight, mean, rstd, *fp8_args,
                m, hidden, x_rows.stride(0), float(eps),
                BLOCK_H=block_h, ROWS=rows, EVEN_H=block_h == hidden, IS_RMSNORM=is_rmsnorm, HAS_BIAS=bias is not None,
                ZERO_CENTERED=bool(zero_centered_gamma), FP8_OUT=fp8 is not None,
                num_warps=warps, **consts,
            )  # fmt: skip
    if fp8 is None:
        return y, mean, rstd, None, None
    if not m:
        out.scale_inv.copy_(torch.reciprocal(fp8[0].reshape(()).float()))
    return y, mean, rstd, out.scale_inv, out.amax


def _bwd_stages(block_bytes: int) -> int:
    """Pipelining depth of the dx row loop: up to 2 row blocks (x and dy) prefetched, within _BWD_PREFETCH_BYTES."""
    return max(1, min(3, 1 + _BWD_PREFETCH_BYTES // block_bytes))


def _flat(stat: torch.Tensor) -> torch.Tensor:
    """A statistic (one value per row) as the 1-D tensor the kernels index (reshaped only when it is not)."""
    return stat if stat.dim() == 1 else stat.reshape(-1)


def _norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma, is_rmsnorm):
    """Shared backward launcher; returns (dx, dgamma, dbeta or None)."""
    x_rows, dy_rows = rows_view(x), rows_view(dy)
    m, hidden = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h, rows = row_block(m, hidden)
    programs = max(1, min(cdiv(m, rows), num_programs_hint(x.device, _BWD_PROGRAMS_PER_SM)))
    dw_part = torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
    db_part = dw_part if is_rmsnorm else torch.empty_like(dw_part)
    rstd_flat = _flat(rstd)
    stages = _bwd_stages(block_h * rows * (x.element_size() + dy.element_size()))
    with device_guard(x):
        _norm_bwd_dx_kernel[(programs,)](
            dy_rows, x_rows, weight, rstd_flat if is_rmsnorm else _flat(mean), rstd_flat, dx, dw_part, db_part,
            m, hidden, dy_rows.stride(0), x_rows.stride(0),
            BLOCK_H=block_h, ROWS=rows, EVEN_H=block_h == hidden, IS_RMSNORM=is_rmsnorm,
            ZERO_CENTERED=bool(zero_centered_gamma), STAGES=stages, num_warps=warps_for(block_h * rows),
        )  # fmt: skip
    dgamma, dbeta = column_sums(dw_part, weight.dtype, None if is_rmsnorm else db_part)
    return dx, dgamma, dbeta


def layernorm_fwd(x, weight, bias, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    """y = (x - mean) * rstd * gamma_eff + beta over the last dim, statistics in float32.

    Args:
        x: [..., H] float32/bfloat16/float16.
        weight, bias: gamma and beta, [H] (bias may be None).
        eps: added to the variance.
        zero_centered_gamma: use 1 + gamma.
        fp8_scale, fp8_dtype: quantize y with this per-tensor scale (both or neither).
        out_dtype: dtype of an unquantized y (default x's dtype).
        amax_out: with fp8_scale, a float32 slot the amax of y is max-accumulated into (catalog).

    Returns:
        (y, mean [M] float32, rstd [M] float32, scale_inv, amax); the last two are None unless y is FP8.

    Raises:
        TypeError / ValueError: as the reference (bad dtypes, shapes, eps or FP8 arguments).
    """
    check_norm_fwd(x, weight, bias, eps, fp8_scale, fp8_dtype, out_dtype, amax_out)
    fp8 = None if fp8_scale is None else (fp8_scale, fp8_dtype, amax_out)
    return _norm_fwd(x, weight, bias, eps, zero_centered_gamma, fp8, out_dtype, is_rmsnorm=False)


def layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma=False):
    """dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma_eff; dgamma, dbeta summed over rows.

    Returns:
        (dx like x, dgamma [H] and dbeta [H] in weight's dtype).

    Raises:
        TypeError / ValueError: shapes or dtypes that do not fit the forward's.
    """
    check_norm_bwd(dy, x, (("mean", mean), ("rstd", rstd)), weight)
    return _norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma, is_rmsnorm=False)


def rmsnorm_fwd(x, weight, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    """y = x * rstd * gamma_eff, rstd = 1 / sqrt(mean(x^2) + eps) over the last dim.

    Returns:
        (y, rstd [M] float32, scale_inv, amax); the last two are None unless y is FP8.

    Raises:
        TypeError / ValueError: as :func:`layernorm_fwd`.
    """
    check_norm_fwd(x, weight, None, eps, fp8_scale, fp8_dtype, out_dtype, amax_out)
    fp8 = None if fp8_scale is None else (fp8_scale, fp8_dtype, amax_out)
    y, _, rstd, scale_inv, amax = _norm_fwd(x, weight, None, eps, zero_centered_gamma, fp8, out_dtype, is_rmsnorm=True)
    return y, rstd, scale_inv, amax


def rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma=False):
    """dx = rstd (g - x_hat mean(g x_hat)), g = dy gamma_eff, x_hat = x rstd; dgamma = sum_rows(dy x_hat).

    Returns:
        (dx like x, dgamma [H] in weight's dtype).

    Raises:
        TypeError / ValueError: shapes or dtypes that do not fit the forward's.
    """
    check_norm_bwd(dy, x, (("rstd", rstd),), weight)
    dx, dgamma, _ = _norm_bwd(dy, x, None, rstd, weight, zero_centered_gamma, is_rmsnorm=True)
    return dx, dgamma


def _fits(x, weight, fp8_scale) -> object:
    """Reject rows wider than one block, or an FP8 scale / weight the kernels would misread."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return True  # the launcher raises the argument error
    if x.shape[-1] > MAX_FUSED_SIZE:
        return Reject(f"hidden size {x.shape[-1]} > {MAX_FUSED_SIZE}: one row must fit one Triton block")
    for name, t in (("weight", weight), ("fp8_scale", fp8_scale)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            return Reject(f"{name} is on {t.device} but x on {x.device}")
    if isinstance(fp8_scale, torch.Tensor) and fp8_scale.dtype != torch.float32:
        return Reject(f"fp8_scale has dtype {fp8_scale.dtype}; the kernel reads a float32 scale")
    return True


def _layernorm_fwd_fits(x, weight, bias, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    return _fits(x, weight, fp8_scale)


def _rmsnorm_fwd_fits(x, weight, eps, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, out_dtype=None, amax_out=None):
    return _fits(x, weight, fp8_scale)


def _layernorm_bwd_fits(dy, x, mean, rstd, weight, zero_centered_gamma=False):
    return _fits(x, weight, None)


def _rmsnorm_bwd_fits(dy, x, rstd, weight, zero_centered_gamma=False):
    return _fits(x, weight, None)


SUPPORTS = {
    "layernorm_fwd": _layernorm_fwd_fits,
    "rmsnorm_fwd": _rmsnorm_fwd_fits,
    "layernorm_bwd": _layernorm_bwd_fits,
    "rmsnorm_bwd": _rmsnorm_bwd_fits,
}
