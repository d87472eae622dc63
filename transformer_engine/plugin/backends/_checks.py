"""Argument checks of op contracts that every backend enforces the same way (before any work).

The checks belong to the op, not to one implementation, so the reference and the flagos backend
call these instead of each carrying a copy; the elementary ones live in ``backends/_fp8.py``.
"""

from __future__ import annotations

import math

import torch

from transformer_engine.plugin.backends._activation_ops import backward_name, check_activation
from transformer_engine.plugin.backends._dropout_mask import packed_bytes
from transformer_engine.plugin.backends._fp8 import (
    check_fp8_dtype,
    check_fp8_output,
    check_high_precision,
    check_last_dim,
    check_out_dtype,
    check_quantize_args,
    check_tensor,
    is_fp8,
)

__all__ = [
    "check_norm_fwd",
    "check_norm_bwd",
    "check_softmax_mask",
    "dropout_scale",
    "check_dropout_mask",
    "check_dropout_dbias",
    "check_amax_epsilon",
    "check_bias_dropout_add",
    "check_block_range",
    "check_dbias_dtype",
    "check_delayed_scaling_update",
    "check_delayed_scaling_update_",
    "check_cross_entropy",
    "check_cross_entropy_bwd",
    "check_tensor_lists",
    "check_multi_tensor_adam",
    "check_activation_input",
    "check_activation_dy",
    "check_activation_quantize",
    "check_rope",
    "check_softmax_input",
    "check_softmax_bwd",
    "check_gemm_output",
    "gemm_result_dtype",
    "check_splits",
    "check_group_vector",
    "check_grouped_rows",
    "check_cast_transpose_grouped",
    "check_gemm_grouped",
    "check_gemm_grouped_wgrad",
]

_AMAX_ALGOS = ("max", "most_recent")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_splits(m_splits, rows: int, name: str = "m_splits") -> None:
    """ValueError unless ``m_splits`` is a sequence of G >= 1 non-negative Python ints with sum = ``rows``."""
    if not isinstance(m_splits, (list, tuple)) or not m_splits:
        raise ValueError(f"{name}={m_splits!r} must be a list or tuple of >= 1 non-negative ints summing to {rows}")
    for m in m_splits:
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name}={list(m_splits)!r} holds {m!r}; each split must be a non-negative int")
    if sum(m_splits) != rows:
        raise ValueError(f"{name}={list(m_splits)!r} sums to {sum(m_splits)}; the splits must sum to {rows} (x's rows)")


