"""Reference (pure PyTorch) quantization ops. See plugin/catalog/quantization.py for the contract.

Per tensor:   q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),  scale_inv = 1 / scale,
              amax = max |x| over finite x;  dequantize: x = q * scale_inv (float32, then cast).
              cast_transpose_dbias adds dbias[j] = sum_i x[i, j] in float32.
Per block:    a = max(max |T|, eps) per tile T, scale = fp8_max / a (1 when a is 0 or not finite,
              float32 max when it overflows), optionally rounded down to 2^floor(log2(scale)).
Delayed scaling (one step): amax from the history before the roll, s = (fp8_max / amax) / 2^margin
              where amax is finite and > 0 (else the old s), inf -> float32 max, roll by -1, row 0 = 0;
              delayed_scaling_update_ applies it in place where H[0] != 0, then scale_inv = 1 / s.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.plugin.backends._checks import (
    check_amax_epsilon,
    check_block_range,
    check_dbias_dtype,
    check_delayed_scaling_update,
    check_delayed_scaling_update_,
    check_delayed_scaling_update_many_,
)

from .._fp8 import (
    amax_finite,
    check_2d,
    check_dequantize_args,
    check_fp8_dtype,
    check_fp8_tensor,
    check_high_precision,
    check_out_dtype,
    check_quantize_args,
    check_tensor,
    fp8_max_of,
    quantize_fp32,
    saturating_cast,
    scalar_f32,
)

__all__ = [
    "quantize",
    "dequantize",
    "cast_transpose",
    "quantize_transposed",
    "cast_transpose_dbias",
    "fp8_transpose",
    "compute_amax",
    "current_scale",
    "scale_from_amax",
    "quantize_blockwise",
    "block_amax_of_range",
    "quantize_blockwise_range",
    "cast_transpose_blockwise",
    "cast_transpose_blockwise_dbias",
    "dequantize_blockwise",
    "delayed_scaling_update",
    "delayed_scaling_update_",
    "delayed_scaling_update_many_",
]


def quantize(x, scale, fp8_dtype, amax_out=None):
    """Per-tensor saturating cast to FP8: q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)).

    Args:
        x: float32/bfloat16/float16 tensor of any shape.
        scale: one-element float32 tensor.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: None, or a one-element float32 tensor on x's device: set to max(amax_out, amax)
            in place and returned as amax.

    Returns:
        (q, scale_inv, amax): q has x's shape in ``fp8_dtype``; scale_inv = 1 / scale and
        amax = max |x| over finite x are 0-d float32.

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad scale, fp8_dtype or amax_out.
    """
    check_quantize_args(x, scale, fp8_dtype, amax_out)
    return quantize_fp32(x.float(), scale, fp8_dtype, amax_out)


def dequantize(q, scale_inv, out_dtype):
    """x = q * scale_inv, computed in float32 and cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8. ValueError: scale_inv is not one element or out_dtype is not a float dtype.
    """
    check_dequantize_args(q, scale_inv, out_dtype)
    scale_inv_f32 = scalar_f32(scale_inv, "scale_inv")
    return (q.float() * scale_inv_f32).to(out_dtype)


def cast_transpose(x, scale, fp8_dtype, amax_out=None):
    """Quantize a 2-D tensor and also return its contiguous transpose: q = quantize(x), q_t = q^T.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax) as in :func:`quantize`.
    """
    check_high_precision(x)
    check_2d(x, "x")
    q, scale_inv, amax = quantize(x, scale, fp8_dtype, amax_out)
    return q, q.t().contiguous(), scale_inv, amax


def quantize_transposed(x, scale, fp8_dtype, amax_out=None):
    """Only the transposed half of :func:`cast_transpose`: q_t = quantize(x)^T, contiguous.

    Returns:
        (q_t [N, M], scale_inv, amax) as in :func:`quantize`.
    """
    _, q_t, scale_inv, amax = cast_transpose(x, scale, fp8_dtype, amax_out)
    return q_t, scale_inv, amax


def cast_transpose_dbias(x, scale, fp8_dtype, amax_out=None, dbias_dtype=None):
    """:func:`cast_transpose` plus the bias gradient dbias[j] = sum_i x[i, j], accumulated in float32.

    Returns:
        (q [M, N], q_t [N, M], scale_inv, amax, dbias [N] in ``dbias_dtype``, float32 if None); NaN / inf in x
        propagate into dbias.

    Raises:
        TypeError / ValueError: as :func:`cast_transpose`, or a dbias_dtype that is not a float dtype.
    """
    check_dbias_dtype(dbias_dtype)
    q, q_t, scale_inv, amax = cast_transpose(x, scale, fp8_dtype, amax_out)
    return q, q_t, scale_inv, amax, _column_sums(x, dbias_dtype)


def _column_sums(x: torch.Tensor, dbias_dtype) -> torch.Tensor:
    """sum_i x[i, j] accumulated in float32, rounded once to ``dbias_dtype`` (float32 if None)."""
    sums = x.sum(dim=0, dtype=torch.float32)
    return sums if dbias_dtype in (None, torch.float32) else sums.to(dbias_dtype)


def fp8_transpose(q):
    """Contiguous transpose of a 2-D FP8 tensor, no rescaling: q_t[j, i] = q[i, j]."""
    check_fp8_tensor(q, "q")
    check_2d(q, "q")
    return q.t().contiguous()


def compute_amax(x):
    """amax = max |x| over the finite elements of x, a 0-d float32 tensor (0 for an empty x)."""
    check_high_precision(x)
    return amax_finite(x)


def scale_from_amax(amax, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """scale = fp8_max / max(amax, eps): 1 for an amax of 0, inf or NaN, float32 max on overflow, with
    ``power_2_scale`` 2^floor(log2(scale)) (see the catalog). Every op here is a kernel on a GPU.

    Raises:
        TypeError: amax is not a tensor. ValueError: bad fp8_dtype or amax_epsilon.
    """
    check_tensor(amax, "amax")
    check_fp8_dtype(fp8_dtype)
    check_amax_epsilon(amax_epsilon)
    amax = amax.float()
    usable = (amax > 0) & (amax < float("inf"))  # NaN compares False
    safe = torch.clamp(amax, min=amax_epsilon) if amax_epsilon > 0 else amax
    # a tensor quotient, correctly rounded (``float / tensor`` is reciprocal-then-multiply in torch: two roundings)
    quotient = torch.full_like(safe, fp8_max_of(fp8_dtype)) / safe
    scale = torch.where(usable, quotient, 1.0).clamp_(max=torch.finfo(torch.float32).max)
    if power_2_scale:  # scale = m 2^e with m in [0.5, 1), so 2^floor(log2(scale)) = 2^(e - 1), exactly
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def current_scale(x, fp8_dtype, amax_epsilon=0.0, power_2_scale=False):
    """(scale_from_amax(compute_amax(x), ...), compute_amax(x)).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: bad fp8_dtype or amax_epsilon.
    """
    amax = compute_amax(x)
    return scale_from_amax(amax, fp8_dtype, amax_epsilon, power_2_scale), amax


def _check_block_args(block_rows, block_cols, amax_epsilon=0.0) -> None:
    for name, value in (("block_rows", block_rows), ("block_cols", block_cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (e.g. 1 x 128, 128 x 128 or 1 x 32 tiles)")
    check_amax_epsilon(amax_epsilon)


def _tiles(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """x [M, N] zero-padded to whole tiles and viewed as [M/br, br, N/bc, bc]."""
    m_tiles, n_tiles = -(-x.shape[0] // block_rows), -(-x.shape[1] // block_cols)
    padded = torch.nn.functional.pad(x, (0, n_tiles * block_cols - x.shape[1], 0, m_tiles * block_rows - x.shape[0]))
    return padded.reshape(m_tiles, block_rows, n_tiles, block_cols)


def _block_scale(tile_amax: torch.Tensor, fp8_dtype, power_2_scale: bool, amax_epsilon: float) -> torch.Tensor:
    """scale = fp8_max / max(a, eps); 1 when that is 0 or not finite; inf -> float32 max; pow-2 rounds down."""
    a = tile_amax.clamp_min(amax_epsilon)
    valid = torch.isfinite(a) & (a > 0)
    # tensor / tensor: torch computes ``python_float / tensor`` as a product with a reciprocal
    scale = torch.where(valid, torch.full_like(a, fp8_max_of(fp8_dtype)) / a, torch.ones_like(a))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if power_2_scale:
        _, exponent = torch.frexp(scale)  # scale = m * 2^e with m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def quantize_blockwise(x, fp8_dtype, block_rows, block_cols, power_2_scale, amax_epsilon):
    """Block-scaled FP8 cast of a 2-D tensor, one scale per ``block_rows x block_cols`` tile.

    q = cast_fp8(clip(T * scale_T)), scale_T = fp8_max / max(max |T|, eps) (see the module docstring);
    a tile holding inf or NaN gets scale 1. Edge tiles may be ragged.

    Returns:
        (q [M, N] in ``fp8_dtype``, scale_inv float32 [ceil(M / block_rows), ceil(N / block_cols)]).

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: x not 2-D, bad block sizes,
        epsilon or fp8_dtype.
    """
    check_high_precision(x)
    check_2d(x, "x")
    check_fp8_dtype(fp8_dtype)
    _check_block_args(block_rows, block_cols, amax_epsilon)
    tiles = _tiles(x.float(), block_rows, block_cols)
    scale = _block_scale(tiles.abs().amax(dim=(1, 3)), fp8_dtype, bool(power_2_scale), float(amax_epsilon))
    q_tiles = saturating_cast(tiles * scale[:, None, :, None], fp8_dtype)
    m, n = x.shape
    q = q_tiles.reshape(tiles.shape[0] * block_rows, tiles.shape[2] * block_cols)[:m, :n].contiguous()
    return q, torch.reciprocal(scale)


def _range_window(x, rows, cols, start, block_rows):
    """(window, first tile row, offset): the tile rows of a [rows, cols] matrix that the range [start, start + n) of
    x's n elements touches, as a zero-filled float32 [tile rows * block_rows, cols] holding x at flat ``offset``."""
    n = x.numel()
    first = start // cols // block_rows
    last = (start + n - 1) // cols // block_rows + 1 if n else first
    window = torch.zeros((last - first) * block_rows * cols, dtype=torch.float32, device=x.device)
    offset = start - first * block_rows * cols
    window[offset:offset + n] = x.reshape(-1)
    return window.view(-1, cols), first, offset


