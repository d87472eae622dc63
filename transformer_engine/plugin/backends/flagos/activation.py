"""Activations and gated activations in Triton: forward, backward and the fused FP8 forward.

One forward and one backward kernel serve all 24 ops; the constexpr ACT picks the elementwise
function, GATED the structure. Math in float32, results in x's dtype (contract: plugin/catalog/activation.py):

    gelu(x)  = x * sigmoid(2u), u = k (x + 0.044715 x^3), k = sqrt(2/pi)   (= 0.5 x (1 + tanh u))
    gelu'(x) = s + 2 x s (1 - s) k (1 + 3 * 0.044715 x^2),  s = sigmoid(2u)
    qgelu(x) = x sigmoid(1.702 x)     silu(x) = x sigmoid(x)     sigmoid (glu's gate)
    relu(x)  = max(x, 0)              srelu(x) = relu(x)^2
Plain ops:  y = act(x),  dx = dy * act'(x).
Gated ops:  x = [a, b] (halves of the last dim),  y = act(a) * b,
            dx = [dy * b * act'(a), dy * act(a)].
clamped_swiglu: a' = min(a, limit), b' = clip(b, -limit, limit), s = sigmoid(alpha a'),
            y = a' s (b' + 1),
            dx = [dy (b' + 1) (s + alpha a' s (1 - s)) [a <= limit], dy a' s [|b| <= limit]].
activation_quantize: q = cast_fp8(clip(act(x) * scale)), amax = max |act(x)| (act(x) in float32).

Each program handles one [BLOCK_M, BLOCK_N] tile of the [M, N] output (plain ops view x as one row
of numel elements); with FP8 it commits its tile's max |y| by one relaxed atomic.
"""

from __future__ import annotations

import torch

from transformer_engine.plugin.backends._activation_ops import ACTIVATION_OP_NAMES, activation_ops, check_in_place, module_getattr
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import check_activation_dy, check_activation_input, check_activation_quantize
from transformer_engine.plugin.core import Reject

from ._common import (
    NO_FP8,
    _amax_commit,
    _finite_abs,
    _fp8_encode,
    _scale_inv_store,
    _tile_offsets,
    cdiv,
    device_guard,
    fp8_outputs,
    hw_fp8_cast,
    next_power_of_2,
    rows_view,
)
from ._launch import cached_launch

__all__ = [*ACTIVATION_OP_NAMES, "activation_quantize", "dactivation_"]

_TILE_ELEMENTS = 4096  # elements per tile (BLOCK_M * BLOCK_N)

# forward op name -> (ACT constexpr, gated)
_OPS = {
    "gelu": ("gelu", False), "qgelu": ("qgelu", False), "relu": ("relu", False),
    "srelu": ("srelu", False), "silu": ("silu", False),
    "glu": ("sigmoid", True), "geglu": ("gelu", True), "qgeglu": ("qgelu", True),
    "reglu": ("relu", True), "sreglu": ("srelu", True), "swiglu": ("silu", True),
    "clamped_swiglu": ("clamped_silu", True),
}  # fmt: skip


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _gelu_gate(a):
    """sigmoid(2u), u = k (a + 0.044715 a^3), k = sqrt(2/pi): gelu(a) = a * _gelu_gate(a)."""
    return _sigmoid(1.5957691216057308 * (a + 0.044715 * a * a * a))


@triton.jit
def _act_value(a, ACT: tl.constexpr, limit, alpha):
    """act(a) in float32 for the constexpr activation ACT."""
    if ACT == "gelu":
        value = a * _gelu_gate(a)
    elif ACT == "qgelu":
        value = a * _sigmoid(1.702 * a)
    elif ACT == "silu":
        value = a * _sigmoid(a)
    elif ACT == "sigmoid":
        value = _sigmoid(a)
    elif ACT == "relu":
        value = tl.where(a < 0.0, 0.0, a)
    elif ACT == "srelu":
        relu = tl.where(a < 0.0, 0.0, a)
        value = relu * relu
    else:  # clamped_silu
        a_c = tl.where(a > limit, limit, a)  # min(a, limit) that keeps NaN (the catalog's contract)
        value = a_c * _sigmoid(alpha * a_c)
    return value