def check_group_vector(t, groups: int, name: str, device) -> None:
    """A per-group vector: a float32 1-D tensor of ``groups`` elements on ``device`` (any stride).

    Raises:
        TypeError: not a tensor, or not float32. ValueError: another shape, or another device.
    """
    check_tensor(t, name)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be float32 (one value per split)")
    if tuple(t.shape) != (groups,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be [{groups}] (one value per split)")
    expected = torch.device(device)
    if t.device.type != expected.type or expected.index not in (None, t.device.index):
        raise ValueError(f"{name} is on {t.device} but must be on {device} (x's device)")


def check_grouped_rows(x, m_splits) -> None:
    """x a high-precision [M, K] tensor whose rows ``m_splits`` (G >= 1 non-negative ints) split, summing to M."""
    check_high_precision(x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    check_splits(m_splits, x.shape[0])


def check_cast_transpose_grouped(x, m_splits, scale, fp8_dtype, amax_out=None) -> None:
    """``cast_transpose_grouped``: :func:`check_grouped_rows`, an FP8 dtype, scale (and amax_out) float32 [G] on x's device."""
    check_grouped_rows(x, m_splits)
    check_fp8_dtype(fp8_dtype)
    check_group_vector(scale, len(m_splits), "scale", x.device)
    if amax_out is not None:
        check_group_vector(amax_out, len(m_splits), "amax_out", x.device)


def _check_grouped_operands(a, b, a_scale_inv, b_scale_inv, groups: int, out_dtype) -> None:
    """Both operands tensors, FP8 ones with a float32 [G] scale_inv each (and an out_dtype), none for high-precision ones."""
    for t, scale_inv, name in ((a, a_scale_inv, "a"), (b, b_scale_inv, "b")):
        check_tensor(t, name)
        if is_fp8(t):
            if scale_inv is None:
                raise ValueError(f"{name} is FP8 ({t.dtype}) but {name}_scale_inv is None; pass one scale_inv per split")
            check_group_vector(scale_inv, groups, f"{name}_scale_inv", t.device)
        elif scale_inv is not None:
            raise ValueError(f"{name}_scale_inv was given but {name} is {t.dtype}, not FP8; pass {name}_scale_inv=None")
    if out_dtype is None and is_fp8(a):
        raise ValueError(f"the first operand is FP8 ({a.dtype}), so a grouped GEMM needs out_dtype (e.g. torch.bfloat16)")


def check_gemm_grouped(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias) -> None:
    """``gemm_grouped``: a [M, K] split by rows, b [G, N, K], bias None or [G, N], scales as the operands need."""
    _check_grouped_operands(a, b, a_scale_inv, b_scale_inv, len(m_splits), out_dtype)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"gemm_grouped takes a [M, K] and b [G, N, K], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    check_splits(m_splits, a.shape[0])
    groups, n, k = b.shape
    if groups != len(m_splits) or k != a.shape[1]:
        raise ValueError(f"b {tuple(b.shape)} must be [G={len(m_splits)}, N, K={a.shape[1]}] for a {tuple(a.shape)}")
    if bias is not None and tuple(bias.shape) != (groups, n):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [G, N] = [{groups}, {n}]")


def check_gemm_grouped_wgrad(a_t, b_t, m_splits, a_scale_inv, b_scale_inv, out_dtype) -> None:
    """``gemm_grouped_wgrad``: a_t [N, M] and b_t [K, M] split by columns, scales as the operands need."""
    _check_grouped_operands(a_t, b_t, a_scale_inv, b_scale_inv, len(m_splits), out_dtype)
    if a_t.dim() != 2 or b_t.dim() != 2 or a_t.shape[1] != b_t.shape[1]:
        raise ValueError(f"gemm_grouped_wgrad takes a_t [N, M] and b_t [K, M], got {tuple(a_t.shape)} and {tuple(b_t.shape)}")
    check_splits(m_splits, a_t.shape[1])


def check_norm_fwd(x, weight, bias, eps, fp8_scale, fp8_dtype, out_dtype, amax_out=None) -> None:
    """layernorm_fwd / rmsnorm_fwd: float x with a non-empty last dim H, weight (and bias) [H], eps >= 0."""
    check_high_precision(x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dim to normalize over, got shape {tuple(x.shape)}")
    check_tensor(weight, "weight")
    check_last_dim(x, weight, "weight")
    if bias is not None:
        check_tensor(bias, "bias")
        check_last_dim(x, bias, "bias")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps!r} must be a float >= 0 (e.g. 1e-5)")
    check_fp8_output(fp8_scale, fp8_dtype, x, amax_out)
    if out_dtype is not None:
        check_out_dtype(out_dtype)


def check_norm_bwd(dy, x, stats, weight) -> None:
    """layernorm_bwd / rmsnorm_bwd: dy like x, weight [H], each (name, tensor) statistic with one value per row."""
    check_high_precision(x)
    check_high_precision(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}; they must match")
    check_tensor(weight, "weight")
    check_last_dim(x, weight, "weight")
    rows = x.numel() // max(x.shape[-1], 1)
    for name, t in stats:
        check_tensor(t, name)
        if t.numel() != rows:
            raise ValueError(f"{name} has {t.numel()} elements but x {tuple(x.shape)} has {rows} rows; pass the forward's {name}")


def check_softmax_mask(x: torch.Tensor, mask) -> None:
    """scaled_masked_softmax_forward: a torch.bool mask [b or 1, 1, sq, sk] for scores x [b, h, sq, sk]."""
    check_tensor(mask, "mask")
    b, _, sq, sk = x.shape
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (sq, sk):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; for x {tuple(x.shape)} it must be [{b} or 1, 1, {sq}, {sk}]")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask has dtype {mask.dtype}; pass a torch.bool tensor (True = masked out)")


def dropout_scale(p: float) -> float:
    """1 / (1 - p), the scale of the kept elements (0 when p = 1: nothing is kept); ValueError unless 0 <= p <= 1."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1]")
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def check_amax_epsilon(amax_epsilon) -> None:
    """amax_epsilon (the floor of the amax a scale divides by) is 0, a float32 value > 0, or inf.

    NaN and negative values are meaningless; a finite value beyond float32 cannot be the float32 the
    kernels and the reference's clamp compute with.
    """
    eps = float(amax_epsilon)
    if not eps >= 0.0 or _FLOAT32_MAX < eps < math.inf:
        raise ValueError(f"amax_epsilon={amax_epsilon!r} must be 0, a float32 value > 0 or inf (0 disables it)")


def check_dbias_dtype(dbias_dtype) -> None:
    """The ``dbias_dtype`` of the casts with a bias gradient: None (float32) or a high-precision float dtype."""
    if dbias_dtype is not None:
        check_out_dtype(dbias_dtype, "dbias_dtype")


def check_block_range(x, rows, cols, start, block_rows, block_cols, amax=None) -> None:
    """The arguments of ``block_amax_of_range`` / ``quantize_blockwise_range``: x a high-precision tensor whose
    elements fit [start, start + x.numel()) of a [rows, cols] matrix, positive tiles; amax (when given) float32 of
    the tile grid's shape on x's device."""
    check_high_precision(x)
    for name, value in (("rows", rows), ("cols", cols), ("block_rows", block_rows), ("block_cols", block_cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + x.numel() > rows * cols:
        raise ValueError(f"start={start!r} with {x.numel()} elements does not fit a [{rows}, {cols}] matrix "
                         f"(0 <= start and start + x.numel() <= {rows * cols})")
    if amax is None:
        return
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(amax.shape) != grid or amax.device != x.device:
        got = f"{amax.dtype} {tuple(amax.shape)} on {amax.device}" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"amax must be float32 {grid} (the tile grid) on {x.device}, got {got}")


def check_dropout_mask(dy: torch.Tensor, mask) -> None:
    """dropout_bwd: ``mask`` is the forward's packed keep mask (uint8, one bit per element of dy)."""
    check_tensor(mask, "mask")
    if mask.dtype != torch.uint8:
        raise TypeError(f"dropout mask has dtype {mask.dtype}; pass the packed uint8 keep mask returned by the forward")
    if mask.dim() != 1 or mask.numel() != packed_bytes(dy.numel()):
        raise ValueError(
            f"dropout mask has shape {tuple(mask.shape)}; the packed mask of a gradient of {dy.numel()} elements "
            f"has {packed_bytes(dy.numel())} bytes"
        )


def check_dropout_dbias(dy: torch.Tensor, mask) -> None:
    """dropout_bwd_dbias: :func:`check_dropout_mask`, and a dy with a last dim H (the bias length)."""
    check_dropout_mask(dy, mask)
    if dy.dim() < 1:
        raise ValueError("dy must have a last dim H (the bias length), got a 0-d tensor")


def check_bias_dropout_add(x: torch.Tensor, bias, residual) -> None:
    """bias_dropout_add_fwd: bias None or [H] (H = x's last dim), residual with x's shape."""
    check_tensor(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match")
    if bias is not None:
        check_tensor(bias, "bias")
        if x.dim() == 0:
            raise ValueError("x is 0-d, so it has no hidden dim to add a bias along; pass bias=None")
        check_last_dim(x, bias, "bias")


def check_delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo) -> None:
    """delayed_scaling_update: H [L >= 1, N], scale [N], fp8_max a float or 1 or N elements, finite margin."""
    check_tensor(amax_history, "amax_history")
    check_tensor(scale, "scale")
    if amax_history.dim() != 2 or amax_history.shape[0] < 1:
        raise ValueError(f"amax_history must be [L, N] with L >= 1, got shape {tuple(amax_history.shape)}")
    n = amax_history.shape[1]
    if tuple(scale.shape) != (n,):
        raise ValueError(f"scale has shape {tuple(scale.shape)} but amax_history {tuple(amax_history.shape)} needs [{n}]")
    if isinstance(fp8_max, torch.Tensor) and fp8_max.numel() not in (1, n):
        raise ValueError(f"fp8_max has shape {tuple(fp8_max.shape)}; pass a float or a tensor of 1 or {n} elements")
    _check_margin_and_algo(margin, amax_compute_algo)


def check_delayed_scaling_update_(amax_history, scale, scale_inv, fp8_max, margin, amax_compute_algo, amax=None) -> None:
    """delayed_scaling_update_: as delayed_scaling_update, plus H, s, scale_inv [N] and amax [K], 0 < K <= N (if
    given), float32 on one device."""
    check_delayed_scaling_update(amax_history, scale, fp8_max, margin, amax_compute_algo)
    n = amax_history.shape[1]
    vectors = (("scale_inv", scale_inv),) + ((("amax", amax),) if amax is not None else ())
    for name, t in vectors:
        check_tensor(t, name)
    if tuple(scale_inv.shape) != (n,):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)} but amax_history {tuple(amax_history.shape)} needs [{n}]")
    if amax is not None and (amax.dim() != 1 or not 0 < amax.shape[0] <= n):
        raise ValueError(f"amax has shape {tuple(amax.shape)} but amax_history {tuple(amax_history.shape)} needs [K] "
                         f"with 0 < K <= {n} (the amaxes of its first K columns)")
    for name, t in (("amax_history", amax_history), ("scale", scale)) + vectors:
        if t.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {t.dtype}; the in-place update reads it as float32, so it must be float32")
        if t.device != amax_history.device:
            raise ValueError(f"{name} is on {t.device} but amax_history on {amax_history.device}; move them to one device")


