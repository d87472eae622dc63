"""FP8 weights under ZeRO / FSDP: NVIDIA TE's ``tensor.utils`` helpers that Megatron-Core's distributed optimizer calls.

Megatron-Core moves each FP8 weight's bytes into its flat uint8 parameter buffer (:func:`replace_raw_data`), and
after each optimizer step, where every data-parallel rank holds an fp32 master shard (a contiguous range of the
flattened weight), writes the new FP8 weights with :func:`cast_master_weights_to_fp8`:

- delayed scaling: each rank casts its master shard with the weight's current scale into its range of the bytes,
  max-accumulating the shard's amax into the weight's amax slot; the slots are then reduced with MAX over the
  group (the next update sees the whole weight's amax), and every weight's scale_inv = 1 / scale;
- current scaling: amax = MAX over the group of the shards' amaxes (0 for a rank without a shard),
  scale = ``ops.scale_from_amax(amax)`` with the weight quantizer's epsilon and power-of-two rule, and each rank
  casts its shard with that scale; every rank sets scale_inv = 1 / scale;
- block scaling (128 x 128 tiles, NVIDIA TE's weight tiles): each rank takes the tile amaxes of its shard
  (``ops.block_amax_of_range``: 0 for tiles it holds none of), one MAX all-reduce of every weight's tiles gives the
  whole weight's, and each rank casts its shard with the tile scales they give (``ops.quantize_blockwise_range``,
  the epsilon and power-of-two rule of the weight's quantizer); every rank writes the scale_inv of every tile. The
  column-wise copy, if the weight holds one, is dropped (it would be stale until the bytes are all-gathered; the
  modules read W^T as the transpose of the tiles), as NVIDIA TE does.

The bytes outside a rank's range are written by the other ranks (Megatron all-gathers them afterwards).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from transformer_engine.plugin import ops

from .dtype import fp8_torch_dtype
from .float8_blockwise_tensor import Float8BlockwiseQTensor
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, _matrix_dims
from .mxfp8_tensor import MXFP8Tensor
from .quantized_tensor import QuantizedTensor

__all__ = ["cast_master_weights_to_fp8", "replace_raw_data"]


def replace_raw_data(tensor: QuantizedTensor, new_raw_data: torch.Tensor) -> None:
    """Move ``tensor``'s FP8 bytes (``Float8Tensor._data``, ``Float8BlockwiseQTensor._rowwise_data``) into
    ``new_raw_data``, a uint8 buffer of the same shape (e.g. a view into a flat buffer); values and every
    other attribute stay.

    Raises:
        NotImplementedError: an MXFP8Tensor (as in NVIDIA TE). TypeError: another tensor type.
        ValueError: new_raw_data's dtype or shape differs from the bytes it replaces.
    """
    if isinstance(tensor, MXFP8Tensor):
        raise NotImplementedError("replace_raw_data for MXFP8Tensor is not implemented (nor in NVIDIA TE)")
    if isinstance(tensor, Float8Tensor):
        key = "_data"
    elif isinstance(tensor, Float8BlockwiseQTensor):
        key = "_rowwise_data"
    else:
        raise TypeError(f"replace_raw_data takes a Float8Tensor or Float8BlockwiseQTensor, got {type(tensor).__name__}")
    old = getattr(tensor, key)
    if old is None:
        raise ValueError(f"this {type(tensor).__name__} holds no row-wise bytes to move")
    if new_raw_data.dtype != old.dtype or new_raw_data.shape != old.shape:
        raise ValueError(f"new_raw_data is {new_raw_data.dtype} {tuple(new_raw_data.shape)}; the bytes it replaces are "
                         f"{old.dtype} {tuple(old.shape)}")
    new_raw_data.detach().copy_(old)
    setattr(tensor, key, new_raw_data)


def cast_master_weights_to_fp8(model_weights: Sequence[Float8Tensor], master_weights: Sequence[Optional[torch.Tensor]],
                               start_offsets: Sequence[Optional[int]], group=None,
                               fsdp_shard_model_weights: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """Write each FP8 weight's range ``[start, start + master.numel())`` of its flattened bytes from this rank's
    master shard, with the scaling of the weight's quantizer (see the module docstring). Call it on every rank
    of ``group`` with the same weights (a rank without a shard of a weight passes None for it).

    Args:
        model_weights: the FP8 weights (Float8Tensor parameters, full size on every rank).
        master_weights: this rank's shard of each weight's master values (flattened order), or None.
        start_offsets: where each shard starts in the flattened weight.
        group: the data-parallel group the amaxes are reduced over (None: the default group; no reduction
            when torch.distributed is not initialized).
        fsdp_shard_model_weights: with FSDP, the buffer (uint8 bytes or a Float8Tensor) that holds each
            rank's range of the weight, written instead of the weight's own bytes.

    Raises:
        ValueError: lists of different lengths, a shard that does not fit its weight.
        NotImplementedError: MXFP8 weights, block-scaled weights of 1 x 128 tiles.
        TypeError: a weight that is neither a Float8Tensor of a per-tensor quantizer nor a Float8BlockwiseQTensor.
    """
    count = len(model_weights)
    targets = [None] * count if fsdp_shard_model_weights is None else list(fsdp_shard_model_weights)
    if not len(master_weights) == len(start_offsets) == len(targets) == count:
        raise ValueError("model_weights, master_weights, start_offsets (and fsdp_shard_model_weights) must have one entry per weight")
    for weight in model_weights:
        _check_weight(weight)
    delayed, current, blockwise = [], [], []
    for weight, master, start, target in zip(model_weights, master_weights, start_offsets, targets):
        if hasattr(weight, "clear_high_precision_init_val"):
            weight.clear_high_precision_init_val()  # the masters exist by now (NVIDIA TE clears it here too)
        shard = None
        if master is not None:
            shard = (master.detach().to(weight.dtype).reshape(-1), _shard_bytes(weight, master, start, target), start)
        if isinstance(weight, Float8BlockwiseQTensor):
            blockwise.append((weight, weight._get_quantizer(), shard))
            continue
        weight._reset_caches()
        quantizer = weight._get_quantizer()
        (current if isinstance(quantizer, Float8CurrentScalingQuantizer) else delayed).append((weight, quantizer, shard))
    if delayed:
        _delayed(delayed, group)
    if current:
        _current(current, group)
    if blockwise:
        _blockwise(blockwise, group)


def _check_weight(weight) -> None:
    """The weight kinds this helper writes (checked for every weight before any is written)."""
    if isinstance(weight, MXFP8Tensor):
        raise NotImplementedError("cast_master_weights_to_fp8 for MXFP8Tensor weights is not implemented yet (their row-wise and "
                                  "column-wise copies each need a partial cast of their own blocks)")
    if isinstance(weight, Float8BlockwiseQTensor):
        if not weight._is_2D_scaled or weight._rowwise_data is None:
            raise NotImplementedError("cast_master_weights_to_fp8 writes block-scaled weights of 128 x 128 tiles with row-wise data "
                                      "(NVIDIA TE's weight tiles); this weight has 1 x 128 tiles or no row-wise copy, whose "
                                      "column-wise copy a shard of the rows cannot write")
        return
    if not isinstance(weight, Float8Tensor):
        raise TypeError(f"cast_master_weights_to_fp8 takes Float8Tensor or Float8BlockwiseQTensor weights, got {type(weight).__name__}")
    quantizer = weight._get_quantizer()
    if not isinstance(quantizer, (Float8Quantizer, Float8CurrentScalingQuantizer)):
        raise TypeError(f"cast_master_weights_to_fp8: a weight quantized by {type(quantizer).__name__} is not supported")


def _raw_data(tensor) -> torch.Tensor:
    """The row-wise FP8 bytes of a Float8Tensor or Float8BlockwiseQTensor."""
    return tensor._rowwise_data if isinstance(tensor, Float8BlockwiseQTensor) else tensor._data


def _shard_bytes(weight: QuantizedTensor, master: torch.Tensor, start: Optional[int], target) -> torch.Tensor:
    """The uint8 bytes this rank writes: ``target`` (FSDP) or the weight's own flattened range."""
    if target is not None:
        data = _raw_data(target) if isinstance(target, QuantizedTensor) else target
        return data.view(-1)
    if start is None or start < 0 or start + master.numel() > weight.numel():
        raise ValueError(f"a master shard of {master.numel()} elements at start offset {start} does not fit a weight of "
                         f"{weight.numel()} elements")
    return _raw_data(weight).view(-1)[start:start + master.numel()]