def block_amax_of_range(x, rows, cols, start, block_rows, block_cols):
    """Per-tile max |x| of the range [start, start + x.numel()) of a [rows, cols] matrix (0 where it has no element).

    Returns:
        float32 [ceil(rows / block_rows), ceil(cols / block_cols)].

    Raises:
        TypeError / ValueError: see ``check_block_range``.
    """
    check_block_range(x, rows, cols, start, block_rows, block_cols)
    window, first, _ = _range_window(x, rows, cols, start, block_rows)
    amax = torch.zeros(-(-rows // block_rows), -(-cols // block_cols), dtype=torch.float32, device=x.device)
    tile_amax = _tiles(window.abs(), block_rows, block_cols).amax(dim=(1, 3))
    amax[first:first + tile_amax.shape[0]] = tile_amax
    return amax


def quantize_blockwise_range(x, amax, rows, cols, start, block_rows, block_cols, fp8_dtype, power_2_scale, amax_epsilon):
    """The range's elements cast with the scales of ``amax`` (``quantize_blockwise``'s rule per tile).

    Returns:
        (q [x.numel()] in ``fp8_dtype``, scale_inv float32 of amax's shape).

    Raises:
        TypeError / ValueError: see ``check_block_range``; amax not float32 [ceil(rows / br), ceil(cols / bc)]
        on x's device; bad fp8_dtype or epsilon.
    """
    check_block_range(x, rows, cols, start, block_rows, block_cols, amax=amax)
    check_fp8_dtype(fp8_dtype)
    check_amax_epsilon(amax_epsilon)
    scale = _block_scale(amax, fp8_dtype, bool(power_2_scale), float(amax_epsilon))
    window, first, offset = _range_window(x, rows, cols, start, block_rows)
    tiles = _tiles(window, block_rows, block_cols)
    q_tiles = saturating_cast(tiles * scale[first:first + tiles.shape[0], None, :, None], fp8_dtype)
    q = q_tiles.reshape(window.shape[0], tiles.shape[2] * block_cols)[:, :cols].reshape(-1)[offset:offset + x.numel()].clone()
    return q, torch.reciprocal(scale)


def cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon):
    """1 x ``block_len`` block casts of x and of x^T, each with its own scales (not q^T).

    Returns:
        (q [M, N], scale_inv [M, ceil(N / B)], q_t [N, M], scale_inv_t [N, ceil(M / B)]).

    Raises:
        TypeError / ValueError: as :func:`quantize_blockwise`.
    """
    q, scale_inv = quantize_blockwise(x, fp8_dtype, 1, block_len, power_2_scale, amax_epsilon)
    q_t, scale_inv_t = quantize_blockwise(x.t(), fp8_dtype, 1, block_len, power_2_scale, amax_epsilon)
    return q, scale_inv, q_t, scale_inv_t


def cast_transpose_blockwise_dbias(x, fp8_dtype, block_len, power_2_scale, amax_epsilon, dbias_dtype=None):
    """:func:`cast_transpose_blockwise` plus the bias gradient dbias[j] = sum_i x[i, j], accumulated in float32.

    Returns:
        (q, scale_inv, q_t, scale_inv_t, dbias [N] in ``dbias_dtype``, float32 if None); NaN / inf in x propagate
        into dbias.

    Raises:
        TypeError / ValueError: as :func:`quantize_blockwise`, or a dbias_dtype that is not a float dtype.
    """
    check_dbias_dtype(dbias_dtype)
    return (*cast_transpose_blockwise(x, fp8_dtype, block_len, power_2_scale, amax_epsilon), _column_sums(x, dbias_dtype))


def dequantize_blockwise(q, scale_inv, block_rows, block_cols, out_dtype):
    """x[i, j] = q[i, j] * scale_inv[i // block_rows, j // block_cols] in float32, cast to ``out_dtype``.

    Raises:
        TypeError: q is not FP8. ValueError: q not 2-D, scale_inv of the wrong shape, bad block sizes
        or out_dtype.
    """
    check_fp8_tensor(q, "q")
    check_2d(q, "q")
    _check_block_args(block_rows, block_cols)
    check_tensor(scale_inv, "scale_inv")
    check_out_dtype(out_dtype)
    m, n = q.shape
    expected = (-(-m // block_rows), -(-n // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)} but q {tuple(q.shape)} with {block_rows} x {block_cols} "
            f"tiles needs {expected}"
        )
    full = scale_inv.float().repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)[:m, :n]
    return (q.float() * full).to(out_dtype)


def delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo) -> Tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling step for N tensors, as plugin/catalog/quantization.py states it: s_new =
    (fp8_max / amax) / 2^margin, then the history rolled; fp8_max may also be a tensor of 1 or N elements.

    Returns:
        (H_new [L, N], s_new [N]), new float32 tensors.

    Raises:
        ValueError: shapes that do not match, a non-finite margin or an unknown amax_compute_algo.
    """
    check_delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo)
    return _delayed_step(amax_history, scale, fp8_max, margin, amax_compute_algo)


def delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax=None) -> None:
    """``delayed_scaling_update`` in place on the active columns (H[0] != 0, NaN included), then scale_inv = 1 / s.

    Args:
        amax_history: H float32 [L, N], updated in place; row 0 holds this step's amaxes.
        scale: s float32 [N], updated in place.
        scale_inv: float32 [N], receives 1 / s for every column (idle ones included).
        fp8_max, margin, amax_compute_algo: as in ``delayed_scaling_update``.
        amax: None, or float32 [K] (K <= N) of amaxes not yet in H: H[0, :K] = max(H[0, :K], amax) first.

    Raises:
        TypeError: H, s, scale_inv or amax not float32.
        ValueError: shapes that do not match, tensors on different devices, a non-finite margin or an
            unknown amax_compute_algo.
    """
    check_delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax)
    if amax is not None:
        recorded = amax_history[0, : amax.shape[0]]
        recorded.copy_(torch.maximum(recorded, amax))
    history_new, scale_new = _delayed_step(amax_history, scale, fp8_max, margin, amax_compute_algo)
    active = amax_history[0] != 0  # NaN != 0: a NaN amax is active
    torch.where(active, history_new, amax_history, out=amax_history)
    torch.where(active, scale_new, scale, out=scale)
    torch.reciprocal(scale, out=scale_inv)


def delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo) -> None:
    """``delayed_scaling_update_`` of each state (amax_histories[i], scales[i], scale_invs[i]) in place.

    Raises:
        TypeError / ValueError: lists of different lengths, fp8_max not one float, tensors sharing memory,
            states on several devices, or a state ``delayed_scaling_update_`` rejects.
    """
    check_delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo)
    for history, scale, scale_inv in zip(amax_histories, scales, scale_invs):
        delayed_scaling_update_(history, scale, scale_inv, fp8_max, margin, amax_compute_algo)


def _delayed_step(amax_history, scale, fp8_max, margin, amax_compute_algo) -> Tuple[torch.Tensor, torch.Tensor]:
    """(H_new, s_new) of checked arguments: the math of ``delayed_scaling_update``."""
    history = amax_history.detach().float()
    scale_old = scale.detach().float()
    amax = history.amax(dim=0) if amax_compute_algo == "max" else history[0]
    fp8_max_f32 = torch.as_tensor(fp8_max, dtype=torch.float32, device=history.device).reshape(-1)
    scale_new = (fp8_max_f32 / amax) / torch.full_like(amax, 2.0 ** float(margin))
    scale_new = torch.where(torch.isfinite(amax) & (amax > 0), scale_new, scale_old)
    scale_new = torch.where(torch.isinf(scale_new), torch.full_like(scale_new, torch.finfo(torch.float32).max), scale_new)
    rolled = torch.roll(history, -1, dims=0)
    # row 0 zeroed without writing a Python 0 into it: traced, that write copies a CPU tensor to the
    # device, which a compiled backward does with a stream synchronization
    history_new = torch.cat([torch.zeros_like(rolled[:1]), rolled[1:]])
    return history_new, scale_new