def check_delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo) -> None:
    """delayed_scaling_update_many_: three lists of one length, each state as delayed_scaling_update_ takes
    it, all on one device, no two tensors sharing memory, and fp8_max one float."""
    check_update_lists(amax_histories, scales, scale_invs)
    check_shared_update_args(fp8_max, margin, amax_compute_algo)
    for state in zip(amax_histories, scales, scale_invs):
        check_delayed_scaling_update_(*state, fp8_max, margin, amax_compute_algo)
        if state[0].device != amax_histories[0].device:
            raise ValueError(f"the states are on {amax_histories[0].device} and {state[0].device}; pass states of one device")
    spans = sorted(_byte_span(t) for state in zip(amax_histories, scales, scale_invs) for t in state if t.numel())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError("two of the states' tensors share memory; each state's amax_history, scale and scale_inv "
                             "must be its own (the update writes them all)")


def check_update_lists(amax_histories, scales, scale_invs) -> None:
    """delayed_scaling_update_many_'s three lists: lists (or tuples) of one length."""
    for name, value in (("amax_histories", amax_histories), ("scales", scales), ("scale_invs", scale_invs)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
    if not len(amax_histories) == len(scales) == len(scale_invs):
        raise ValueError(f"amax_histories, scales and scale_invs have {len(amax_histories)}, {len(scales)} and "
                         f"{len(scale_invs)} tensors; pass one of each per state")


def check_shared_update_args(fp8_max, margin, amax_compute_algo) -> None:
    """The arguments delayed_scaling_update_many_ applies to every state: fp8_max one float, a finite margin,
    a known amax_compute_algo."""
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)):
        raise TypeError(f"fp8_max must be one float for every state, got {type(fp8_max).__name__}")
    _check_margin_and_algo(margin, amax_compute_algo)