def _reduce_max(values: List[torch.Tensor], group) -> List[torch.Tensor]:
    """Elementwise MAX of float32 tensors over the ranks of ``group``, in one all-reduce of them side by side; each
    result has its value's shape (the values as they are without a process group)."""
    packed = torch.cat([v.reshape(-1) for v in values])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return [part.view(v.shape) for part, v in zip(packed.split([v.numel() for v in values]), values)]


def _write_cast(shard, scale: torch.Tensor, fp8_dtype, amax_out: Optional[torch.Tensor] = None) -> None:
    """The master shard cast with ``scale`` into its bytes (its amax max-accumulated into ``amax_out`` when given)."""
    if shard is None:
        return
    values, raw, _ = shard
    q, _, _ = ops.quantize(values, scale.reshape(()), fp8_torch_dtype(fp8_dtype), amax_out=amax_out)
    raw.copy_(q.view(torch.uint8))


def _delayed(params, group) -> None:
    for weight, quantizer, shard in params:
        _write_cast(shard, quantizer.scale, weight._fp8_dtype, quantizer.amax.reshape(()))
    amaxes = [quantizer.amax for _, quantizer, _ in params]
    for amax, reduced in zip(amaxes, _reduce_max(amaxes, group)):
        amax.copy_(reduced)
    for weight, quantizer, _ in params:
        weight._scale_inv.copy_(quantizer.scale.reshape(weight._scale_inv.shape).reciprocal())


