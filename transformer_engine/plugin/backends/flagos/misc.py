"""Dropout, the fused bias-dropout-add and cross entropy in Triton, forward and backward.

Dropout with keep mask m ~ Bernoulli(1 - p), scale = 1 / (1 - p) (0 for p = 1), in float32:

    forward   y = x * m * scale;  bias-dropout-add: out = r + (x + b) * m * scale, b [H] over the rows
    backward  dx = dy * m * scale  (both ops; dr = dy is the caller's)
              dropout_bwd_dbias: dx and db = sum over rows of dx (float32, unrounded products) in one pass

One kernel per call: the forward reads x (and b, r) once and writes y and m, packed eight elements per
byte (``backends/_dropout_mask.py``; a program's elements start at a multiple of 8, so it owns whole bytes).
m_i = [u_i >= p] with u_i uniform in [0, 1) from Philox (``tl.rand4x``): one Philox call gives four
uniforms, so program k draws counters c = k * QUARTER + [0, QUARTER) once and uses the j-th output
for its j-th quarter of elements [k * 4 QUARTER + j QUARTER, ... + QUARTER). The Philox key is an
int64 drawn on x's device from torch's default generator (``torch.randint``) and read by the kernel
through a pointer: no host sync, ``torch.manual_seed`` reproduces m, and restoring the RNG state
(``te.checkpoint``'s replay) draws the same key and so the same m. Offsets are int64 (any numel).
Dropped elements are exactly 0, also where x is not finite.

Cross entropy, for one row z [V] of logits and target t, with label smoothing eps, in float32:

    forward   lse = log sum_j exp(z_j), computed online over blocks of V:
                  m' = max(m, max_block z),  s' = s exp(m - m') + sum_block exp(z - m'),  lse = m + log s
              loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j)
    backward  dz_j = g (exp(z_j - lse) - (1 - eps) [j == t] - eps / V),  g = grad_loss of the row

Rows whose target equals ``ignore_index`` get loss 0 and gradient 0 (their lse is still written).
A target outside [0, V) that is not ``ignore_index`` gives a NaN loss and a NaN gradient row (the
catalog's contract, which the reference backend follows): the kernel never reads out of bounds and
never synchronises to raise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._checks import (
    check_bias_dropout_add,
    check_cross_entropy,
    check_cross_entropy_bwd,
    check_dropout_dbias,
    check_dropout_mask,
    dropout_scale,
)
from transformer_engine.plugin.backends._dropout_mask import packed_bytes
from transformer_engine.plugin.core import Reject

from ._column_sums import column_sums
from ._common import cdiv, device_guard, next_power_of_2
from ._launch import cached_launch

__all__ = ["dropout_fwd", "dropout_bwd", "dropout_bwd_dbias", "bias_dropout_add_fwd", "cross_entropy_fwd", "cross_entropy_bwd"]

_BLOCK_V = 4096  # logits per step of the loop over the vocabulary
_QUARTER = 512  # elements per Philox output of a dropout-forward program (a program covers 4 x this)
_WARPS_FWD = 4  # warps per dropout-forward program (with _QUARTER, the fastest pairing of a sweep)
_BLOCK_BWD = 4096  # elements per dropout-backward program
# dropout backward with dbias (swept: one fused kernel beats dropout_bwd followed by a column sum):
_DBIAS_ROWS = 128  # rows per program (one partial row of column sums each)
_DBIAS_STEP = 8  # rows per loop step
_DBIAS_BYTES = 32  # mask bytes per row and program (8 columns each: 256 columns)
_UNALIGNED = "H = {} is not a multiple of 8 (the kernel reads each row's keep bits as whole bytes)"
_SEED_HIGH = 2**63 - 1  # Philox keys are drawn uniformly from [0, _SEED_HIGH)
_MAX_COLS = 2**30  # bias length bound: column indices are int32 within a program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _drop_quarter(
    x_ptr,  # *x, contiguous, flat [numel]
    bias_ptr,  # *b [H] (read only with HAS_BIAS)
    residual_ptr,  # *r, contiguous, flat [numel] (read only with HAS_RESIDUAL)
    y_ptr,  # *y, contiguous, flat [numel], x's dtype
    keep_ptr,  # *uint8 packed mask m [ceil(numel / 8)]
    start,  # int64 index of the quarter's first element (a multiple of 8)
    u,  # [QUARTER] float32 uniforms of this quarter
    numel,  # elements of x
    n_cols,  # H, the bias length (1 without bias)
    p,  # drop probability
    scale,  # 1 / (1 - p), 0 when p = 1
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUARTER: tl.constexpr,
    ROW_ALIGNED: tl.constexpr,
):
    """y = [r +] where(m, (x [+ b]) * scale, 0), m = u >= p, on elements [start, start + QUARTER).

    ROW_ALIGNED (H a multiple of QUARTER): the quarter lies within one row, so its bias columns are
    consecutive and need no per-element modulo."""
    idx = start + tl.arange(0, QUARTER)
    inside = idx < numel
    h = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        col = (start % n_cols).to(tl.int32) + tl.arange(0, QUARTER)  # < H + QUARTER < 2^31
        if not ROW_ALIGNED:
            col = col % n_cols
        h += tl.load(bias_ptr + col, mask=inside, other=0.0).to(tl.float32)
    keep = (u >= p) & inside
    y = tl.where(keep, h * scale, 0.0)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=inside)
    bits = tl.reshape(keep.to(tl.int32), [QUARTER // 8, 8]) << tl.arange(0, 8)[None, :]
    byte = start // 8 + tl.arange(0, QUARTER // 8)
    tl.store(keep_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte * 8 < numel)


@cached_launch
@triton.jit
def _dropout_fwd_kernel(
    x_ptr,  # *x, contiguous, flat [numel]
    bias_ptr,  # *b [H] (read only with HAS_BIAS)
    residual_ptr,  # *r, contiguous, flat [numel] (read only with HAS_RESIDUAL)
    y_ptr,  # *y, contiguous, flat [numel], x's dtype
    keep_ptr,  # *uint8 packed mask m [ceil(numel / 8)]
    seed_ptr,  # *int64 [1], the Philox key
    numel,  # elements of x
    n_cols,  # H, the bias length (1 without bias)
    p,  # drop probability
    scale,  # 1 / (1 - p), 0 when p = 1
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUARTER: tl.constexpr,
    ROW_ALIGNED: tl.constexpr,
):
    # float32 math: eager Triton passes Python floats as float32, torch.compile (floats not specialized) as float64
    p, scale = tl.cast(p, tl.float32), tl.cast(scale, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    counter = pid * QUARTER + tl.arange(0, QUARTER)  # Philox counters, one per four elements
    u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), counter)
    start = pid * (4 * QUARTER)
    _drop_quarter(x_ptr, bias_ptr, residual_ptr, y_ptr, keep_ptr, start, u0, numel, n_cols, p, scale,
                  HAS_BIAS, HAS_RESIDUAL, QUARTER, ROW_ALIGNED)  # fmt: skip
    _drop_quarter(x_ptr, bias_ptr, residual_ptr, y_ptr, keep_ptr, start + QUARTER, u1, numel, n_cols, p, scale,
                  HAS_BIAS, HAS_RESIDUAL, QUARTER, ROW_ALIGNED)  # fmt: skip
    _drop_quarter(x_ptr, bias_ptr, residual_ptr, y_ptr, keep_ptr, start + 2 * QUARTER, u2, numel, n_cols, p, scale,
                  HAS_BIAS, HAS_RESIDUAL, QUARTER, ROW_ALIGNED)  # fmt: skip
    _drop_quarter(x_ptr, bias_ptr, residual_ptr, y_ptr, keep_ptr, start + 3 * QUARTER, u3, numel, n_cols, p, scale,
                  HAS_BIAS, HAS_RESIDUAL, QUARTER, ROW_ALIGNED)  # fmt: skip


@cached_launch
@triton.jit
def _dropout_bwd_kernel(
    dy_ptr,  # *dy, contiguous, flat [numel]
    keep_ptr,  # *uint8 packed mask m [ceil(numel / 8)]
    dx_ptr,  # *dx, contiguous, flat [numel], dy's dtype
    numel,  # elements of dy
    scale,  # 1 / (1 - p), 0 when p = 1
    BLOCK: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < numel
    dy = tl.load(dy_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    keep = ((tl.load(keep_ptr + idx // 8, mask=inside, other=0).to(tl.int32) >> (idx % 8).to(tl.int32)) & 1) != 0
    tl.store(dx_ptr + idx, tl.where(keep, dy * scale, 0.0).to(dx_ptr.dtype.element_ty), mask=inside)


@cached_launch
@triton.jit
def _dropout_bwd_dbias_kernel(
    dy_ptr,  # *dy, contiguous [M, H], H a multiple of 8
    keep_ptr,  # *uint8 packed mask m [M * H / 8]: row r's bits start at byte r * H / 8
    dx_ptr,  # *dx, contiguous [M, H], dy's dtype
    partials_ptr,  # *float32 [cdiv(M, ROWS), H]: column sums of each program's rows
    M,  # rows of dy
    H,  # columns of dy (the bias length)
    scale,  # 1 / (1 - p), 0 when p = 1
    ROWS: tl.constexpr,
    STEP: tl.constexpr,
    BYTES: tl.constexpr,
):
    """dx = dy * m * scale on ROWS rows x 8 BYTES columns, and their float32 column sums.

    The tile is [STEP, BYTES, 8]: each mask byte is loaded once and its 8 bits broadcast over the 8
    columns it covers; the sums accumulate elementwise over the loop and are reduced over the rows
    once, at the end."""
    scale = tl.cast(scale, tl.float32)
    tiles_h = tl.cdiv(H, 8 * BYTES)
    chunk = tl.program_id(0) // tiles_h
    byte_cols = (tl.program_id(0) % tiles_h) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    cols = byte_cols[:, None] * 8 + bit[None, :]  # [BYTES, 8]
    acc = tl.zeros([STEP, BYTES, 8], tl.float32)
    for row0 in range(chunk * ROWS, chunk * ROWS + ROWS, STEP):
        rows = (row0 + tl.arange(0, STEP)).to(tl.int64)
        inside = (rows < M)[:, None, None] & (cols < H)[None, :, :]
        offs = rows[:, None, None] * H + cols[None, :, :]
        dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        byte_mask = (rows < M)[:, None] & (byte_cols * 8 < H)[None, :]
        byte = tl.load(keep_ptr + rows[:, None] * (H // 8) + byte_cols[None, :], mask=byte_mask, other=0)
        keep = ((byte.to(tl.int32)[:, :, None] >> bit[None, None, :]) & 1) != 0
        dx = tl.where(keep, dy * scale, 0.0)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        acc += dx
    tl.store(partials_ptr + chunk * H + cols, tl.sum(acc, axis=0), mask=cols < H)


def _draw_seed(device: torch.device) -> torch.Tensor:
    """The Philox key of one launch: an int64 [1] drawn on ``device`` from its default generator."""
    return torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64, device=device)


def _drop_launch(x: torch.Tensor, bias, residual, p: float, scale: float):
    """(y, m) of y = [r +] (x [+ b]) * m * scale in one kernel; the caller checked p, scale and the shapes."""
    x = x.contiguous()
    y = torch.empty_like(x)
    keep = torch.empty(packed_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    seed = _draw_seed(x.device)
    numel = x.numel()
    if numel:
        with device_guard(x):
            _dropout_fwd_kernel[(cdiv(numel, 4 * _QUARTER),)](
                x, x if bias is None else bias.contiguous(), x if residual is None else residual.contiguous(), y,
                keep, seed, numel, 1 if bias is None else bias.numel(), float(p), scale,
                HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, QUARTER=_QUARTER,
                ROW_ALIGNED=bias is not None and bias.numel() % _QUARTER == 0, num_warps=_WARPS_FWD,
            )  # fmt: skip
    return y, keep


def dropout_fwd(x, p):
    """Inverted dropout: y = x * m / (1 - p), m ~ Bernoulli(1 - p) by Philox keyed from x's device generator.

    Args:
        x: float32 / bfloat16 / float16 tensor (a non-contiguous one is copied first).
        p: drop probability in [0, 1].

    Returns:
        (y with x's shape and dtype, keep mask m packed eight elements per byte).

    Raises:
        ValueError: p outside [0, 1].
    """
    return _drop_launch(x, None, None, p, dropout_scale(p))


def dropout_bwd(dy, mask, p):
    """dx = dy * m / (1 - p) with the packed keep mask ``mask`` of the forward.

    Raises:
        ValueError: p outside [0, 1], or mask does not hold one bit per element of dy.
        TypeError: mask is not a uint8 tensor.
    """
    scale = dropout_scale(p)
    check_dropout_mask(dy, mask)
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    numel = dy.numel()
    if numel:
        with device_guard(dy):
            _dropout_bwd_kernel[(cdiv(numel, _BLOCK_BWD),)](
                dy, mask.contiguous(), dx, numel, scale, BLOCK=_BLOCK_BWD, num_warps=8
            )
    return dx


def dropout_bwd_dbias(dy, mask, p):
    """(dx, dbias): dx = dy * m / (1 - p) and dbias = its float32 column sums over the rows of dy [..., H].

    One kernel writes dx and the column sums of each _DBIAS_ROWS rows (from the unrounded products),
    ``column_sums`` adds those partial rows in a fixed order (deterministic, no atomics). H must be a
    multiple of 8, so that each row's mask bits start on a byte (``SUPPORTS`` sends other H elsewhere).

    Raises:
        ValueError: p outside [0, 1], mask does not hold one bit per element of dy, or dy is 0-d.
        TypeError: mask is not a uint8 tensor. NotImplementedError: H is not a multiple of 8.
    """
    scale = dropout_scale(p)
    check_dropout_dbias(dy, mask)
    h = dy.shape[-1]
    if h % 8:
        raise NotImplementedError(f"flagos dropout_bwd_dbias: {_UNALIGNED.format(h)}; use another backend for this call")
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    m = dy.numel() // h if h else 0
    partials = torch.empty((cdiv(m, _DBIAS_ROWS), h), dtype=torch.float32, device=dy.device)
    if dy.numel():
        with device_guard(dy):
            _dropout_bwd_dbias_kernel[(cdiv(m, _DBIAS_ROWS) * cdiv(h, 8 * _DBIAS_BYTES),)](
                dy, mask.contiguous(), dx, partials, m, h, scale, ROWS=_DBIAS_ROWS, STEP=_DBIAS_STEP, BYTES=_DBIAS_BYTES,
                num_warps=4,
            )  # fmt: skip
    return dx, column_sums(partials, torch.float32)[0]


def bias_dropout_add_fwd(x, bias, residual, p):
    """out = residual + (x + bias) * m / (1 - p), m ~ Bernoulli(1 - p), in one kernel (float32 math).

    Args:
        x: float32 / bfloat16 / float16 tensor [..., H].
        bias: [H], broadcast over the rows, or None.
        residual: tensor of x's shape.
        p: drop probability in [0, 1].

    Returns:
        (out with x's shape and dtype, keep mask m packed eight elements per byte); the backward is
        :func:`dropout_bwd` with m.

    Raises:
        ValueError: p outside [0, 1], bias not [H], or residual's shape differs from x's.
        TypeError: bias or residual is not a tensor.
    """
    scale = dropout_scale(p)
    check_bias_dropout_add(x, bias, residual)
    return _drop_launch(x, bias, residual, p, scale)


@cached_launch
@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,  # *z [N, V], row stride stride_z
    target_ptr,  # *int [N]
    loss_ptr,  # *float32 [N]
    lse_ptr,  # *float32 [N]
    V,  # vocabulary size
    stride_z,  # elements between rows of z
    label_smoothing,  # eps
    ignore_index,  # target value of ignored rows
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_z
    m = float("-inf")
    s = 0.0
    z_sum = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no inf - inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)
        m = m_new
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    target = tl.load(target_ptr + row).to(tl.int64)
    in_range = (target >= 0) & (target < V)
    z_t = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = (1.0 - label_smoothing) * (lse - z_t) + label_smoothing * (lse - z_sum / V)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@cached_launch
@triton.jit
def _cross_entropy_bwd_kernel(
    grad_ptr,  # *grad_loss [N], stride stride_g
    logits_ptr,  # *z [N, V], row stride stride_z
    target_ptr,  # *int [N]
    lse_ptr,  # *lse [N]
    dz_ptr,  # *dz [N, V] contiguous, logits' dtype
    V,  # vocabulary size
    stride_g,  # elements between entries of grad_loss (0 when broadcast)
    stride_z,  # elements between rows of z
    label_smoothing,  # eps
    ignore_index,  # target value of ignored rows
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    g = tl.load(grad_ptr + row64 * stride_g).to(tl.float32)
    in_range = (target >= 0) & (target < V)
    g = tl.where(in_range, g, float("nan"))  # the row of an out-of-range target: NaN, as its loss
    g = tl.where(target == ignore_index, 0.0, g)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(logits_ptr + row64 * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        hit = tl.where(cols == target, 1.0 - label_smoothing, 0.0)
        dz = g * (tl.exp(z - lse) - hit - label_smoothing / V)
        tl.store(dz_ptr + row64 * V + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def cross_entropy_fwd(logits, target, label_smoothing=0.0, ignore_index=-100):
    """Per-row cross entropy: loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j).

    Args:
        logits: [N, V] float tensor.
        target: [N] integer class indices; ``ignore_index`` rows get loss 0.
        label_smoothing: eps in [0, 1].
        ignore_index: target value that marks rows to ignore.

    Returns:
        (loss float32 [N], lse float32 [N]); an out-of-range target gives a NaN loss.

    Raises:
        ValueError / TypeError: bad shapes (V = 0 included), dtypes or eps.
    """
    check_cross_entropy(logits, target, label_smoothing)
    logits = _unit_cols(logits)
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n and vocab:
        with device_guard(logits):
            _cross_entropy_fwd_kernel[(n,)](
                logits, target.contiguous(), loss, lse, vocab, logits.stride(0), float(label_smoothing),
                int(ignore_index), BLOCK_V=min(_BLOCK_V, next_power_of_2(vocab)), num_warps=8,
            )  # fmt: skip
    return loss, lse


def cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing=0.0, ignore_index=-100):
    """dz_j = grad_loss (softmax(z)_j - (1 - eps) [j == t] - eps / V), zero for ignored rows.

    Args:
        grad_loss: [N] gradient of the per-row loss (an expanded scalar is fine).
        logits, target, label_smoothing, ignore_index: as given to :func:`cross_entropy_fwd`.
        lse: [N] from :func:`cross_entropy_fwd`.

    Returns:
        dlogits with logits' shape and dtype.

    Raises:
        ValueError / TypeError: as :func:`cross_entropy_fwd`, or grad_loss / lse not of shape [N].
        The row of an out-of-range target gets a NaN gradient.
    """
    check_cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing)
    logits = _unit_cols(logits)
    n, vocab = logits.shape
    dz = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n and vocab:
        with device_guard(logits):
            _cross_entropy_bwd_kernel[(n,)](
                grad_loss, logits, target.contiguous(), lse.contiguous(), dz, vocab, grad_loss.stride(0),
                logits.stride(0), float(label_smoothing), int(ignore_index),
                BLOCK_V=min(_BLOCK_V, next_power_of_2(vocab)), num_warps=8,
            )  # fmt: skip
    return dz


def _same_device(key, *others) -> object:
    """True when every tensor of ``others`` is on the key tensor's device, else a Reject naming both."""
    if isinstance(key, torch.Tensor):
        for other in others:
            if isinstance(other, torch.Tensor) and other.device != key.device:
                return Reject(f"an operand is on {other.device} but the first one on {key.device}")
    return True


def _fwd_fits(logits, target, label_smoothing=0.0, ignore_index=-100):
    return _same_device(logits, target)


def _bwd_fits(grad_loss, logits, target, lse, label_smoothing=0.0, ignore_index=-100):
    return _same_device(logits, grad_loss, target, lse)


def _floats_on_one_device(floats, *others) -> object:
    """True when the ``floats`` tensors are float32 / bfloat16 / float16 and all are on one device, else why not."""
    for t in floats:
        if isinstance(t, torch.Tensor) and t.dtype not in _DTYPES:
            return Reject(f"flagos dropout reads float32 / bfloat16 / float16 operands, got {t.dtype}")
    return _same_device(*floats, *others)


def _dropout_fwd_fits(x, p):
    return _floats_on_one_device((x,))


def _dropout_bwd_fits(dy, mask, p):
    return _floats_on_one_device((dy,), mask)


def _dropout_bwd_dbias_fits(dy, mask, p):
    if isinstance(dy, torch.Tensor) and dy.dim() >= 1:
        if dy.shape[-1] % 8:
            return Reject(_UNALIGNED.format(dy.shape[-1]))
        if dy.shape[-1] >= _MAX_COLS:
            return Reject(f"dy has {dy.shape[-1]} columns; the kernel indexes columns in int32 (< 2^30)")
    return _floats_on_one_device((dy,), mask)


def _bias_dropout_add_fits(x, bias, residual, p):
    if isinstance(bias, torch.Tensor) and bias.numel() >= _MAX_COLS:
        return Reject(f"bias has {bias.numel()} elements; the kernel indexes columns in int32 (< 2^30)")
    return _floats_on_one_device((x, bias, residual))


SUPPORTS = {
    "dropout_fwd": _dropout_fwd_fits,
    "dropout_bwd": _dropout_bwd_fits,
    "dropout_bwd_dbias": _dropout_bwd_dbias_fits,
    "bias_dropout_add_fwd": _bias_dropout_add_fits,
    "cross_entropy_fwd": _fwd_fits,
    "cross_entropy_bwd": _bwd_fits,
}
# under torch.compile the dropout kernels are traced as they are (Inductor launches these Triton kernels
# from its own code): Inductor fuses the reference backend's traced mask (torch.rand, then bits packed with
# shifts) into one slow reduction kernel, and as custom ops each call pays the dispatcher's host time
UNDER_COMPILE = dict.fromkeys(["dropout_fwd", "dropout_bwd", "dropout_bwd_dbias", "bias_dropout_add_fwd"], "trace")