@triton.jit
def _act_grad(a, ACT: tl.constexpr, limit, alpha):
    """act'(a) in float32 (zero where clamped_silu clamps a)."""
    if ACT == "gelu":
        s = _gelu_gate(a)
        grad = s + 2.0 * a * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)
    elif ACT == "qgelu":
        s = _sigmoid(1.702 * a)
        grad = s + 1.702 * a * s * (1.0 - s)
    elif ACT == "silu":
        s = _sigmoid(a)
        grad = s + a * s * (1.0 - s)
    elif ACT == "sigmoid":
        s = _sigmoid(a)
        grad = s * (1.0 - s)
    elif ACT == "relu":
        grad = tl.where(a > 0.0, 1.0, 0.0)
    elif ACT == "srelu":
        grad = 2.0 * tl.where(a < 0.0, 0.0, a)
    else:  # clamped_silu
        a_c = tl.where(a > limit, limit, a)  # min(a, limit) that keeps NaN (the catalog's contract)
        s = _sigmoid(alpha * a_c)
        grad = tl.where(a <= limit, s + alpha * a_c * s * (1.0 - s), 0.0)
    return grad


@cached_launch
@triton.jit
def _act_fwd_kernel(
    x_ptr,  # *x: [M, N] (plain) or [M, 2N] (gated, a = x[:, :N], b = x[:, N:]), row stride stride_x
    y_ptr,  # *y [M, N] contiguous: x's dtype, or the uint8 view of q when FP8_OUT
    scale_ptr,  # *float32, one element: FP8 scale (FP8_OUT only)
    scale_inv_ptr,  # *float32, 0-d: receives 1 / scale (FP8_OUT only)
    amax_ptr,  # *int32, 0-d, zeroed: bits of max |y| (FP8_OUT only)
    M,  # rows of y
    N,  # columns of y
    stride_x,  # elements between rows of x
    limit,  # clamped_silu's clamp
    alpha,  # clamped_silu's sigmoid slope
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EBIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    rows, cols, mask = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    x_offs = rows[:, None] * stride_x + cols[None, :]
    a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    y = _act_value(a, ACT, limit, alpha)
    if GATED:
        b = tl.load(x_ptr + x_offs + N, mask=mask, other=0.0).to(tl.float32)
        if ACT == "clamped_silu":
            b = tl.where(b > limit, limit, tl.where(b < -limit, -limit, b)) + 1.0  # clip keeping NaN
        y = y * b
    y_offs = rows[:, None] * N + cols[None, :]
    if FP8_OUT:
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(y_ptr + y_offs, _fp8_encode(y * scale, FP8_MAX, MBITS, EBIAS, HW_CAST), mask=mask)
        _amax_commit(amax_ptr, tl.max(_finite_abs(y), axis=1))  # masked lanes: act(0) * 0 = 0
        _scale_inv_store(scale_inv_ptr, scale)
    else:
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _act_bwd_kernel(
    dy_ptr,  # *dy [M, N], row stride stride_dy
    x_ptr,  # *x: [M, N] (plain) or [M, 2N] (gated), row stride stride_x
    dx_ptr,  # *dx, contiguous, x's shape and dtype ([M, N] or [M, 2N])
    M,  # rows of dy
    N,  # columns of dy
    stride_dy,  # elements between rows of dy
    stride_x,  # elements between rows of x
    limit,  # clamped_silu's clamp
    alpha,  # clamped_silu's sigmoid slope
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
):
    rows, cols, mask = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_offs = rows[:, None] * stride_x + cols[None, :]
    a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        b = tl.load(x_ptr + x_offs + N, mask=mask, other=0.0).to(tl.float32)
        db_factor = _act_value(a, ACT, limit, alpha)
        if ACT == "clamped_silu":
            db_factor = tl.where(tl.abs(b) <= limit, db_factor, 0.0)
            b = tl.where(b > limit, limit, tl.where(b < -limit, -limit, b)) + 1.0  # clip keeping NaN
        dx_offs = rows[:, None] * (2 * N) + cols[None, :]
        tl.store(dx_ptr + dx_offs, (dy * b * _act_grad(a, ACT, limit, alpha)).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + dx_offs + N, (dy * db_factor).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        dx = dy * _act_grad(a, ACT, limit, alpha)
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor, gated: bool) -> torch.Tensor:
    """Plain: x as one contiguous row. Gated: x as [M, 2F] with a unit column stride."""
    return rows_view(x) if gated else x.contiguous().view(1, -1)


def _tiles(m: int, n: int):
    """(BLOCK_M, BLOCK_N, num_tiles): tiles of ``_TILE_ELEMENTS``, as wide as the rows allow."""
    block_n = min(next_power_of_2(max(n, 1)), _TILE_ELEMENTS)
    block_m = max(1, min(_TILE_ELEMENTS // block_n, next_power_of_2(max(m, 1))))
    return block_m, block_n, cdiv(m, block_m) * cdiv(n, block_n)


def _launch_fwd(op: str, x, limit: float, alpha: float, fp8=None):
    """y = act(x) in x's dtype, or the Fp8Outputs of quantize(act(x)) when ``fp8`` = (scale, dtype, amax_out)."""
    act, gated = _OPS[op]
    x_rows = _as_rows(x, gated)
    m, n = x_rows.shape[0], x_rows.shape[1] // (2 if gated else 1)
    out_shape = (*x.shape[:-1], x.shape[-1] // 2) if gated else x.shape
    if fp8 is not None:
        out = fp8_outputs(out_shape, fp8[1], x.device, fp8[2])
        y_arg, fp8_args, consts = out.q_bits, (fp8[0], out.scale_inv, out.amax_bits), out.fmt.constexprs(hw_fp8_cast(x.device))
    else:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        y_arg, fp8_args, consts = out, (out, out, out), NO_FP8
    block_m, block_n, tiles = _tiles(m, n)
    with device_guard(x):  # one program even for an empty x: with FP8 it writes scale_inv
        _act_fwd_kernel[(max(1, tiles),)](
            x_rows, y_arg, *fp8_args, m, n, x_rows.stride(0), float(limit), float(alpha),
            BLOCK_M=block_m, BLOCK_N=block_n, ACT=act, GATED=gated, FP8_OUT=fp8 is not None,
            num_warps=8, **consts,
        )  # fmt: skip
    return out


def _forward(op: str, x, limit: float = 7.0, alpha: float = 1.702):
    check_activation_input(x, op, _OPS[op][1])
    return _launch_fwd(op, x, limit, alpha)


def _backward(op: str, dy, x, limit: float = 7.0, alpha: float = 1.702, dx=None):
    """dx = d<op>(dy, x) into a new tensor, or into ``dx`` (contiguous, x's shape; x itself works: each
    program reads its elements of x before it writes the same elements of dx)."""
    act, gated = _OPS[op]
    check_activation_input(x, op, gated)
    check_activation_dy(dy, x, op, gated)
    x_rows, dy_rows = _as_rows(x, gated), _as_rows(dy, gated)
    m, n = dy_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if dx is None else dx
    block_m, block_n, tiles = _tiles(m, n)
    with device_guard(x):
        _act_bwd_kernel[(max(1, tiles),)](
            dy_rows, x_rows, dx, m, n, dy_rows.stride(0), x_rows.stride(0), float(limit), float(alpha),
            BLOCK_M=block_m, BLOCK_N=block_n, ACT=act, GATED=gated, num_warps=8,
        )  # fmt: skip
    return dx


# the 24 activation ops (gelu, dgelu, ..., clamped_dswiglu), served as module attributes
__getattr__ = module_getattr(activation_ops(_forward, _backward), __name__)


def activation_quantize(x, activation, fp8_scale, fp8_dtype, limit=7.0, alpha=1.702, amax_out=None):
    """(q, scale_inv, amax) = quantize(act(x), fp8_scale, fp8_dtype, amax_out) (plugin/catalog/activation.py) in one
    pass, act(x) kept in float32. ``SUPPORTS`` declines an fp8_scale that is not float32 on x's device.

    Raises:
        ValueError: unknown activation, bad scale or fp8_dtype, or the activation's input errors.
    """
    gated = activation in _OPS and _OPS[activation][1]  # an unknown activation: the check names it
    check_activation_quantize(x, activation, gated, fp8_scale, fp8_dtype, limit, alpha, amax_out)
    out = _launch_fwd(activation, x, limit, alpha, fp8=(fp8_scale, fp8_dtype, amax_out))
    return out.q, out.scale_inv, out.amax


def dactivation_(dy, x, activation, limit=7.0, alpha=1.702):
    """x <- d<activation>(dy, x) by the backward kernel writing over x (the catalog's contract).

    Raises:
        ValueError: unknown activation, x not contiguous, or the backward op's own input errors.
    """
    check_in_place(x, activation, limit, alpha)
    return _backward(activation, dy, x, limit, alpha, dx=x)


def _fp8_scale_fits(x, activation, fp8_scale, fp8_dtype, limit=7.0, alpha=1.702, amax_out=None):
    """Reject an FP8 scale that is not float32 on x's device."""
    if isinstance(fp8_scale, torch.Tensor) and isinstance(x, torch.Tensor):
        if fp8_scale.dtype != torch.float32 or fp8_scale.device != x.device:
            return Reject(f"fp8_scale must be float32 on {x.device}, got {fp8_scale.dtype} on {fp8_scale.device}")
    return True


SUPPORTS = {"activation_quantize": _fp8_scale_fits}