def _current(params, group) -> None:
    zero = torch.zeros((), dtype=torch.float32, device=params[0][0].device)
    amaxes = _reduce_max([zero if shard is None else ops.compute_amax(shard[0]) for _, _, shard in params], group)
    for (weight, quantizer, shard), amax in zip(params, amaxes):
        scale = ops.scale_from_amax(amax, fp8_torch_dtype(quantizer.dtype), amax_epsilon=quantizer.amax_epsilon,
                                    power_2_scale=quantizer.force_pow_2_scales)
        _write_cast(shard, scale, weight._fp8_dtype)
        weight._scale_inv.copy_(scale.reshape(weight._scale_inv.shape).reciprocal())


def _blockwise(params, group) -> None:
    """Each shard's tile amaxes, MAX-reduced over the ranks in one all-reduce, then each shard cast with the tile
    scales of the whole weight (see the module docstring)."""
    amaxes = _reduce_max([_shard_tile_amax(weight, quantizer, shard) for weight, quantizer, shard in params], group)
    for (weight, quantizer, shard), amax in zip(params, amaxes):
        rows, cols = _matrix_dims(weight.shape)
        values, raw, start = shard if shard is not None else (torch.empty(0, dtype=weight.dtype, device=weight.device), None, 0)
        q, scale_inv = ops.quantize_blockwise_range(
            values, amax, rows=rows, cols=cols, start=start, block_rows=quantizer.block_len,
            block_cols=quantizer.block_len, fp8_dtype=fp8_torch_dtype(quantizer.dtype), power_2_scale=quantizer.force_pow_2_scales,
            amax_epsilon=quantizer.amax_epsilon,
        )
        if raw is not None:
            raw.copy_(q.view(torch.uint8))
        weight._rowwise_scale_inv.copy_(scale_inv)
        if weight._columnwise_data is not None:
            weight.update_usage(columnwise_usage=False)


def _shard_tile_amax(weight, quantizer, shard) -> torch.Tensor:
    """The tile amaxes of this rank's shard of ``weight`` (zeros without a shard), float32 [ceil(M / 128), ceil(K / 128)]."""
    if shard is None:
        grid = quantizer.get_scale_shape(weight.shape, columnwise=False)
        return torch.zeros(grid, dtype=torch.float32, device=weight.device)
    rows, cols = _matrix_dims(weight.shape)
    values, _, start = shard
    return ops.block_amax_of_range(values, rows=rows, cols=cols, start=start, block_rows=quantizer.block_len,
                                   block_cols=quantizer.block_len)
