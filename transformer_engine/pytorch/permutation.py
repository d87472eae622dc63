"""TE's MoE token permutation API (``transformer_engine.pytorch.permutation``), in plain PyTorch.

Permute groups the routed copies of T tokens x [T, H] by expert. A routing decision is a *slot*
(t, w) of a [T, W] table: W = E experts for ``map_type="mask"`` (slot (t, e) is routed where
routing_map[t, e]) and W = topK for ``map_type="index"`` (slot (t, k) goes to expert indices[t, k]).
Routed slots are ordered by (expert, t, k) and numbered 0, 1, ...; the first ``num_out_tokens``
of them are kept, the rest are dropped:

    permute        y[j]  = x[t(j)]                              j < num_out_tokens
    unpermute      z[t]  = sum over kept slots (t, w) of  p[t, w] * y[row(t, w)]   (p = 1 without probs)

Rows of y that no slot reaches (num_out_tokens above the routed count) are zero. ``permute_with_probs``
also gives py[j] = probs[t(j), e(j)], and zeroes y[j] where that prob is 0 (TE marks padded routing
slots with a zero prob). The VJPs are the transposed gathers:

    permute        dx[t] = sum over kept slots of dy[row(t, w)]            (= unpermute without probs)
                   dprobs[t, w] = dpy[row(t, w)]  (0 off the kept slots)
    unpermute      dy[j] = p[slot(j)] * dz[t(j)]                          (= permute, times probs)
                   dp[t, w] = <y[row(t, w)], dz[t]>  (0 off the kept slots)

``sort_chunks_by_index`` splits x along dim 0 into chunks of ``split_sizes`` and concatenates them
in the order ``sorted_index``: y = cat(chunk[sorted_index[0]], chunk[sorted_index[1]], ...), with
dx its inverse permutation of dy.

row_id_map (our format; clients such as Megatron-Core only hand it back to ``moe_unpermute``): an
int32 tensor [T, W], the permuted row of each slot, -1 where the slot is not routed or was dropped.
The same format serves both map types, so ``moe_unpermute`` reads T and W from its shape and never
needs ``restore_shape``. NVIDIA TE's own layouts ([T, 2E + 1] for mask maps, a flat [T * topK] for
index maps) are internal to its kernels.

Sums over the copies of a token accumulate in float32 and round once to the data dtype. Everything
is a fixed number of vectorized ops per call (cumsum, argsort, scatter, index_select, index_add);
shapes depend only on the input shapes and ``num_out_tokens``, so each function traces under
``torch.compile(fullgraph=True)`` when ``num_out_tokens`` is a Python int (a mask map with
``num_out_tokens <= 0`` must count the routed slots, a host sync that cannot be compiled).
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from transformer_engine.pytorch.tensor import Float8Tensor, QuantizedTensor

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]

_MAP_TYPES = ("mask", "index")


# ----------------------------------------------------------------------------------------------
# Argument checks (shapes, dtypes and devices only: values are never read, so no host sync)
# ----------------------------------------------------------------------------------------------


def _check_tokens(inp, name: str = "inp") -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}.")
    if inp.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_tokens, hidden_size], got shape {tuple(inp.shape)}.")
    if isinstance(inp, QuantizedTensor):
        if not isinstance(inp, Float8Tensor) or inp._data is None:
            raise TypeError(f"{name}: only a Float8Tensor with row-wise data can be permuted, "
                            f"got {type(inp).__name__}; dequantize it first.")
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{name}: permuting a quantized (FP8) tensor is not supported under "
                               "torch.compile; move the quantization outside the compiled region.")


def _check_companion(t, name: str, inp: torch.Tensor, shape: Optional[tuple] = None, *,
                     integer: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.device != inp.device:
        raise ValueError(f"{name} is on {t.device} but inp is on {inp.device}; move it to {inp.device}.")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}.")
    if integer and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{name} must hold integers, got {t.dtype}.")
    if not integer and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}.")


def _check_map_type(map_type) -> None:
    if map_type not in _MAP_TYPES:
        raise ValueError(f"map_type must be one of {_MAP_TYPES}, got {map_type!r}.")


def _as_int(value, name: str) -> int:
    """A Python int from an int or a one-element integer tensor (Megatron passes ``counts.sum()``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (or a one-element integer tensor), got {value!r}.")
    return value


def _check_routing_map(inp: torch.Tensor, routing_map, map_type: str) -> torch.Tensor:
    """The routing map as [T, W] (a 1-D index map is topK = 1)."""
    _check_companion(routing_map, "routing_map", inp, integer=True)
    if map_type == "index" and routing_map.dim() == 1:
        routing_map = routing_map.unsqueeze(1)
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
        width = "num_experts" if map_type == "mask" else "topK"
        raise ValueError(f"routing_map must be [num_tokens={inp.shape[0]}, {width}] for map_type="
                         f"{map_type!r}, got shape {tuple(routing_map.shape)}.")
    if map_type == "index" and routing_map.dtype == torch.bool:
        raise TypeError("routing_map of map_type='index' holds expert indices, got a bool mask; "
                        "pass map_type='mask'.")
    return routing_map


# ----------------------------------------------------------------------------------------------
# row_id_map: built once per permute, inverted once per (un)permute
# ----------------------------------------------------------------------------------------------


def _drop(row: torch.Tensor, routed: torch.Tensor, num_out: int) -> torch.Tensor:
    """int32 row per slot, -1 where the slot is not routed or its row is past ``num_out``."""
    return torch.where(routed & (row < num_out), row, -1).to(torch.int32)


def _mask_row_id_map(routing_map: torch.Tensor, num_out: int) -> torch.Tensor:
    """Rows numbered expert-major: row(t, e) = #{routed (e', t') : e' < e or (e' = e, t' < t)}."""
    routed_et = routing_map.t().reshape(-1) != 0  # [E * T], expert-major
    row_et = torch.cumsum(routed_et, dim=0) - 1
    return _drop(row_et, routed_et, num_out).view(routing_map.shape[1], -1).t().contiguous()


def _index_row_id_map(indices: torch.Tensor, num_out: int) -> torch.Tensor:
    """Rows by a stable sort of the flat [T * topK] expert indices: ties keep (t, k) order."""
    order = torch.argsort(indices.reshape(-1).to(torch.int64), stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return _drop(rank, torch.ones_like(rank, dtype=torch.bool), num_out).view(indices.shape)


def _invert_row_id_map(row_id_map: torch.Tensor, num_out: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(slot, token) of each permuted row, int64 [num_out]; rows no slot reaches get slot T*W, token T."""
    num_tokens, width = row_id_map.shape
    num_slots = num_tokens * width
    row = row_id_map.reshape(-1).to(torch.int64)
    target = torch.where(row >= 0, row, num_out)  # unused slots all land in a dummy row
    slot = torch.full((num_out + 1,), num_slots, dtype=torch.int64, device=row_id_map.device)
    slot = slot.scatter_(0, target, torch.arange(num_slots, device=row_id_map.device))[:num_out]
    return slot, torch.div(slot, width, rounding_mode="floor")


# ----------------------------------------------------------------------------------------------
# Row movement: gather with a dummy row, scatter-add in float32
# ----------------------------------------------------------------------------------------------


def _gather_rows(x: torch.Tensor, token: torch.Tensor, keep: Optional[torch.Tensor]):
    """y[j] = x[token[j]], zero where ``keep`` is False (token may be T, the dummy row, there)."""
    num_tokens, hidden = x.shape
    fp8 = isinstance(x, Float8Tensor)  # move the FP8 bytes; the per-tensor scale is unchanged
    data = x._data.view(torch.uint8) if fp8 else x
    if num_tokens == 0:
        y = data.new_zeros((token.shape[0], hidden))
    else:
        y = data.index_select(0, token.clamp(max=num_tokens - 1))
        y = y if keep is None else y.masked_fill(~keep[:, None], 0)
    return _fp8_like(x, y) if fp8 else y


def _fp8_like(x: Float8Tensor, data: torch.Tensor) -> Float8Tensor:
    return Float8Tensor(shape=data.shape, dtype=x.dtype, data=data, fp8_scale_inv=x._scale_inv,
                        fp8_dtype=x._fp8_dtype)


def _scatter_add_rows(y: torch.Tensor, token: torch.Tensor, num_tokens: int,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """z[t] = sum_{j: token[j] = t} weight[j] * y[j], accumulated in float32, in y's dtype."""
    if isinstance(y, QuantizedTensor):
        y = y.dequantize()
    src = y.float() if weight is None else y.float() * weight.float()[:, None]
    out = torch.zeros((num_tokens + 1, y.shape[1]), dtype=torch.float32, device=y.device)
    return out.index_add_(0, token, src)[:num_tokens].to(y.dtype)


def _slot_values(values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """values.flatten()[slot], 0 at the dummy slot T*W."""
    flat = values.reshape(-1)
    return torch.cat([flat, flat.new_zeros(1)]).index_select(0, slot)


def _to_slots(per_row: torch.Tensor, slot: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """out.flatten()[slot[j]] = per_row[j], zero elsewhere (the dummy slot is cut off)."""
    num_slots = shape[0] * shape[1]
    out = per_row.new_zeros(num_slots + 1).scatter_(0, slot, per_row)
    return out[:num_slots].view(shape)


# ----------------------------------------------------------------------------------------------
# Autograd functions
# ----------------------------------------------------------------------------------------------


class _Permute(torch.autograd.Function):
    """y = x[token], py = probs[slot] (zeroing rows whose prob is 0); backward scatters back."""

    @staticmethod
    def forward(ctx, inp, probs, row_id_map, num_out: int, sparse_rows: bool):
        slot, token = _invert_row_id_map(row_id_map, num_out)
        num_tokens = inp.shape[0]
        permuted_probs = None
        keep = token < num_tokens if sparse_rows else None
        if probs is not None:
            permuted_probs = _slot_values(probs, slot)
            keep = (token < num_tokens) & (permuted_probs != 0)
        if keep is not None:
            token = torch.where(keep, token, num_tokens)  # backward sends dropped rows to the dummy
        out = _gather_rows(inp, token, keep)
        ctx.save_for_backward(slot, token)
        ctx.num_tokens, ctx.probs_shape = num_tokens, None if probs is None else probs.shape
        if permuted_probs is None:
            permuted_probs = inp.new_empty(0, dtype=torch.float32)
            ctx.mark_non_differentiable(permuted_probs)
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad_out, grad_permuted_probs):
        slot, token = ctx.saved_tensors
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_inp = _scatter_add_rows(grad_out, token, ctx.num_tokens)
        if ctx.needs_input_grad[1] and grad_permuted_probs is not None:
            grad_probs = _to_slots(grad_permuted_probs, slot, ctx.probs_shape)
        return grad_inp, grad_probs, None, None, None


class _Unpermute(torch.autograd.Function):
    """z[t] = sum over slots of p * y[row]; backward: dy = p * dz[token], dp = <y[row], dz[t]>."""

    @staticmethod
    def forward(ctx, inp, row_id_map, merging_probs):
        slot, token = _invert_row_id_map(row_id_map, inp.shape[0])
        weight = None if merging_probs is None else _slot_values(merging_probs.float(), slot)
        out = _scatter_add_rows(inp, token, row_id_map.shape[0], weight)
        ctx.save_for_backward(inp if merging_probs is not None else None, slot, token, weight)
        ctx.probs_dtype = None if merging_probs is None else merging_probs.dtype
        ctx.map_shape = row_id_map.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inp, slot, token, weight = ctx.saved_tensors
        reached = token < ctx.map_shape[0]
        if isinstance(grad_out, QuantizedTensor):
            grad_out = grad_out.dequantize()
        grad_rows = _gather_rows(grad_out.float(), token, None)
        scale = reached.float() if weight is None else weight  # weight is 0 at the dummy slot
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_inp = (grad_rows * scale[:, None]).to(grad_out.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            per_row = (inp.float() * grad_rows).sum(dim=1) * reached
            grad_probs = _to_slots(per_row, slot, ctx.map_shape).to(ctx.probs_dtype)
        return grad_inp, None, grad_probs


class _SortChunks(torch.autograd.Function):
    """y = x[src], py = probs[src]; backward scatters dy back to the source rows."""

    @staticmethod
    def forward(ctx, inp, probs, src):
        out = _gather_rows(inp, src, None)
        ctx.save_for_backward(src)
        if probs is None:
            permuted_probs = inp.new_empty(0, dtype=torch.float32)
            ctx.mark_non_differentiable(permuted_probs)
        else:
            permuted_probs = probs.index_select(0, src)
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad_out, grad_permuted_probs):
        (src,) = ctx.saved_tensors
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            if isinstance(grad_out, QuantizedTensor):
                grad_out = grad_out.dequantize()
            grad_inp = torch.zeros_like(grad_out).index_copy_(0, src, grad_out)
        if ctx.needs_input_grad[1] and grad_permuted_probs is not None:
            grad_probs = torch.zeros_like(grad_permuted_probs).index_copy_(0, src, grad_permuted_probs)
        return grad_inp, grad_probs, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _permute(inp, probs, routing_map, num_out_tokens, map_type: str):
    """Shared body of moe_permute / moe_permute_with_probs: checks, row_id_map, one autograd node."""
    _check_tokens(inp)
    routing_map = _check_routing_map(inp, routing_map, map_type)
    if probs is not None:
        _check_companion(probs, "probs", inp, routing_map.shape)
    num_out = _as_int(num_out_tokens, "num_out_tokens")
    num_slots = routing_map.numel()
    if map_type == "index":
        num_out = num_out if num_out > 0 else num_slots
        row_id_map = _index_row_id_map(routing_map, num_out)
        sparse_rows = num_out > num_slots  # every slot is routed: only rows past T*topK are empty
    else:
        if num_out <= 0:
            if torch.compiler.is_compiling():
                raise ValueError("moe_permute with map_type='mask' needs num_out_tokens > 0 under "
                                 "torch.compile (e.g. num_tokens * topK); counting the routing map "
                                 "would sync with the host.")
            num_out = int(torch.count_nonzero(routing_map))
        row_id_map = _mask_row_id_map(routing_map, num_out)
        sparse_rows = True  # num_out may exceed the routed count, which is not known statically
    out, permuted_probs = _Permute.apply(inp, probs, row_id_map, num_out, sparse_rows)
    return out, permuted_probs, row_id_map


def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the routed copies of the tokens by expert: y[j] = inp[t(j)].

    Rows are ordered by expert, then token, then (index map) top-k position; rows past
    ``num_out_tokens`` are dropped, rows no routed slot reaches are zero.

    Args:
        inp: tokens [num_tokens, hidden_size] (a row-wise Float8Tensor moves its FP8 bytes).
        routing_map: ``"mask"``: bool/int [num_tokens, num_experts], nonzero where routed;
            ``"index"``: integer expert ids [num_tokens, topK].
        num_out_tokens: rows of the output; <= 0 keeps every routed slot (a host sync for mask maps,
            so give it under torch.compile). An int or a one-element integer tensor.
        max_token_num: TE's workspace hint; ignored.
        map_type: ``"mask"`` or ``"index"``.

    Returns:
        (permuted [num_out_tokens, hidden_size], row_id_map int32 [num_tokens, W]) where
        row_id_map[t, w] is the output row of slot (t, w), -1 if unrouted or dropped.

    Raises:
        TypeError / ValueError: a bad tensor type, shape, dtype, device, map_type or num_out_tokens.

    Example:
        >>> x = torch.tensor([[1.0], [2.0], [3.0]])
        >>> y, row_id_map = moe_permute(x, torch.tensor([[1], [0], [1]]), map_type="index")
        >>> y.flatten().tolist(), row_id_map.flatten().tolist()
        ([2.0, 1.0, 3.0], [1, 0, 2])
    """
    _check_map_type(map_type)
    _as_int(max_token_num, "max_token_num")
    out, _, row_id_map = _permute(inp, None, routing_map, num_out_tokens, map_type)
    return out, row_id_map


def moe_permute_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_permute`` of a mask map that also permutes the probs: py[j] = probs[t(j), e(j)].

    A routed slot whose prob is exactly 0 (TE's padding slots) gives a zero row.

    Args:
        inp: tokens [num_tokens, hidden_size].
        probs: floating [num_tokens, num_experts]; gets gradients through ``permuted_probs``.
        routing_map: bool/int mask [num_tokens, num_experts].
        num_out_tokens: as in ``moe_permute``.

    Returns:
        (permuted [num_out_tokens, hidden_size], permuted_probs [num_out_tokens] in probs' dtype,
        row_id_map int32 [num_tokens, num_experts]).

    Raises:
        TypeError / ValueError: as ``moe_permute``, or probs not floating / not routing_map's shape.
    """
    if probs is None:
        raise TypeError("probs must be a torch.Tensor; use moe_permute to permute without probs.")
    out, permuted_probs, row_id_map = _permute(inp, probs, routing_map, num_out_tokens, "mask")
    return out, permuted_probs, row_id_map


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    restore_shape: Optional[torch.Size] = None,
    map_type: str = "mask",
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Undo ``moe_permute`` and merge each token's copies: z[t] = sum_w p[t, w] * inp[row(t, w)].

    Without ``merging_probs`` the copies are summed (p = 1); dropped slots contribute nothing.

    Args:
        inp: permuted rows [num_out_tokens, hidden_size].
        row_id_map: the ``row_id_map`` returned by the permute call, int [num_tokens, W].
        merging_probs: floating [num_tokens, W] (W = num_experts for mask maps, topK for index
            maps), or None; gets a gradient.
        restore_shape: None or (num_tokens, hidden_size); the output shape is read from
            row_id_map and inp either way.
        map_type: ``"mask"`` or ``"index"``, as given to the permute (the map format is shared).
        probs: deprecated name of ``merging_probs``.

    Returns:
        The tokens [num_tokens, hidden_size] in inp's dtype (accumulated in float32).

    Raises:
        TypeError / ValueError: a bad tensor type, shape, dtype or device, a quantized inp, both
            probs and merging_probs, or a restore_shape that disagrees with row_id_map.
    """
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs are given; probs is deprecated, pass merging_probs.")
        warnings.warn("moe_unpermute: probs is deprecated, use merging_probs.", DeprecationWarning, stacklevel=2)
        merging_probs = probs
    _check_map_type(map_type)
    _check_tokens(inp)
    if isinstance(inp, QuantizedTensor):
        raise TypeError("moe_unpermute does not take a quantized (FP8) inp; dequantize it first.")
    _check_companion(row_id_map, "row_id_map", inp, integer=True)
    if row_id_map.dim() != 2:
        raise ValueError("row_id_map must be the 2-D map returned by moe_permute, "
                         f"got shape {tuple(row_id_map.shape)}.")
    if merging_probs is not None:
        _check_companion(merging_probs, "merging_probs", inp, row_id_map.shape)
    expected = (row_id_map.shape[0], inp.shape[1])
    if restore_shape is not None and tuple(restore_shape) != expected:
        raise ValueError(f"restore_shape {tuple(restore_shape)} does not match (num_tokens, hidden_size) "
                         f"= {expected} of row_id_map and inp.")
    return _Unpermute.apply(inp, row_id_map, merging_probs)


def _chunk_sort_rows(inp, split_sizes, sorted_index) -> torch.Tensor:
    """src[j]: the input row that lands at output row j (``searchsorted`` on the output chunk ends)."""
    _check_tokens(inp)
    for name, t in (("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
            raise TypeError(f"{name} must be a 1-D integer tensor, got {t!r:.80}.")
    if split_sizes.shape != sorted_index.shape:
        raise ValueError(f"split_sizes {tuple(split_sizes.shape)} and sorted_index "
                         f"{tuple(sorted_index.shape)} must have the same length.")
    device = inp.device
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_index.to(device=device, dtype=torch.int64)
    in_start = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes.index_select(0, order)
    out_end = torch.cumsum(out_sizes, 0)
    rows = torch.arange(inp.shape[0], device=device)
    chunk = torch.searchsorted(out_end, rows, right=True).clamp(max=max(order.numel() - 1, 0))
    return in_start.index_select(0, order.index_select(0, chunk)) + rows - (out_end - out_sizes).index_select(0, chunk)


def moe_sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> torch.Tensor:
    """Split inp along dim 0 by ``split_sizes`` and concatenate the chunks in ``sorted_index`` order.

    y = cat(chunk[sorted_index[0]], chunk[sorted_index[1]], ...); sum(split_sizes) must equal
    num_tokens (values are not read on the host, so this is not checked).

    Args:
        inp: tokens [num_tokens, hidden_size] (a row-wise Float8Tensor moves its FP8 bytes).
        split_sizes: 1-D integer chunk sizes.
        sorted_index: 1-D integer chunk order, a permutation of range(len(split_sizes)).

    Returns:
        The reordered tokens [num_tokens, hidden_size].

    Raises:
        TypeError / ValueError: inp not 2-D, or split_sizes / sorted_index not 1-D integer of one length.

    Example:
        >>> x = torch.arange(5.0)[:, None]
        >>> moe_sort_chunks_by_index(x, torch.tensor([2, 3]), torch.tensor([1, 0])).flatten().tolist()
        [2.0, 3.0, 4.0, 0.0, 1.0]
    """
    src = _chunk_sort_rows(inp, split_sizes, sorted_index)
    out, _ = _SortChunks.apply(inp, None, src)
    return out


def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``moe_sort_chunks_by_index`` that moves ``probs`` [num_tokens, ...] along with the tokens.

    Returns:
        (reordered tokens [num_tokens, hidden_size], reordered probs), both differentiable.

    Raises:
        TypeError / ValueError: as ``moe_sort_chunks_by_index``, or probs not floating with
            num_tokens rows on inp's device.
    """
    src = _chunk_sort_rows(inp, split_sizes, sorted_index)
    _check_companion(probs, "probs", inp)
    if probs.dim() == 0 or probs.shape[0] != inp.shape[0]:
        raise ValueError(f"probs must have num_tokens={inp.shape[0]} rows, got shape {tuple(probs.shape)}.")
    return _SortChunks.apply(inp, probs, src)