def _check_margin_and_algo(margin, amax_compute_algo) -> None:
    """A finite margin and a known amax_compute_algo (every delayed-scaling update's)."""
    # traced, margin may be a symbolic float (dynamic shapes), which math cannot read: the recipe checked it
    if not torch.compiler.is_compiling() and not math.isfinite(float(margin)):
        raise ValueError(f"margin={margin!r} must be a finite float (usually 0)")
    if amax_compute_algo not in _AMAX_ALGOS:
        raise ValueError(f"amax_compute_algo={amax_compute_algo!r} must be one of {_AMAX_ALGOS}")


def _byte_span(t: torch.Tensor):
    """(first byte, one past the last byte) of the memory a non-empty tensor's elements occupy."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_cross_entropy(logits, target, label_smoothing: float) -> None:
    """cross_entropy_fwd / _bwd: logits [N, V >= 1], integer target [N], 0 <= label_smoothing <= 1.

    Only shapes, dtypes and the float are checked: target *values* are not (that would read the
    device, a host sync); an out-of-range target gives NaN, as the catalog states.
    """
    check_tensor(logits, "logits")
    check_tensor(target, "target")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}; flatten the leading dims")
    if logits.shape[1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: a row needs at least one class (V >= 1)")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"target shape {tuple(target.shape)} must be [N] = [{logits.shape[0]}] (one class per row)")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of class indices, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")


def check_cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing: float) -> None:
    """cross_entropy_bwd: :func:`check_cross_entropy`, and grad_loss and lse of shape [N]."""
    check_cross_entropy(logits, target, label_smoothing)
    for name, value in (("grad_loss", grad_loss), ("lse", lse)):
        check_tensor(value, name)
        if value.shape != target.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} must be [N] = [{target.shape[0]}]")


def check_tensor_lists(op: str, tensor_lists, names) -> None:
    """multi_tensor_*: ``tensor_lists`` holds len(names) lists of one common length, the tensors of one
    parameter (one index across the lists) have equal sizes, and every tensor is contiguous. Empty lists
    and empty tensors are fine (nothing to do)."""
    if len(tensor_lists) != len(names):
        raise ValueError(f"{op}: tensor_lists must be [{', '.join(names)}] ({len(names)} lists), got {len(tensor_lists)}")
    lengths = [len(lst) for lst in tensor_lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"{op}: the lists [{', '.join(names)}] must have equal lengths, got {lengths}")
    for group in zip(*tensor_lists):
        if len({t.numel() for t in group}) > 1:
            raise ValueError(f"{op}: tensors of one parameter must have equal sizes, got {[tuple(t.shape) for t in group]}")
        for t in group:
            if not t.is_contiguous():  # as TE's multi_tensor_apply: kernels walk raw addresses
                raise ValueError(f"{op}: multi-tensor ops need contiguous tensors, got shape {tuple(t.shape)} strides {t.stride()}")


def check_multi_tensor_adam(tensor_lists, step, mode, bias_correction) -> None:
    """multi_tensor_adam: :func:`check_tensor_lists` of [grads, params, exp_avgs, exp_avg_sqs], mode 0 (L2) or
    1 (AdamW), and step >= 1 when bias_correction is on."""
    check_tensor_lists("multi_tensor_adam", tensor_lists, ("grads", "params", "exp_avgs", "exp_avg_sqs"))
    if mode not in (0, 1):
        raise ValueError(f"multi_tensor_adam: mode={mode} must be 0 (L2 / Adam) or 1 (decoupled / AdamW)")
    if bias_correction and step < 1:
        raise ValueError(f"multi_tensor_adam: step={step} must be >= 1 when bias_correction is on")


def check_activation_input(x, op: str, gated: bool) -> None:
    """The x of activation ``op`` (a forward op name): high precision, and for a gated op a last dim that
    splits in two halves [a, b].

    Raises:
        TypeError: x is not a high-precision float tensor. ValueError: a gated op's last dim is odd (or x is 0-d).
    """
    check_high_precision(x)
    if gated and (x.dim() < 1 or x.shape[-1] % 2):
        raise ValueError(f"{op} splits x's last dim in two halves [a, b], but x has shape {tuple(x.shape)}; it must be even")


def check_activation_dy(dy, x, op: str, gated: bool) -> tuple:
    """The dy of the backward of activation ``op`` (a forward op name, x already checked): a high-precision
    tensor with the forward output's shape (x's, with the last dim halved for a gated op), which is returned.

    Raises:
        TypeError: dy is not a high-precision float tensor. ValueError: dy has another shape.
    """
    check_high_precision(dy, "dy")
    out_shape = (*x.shape[:-1], x.shape[-1] // 2) if gated else tuple(x.shape)
    if tuple(dy.shape) != out_shape:
        raise ValueError(f"{backward_name(op)}: dy has shape {tuple(dy.shape)} but must be {out_shape} (the forward output's)")
    return out_shape


def check_activation_quantize(x, activation: str, gated: bool, fp8_scale, fp8_dtype, limit, alpha, amax_out) -> None:
    """activation_quantize: a known activation (and clamped_swiglu's parameters), its x
    (:func:`check_activation_input`), then the FP8 cast's arguments (``check_quantize_args``).

    ``gated`` says whether ``activation`` is a gated one (the backend's table knows).
    """
    check_activation(activation, limit, alpha)
    check_activation_input(x, activation, gated)
    check_quantize_args(x, fp8_scale, fp8_dtype, amax_out, scale_name="fp8_scale")


_ROPE_FORMATS = ("sbhd", "bshd", "thd")


def check_rope(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    """fused_rope_forward / _backward: a known tensor_format with its rank (sbhd / bshd 4-D, thd 3-D [t, h, d]),
    freqs [s, 1, 1, d_rot] with an even d_rot <= the head dim, cu_seqlens for thd, 0 <= cp_rank < cp_size, and no
    start_positions under context parallelism.

    Raises:
        ValueError: naming the argument and what the op takes.
    """
    if tensor_format not in _ROPE_FORMATS:
        raise ValueError(f"tensor_format={tensor_format!r} is not one of {', '.join(_ROPE_FORMATS)}")
    want_dim = 3 if tensor_format == "thd" else 4
    if t.dim() != want_dim:
        raise ValueError(f"tensor_format={tensor_format!r} needs a {want_dim}-D tensor, got shape {tuple(t.shape)}")
    d_rot = freqs.shape[-1]
    if freqs.dim() != 4 or tuple(freqs.shape[1:3]) != (1, 1) or d_rot % 2 or d_rot > t.shape[-1]:
        raise ValueError(f"freqs must be [s, 1, 1, d_rot] with an even d_rot <= head dim {t.shape[-1]}, got {tuple(freqs.shape)}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("tensor_format='thd' needs cu_seqlens (int32 [b + 1])")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_size={cp_size}, cp_rank={cp_rank}: need cp_size >= 1 and 0 <= cp_rank < cp_size")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("start_positions is not supported with cp_size > 1 (inference only); pass None")


def check_softmax_bwd(dy, y) -> None:
    """The fused softmax backwards: high-precision dy and y of one shape."""
    check_high_precision(dy, "dy")
    check_high_precision(y, "y")
    if dy.shape != y.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but y has {tuple(y.shape)}; they must match")


def check_softmax_input(x, dims, layout: str) -> None:
    """The fused softmax forwards: a float32 / bfloat16 / float16 x, with ``dims`` dims when not None."""
    check_high_precision(x)
    if dims is not None and x.dim() != dims:
        raise ValueError(f"x must be {layout}, got shape {tuple(x.shape)}")


def gemm_result_dtype(out_dtype, out, accumulate: bool, default: torch.dtype) -> torch.dtype:
    """The dtype of a GEMM's D: ``out_dtype``, else out's dtype, else ``default``.

    Raises:
        ValueError: accumulate without out, an out_dtype that disagrees with out's, a dtype D cannot have.
    """
    if accumulate and out is None:
        raise ValueError("gemm(accumulate=True) adds into out, but out is None; pass out=[M, N] tensor")
    if out is not None:
        check_tensor(out, "out")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype}; make them agree or drop out_dtype")
        out_dtype = out.dtype
    out_dtype = default if out_dtype is None else out_dtype
    check_out_dtype(out_dtype)
    return out_dtype


def check_gemm_output(m: int, n: int, bias, out) -> None:
    """ValueError unless bias is None or [N] and out is None or [M, N] (a GEMM's D is [M, N])."""
    if bias is not None:
        check_tensor(bias, "bias")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; gemm output is [{m}, {n}] so bias must be [{n}]")
    if out is not None and tuple(out.shape) != (m, n):
        raise ValueError(f"out has shape {tuple(out.shape)}; gemm output is [{m}, {n}]")


def check_attention_block_config(config) -> None:
    """The configs ``attention_block_fwd`` / ``_bwd`` take: bshd, the vanilla softmax, no bias or a post-scale one.

    Raises:
        ValueError: naming the setting and what the block ops allow.
    """
    if config.qkv_format != "bshd":
        raise ValueError(f"attention blocks take qkv_format='bshd', got {config.qkv_format!r} (a ring passes packed sequences as masks)")
    if config.softmax_type != "vanilla":
        raise ValueError(f"attention blocks take softmax_type='vanilla', got {config.softmax_type!r}")
    if config.bias_type not in ("no_bias", "post_scale_bias"):
        raise ValueError("attention blocks take bias_type 'no_bias' or 'post_scale_bias' (a pre-scale bias scaled first), "
                         f"got {config.bias_type!r}")
