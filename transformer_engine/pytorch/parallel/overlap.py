"""GEMMs pipelined with their sequence-parallel collectives (TE's ``ub_overlap_ag`` / ``ub_overlap_rs``).

A GEMM whose input is all-gathered, or whose output is reduce-scattered, over a group of P ranks
splits into P row blocks, one per rank, so that moving one block overlaps computing another:

    all_gather_gemm      Y = gemm(all_gather(A_r))       block q of Y = gemm(A_q), as soon as A_q arrives
    gemm_reduce_scatter  Y_r = (sum_q gemm_q(A))[rows r]  gemm(block q of A) is computed while the block
                                                         for the previous rank is being pulled by it

On CUDA with PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) the blocks travel
by copy engines between the GPUs' buffers, leaving every SM to the GEMMs (an NCCL collective running
beside a GEMM takes SMs from it, which is why overlapping NCCL collectives gains little); the
pipelining itself is PyTorch's (``_pipelined_all_gather_and_consume``,
``_pipelined_produce_and_all2all``). Elsewhere (gloo, CPU, a group without peer access) the same block
GEMMs run around one ordinary collective: the same results, no overlap.

The GEMM is given as ``gemm(a, out)``: the product for the rows of operand ``a``, written into ``out``.
FP8 operands (:class:`Float8Tensor`) travel as their uint8 payload and keep their (shared) scale_inv.
"""

from __future__ import annotations

import functools
import socket
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..quantization.float8_tensor import Float8Tensor
from .comm import all_gather, group_rank, group_size, reduce_scatter

__all__ = ["BlockGemm", "all_gather_gemm", "gemm_reduce_scatter", "row_block", "splits_by_rows"]

Operand = Union[torch.Tensor, Float8Tensor]
BlockGemm = Callable[[Operand, Optional[torch.Tensor]], torch.Tensor]


def splits_by_rows(a: Operand) -> bool:
    """True when :func:`row_block` can split ``a``: high precision, or FP8 with one scale (a block-scaled
    operand's scales are laid out per tile of the whole tensor)."""
    return not isinstance(a, Float8Tensor) or type(a) is Float8Tensor


def row_block(a: Operand, index: int, blocks: int) -> Operand:
    """Rows [index M / blocks, (index + 1) M / blocks) of a [M, K] operand (an FP8 one without its transpose)."""
    if isinstance(a, Float8Tensor):
        return Float8Tensor(a.data.chunk(blocks)[index], a.scale_inv)
    return a.chunk(blocks)[index]


def _payload(a: Operand) -> torch.Tensor:
    return a.data.view(torch.uint8) if isinstance(a, Float8Tensor) else a


def _like(a: Operand, payload: torch.Tensor) -> Operand:
    return Float8Tensor(payload.view(a.data.dtype), a.scale_inv) if isinstance(a, Float8Tensor) else payload


@functools.lru_cache(maxsize=None)
def _symmetric_memory(group: Any):
    """PyTorch's symmetric-memory module when it can pipeline over ``group``, else None.

    It can when the group runs on NCCL and its ranks are distinct GPUs of one host with peer access to each
    other. Every rank reaches the same verdict (one ``all_gather_object`` at the first call, which must
    therefore come before any CUDA-graph capture: ``make_graphed_callables`` warms up first).
    """
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError:
        return None
    needed = ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all", "get_symm_mem_workspace")
    if not all(hasattr(symm, name) for name in needed) or dist.get_backend(group) != "nccl":
        return None
    me = torch.cuda.current_device()
    peers = [d for d in range(torch.cuda.device_count()) if d != me]
    mine = (socket.gethostname(), me, all(torch.cuda.can_device_access_peer(me, d) for d in peers))
    everyone = [None] * group_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    one_host = len({host for host, _, _ in everyone}) == 1
    distinct = len({device for _, device, _ in everyone}) == len(everyone)
    return symm if one_host and distinct and all(peer_access for _, _, peer_access in everyone) else None


def all_gather_gemm(shard: Operand, gemm: BlockGemm, out: torch.Tensor, group: Any) -> Operand:
    """all_gather(shard) (returned), with ``gemm(rows of rank q, out rows of rank q)`` for every rank q.

    Args:
        shard: this rank's rows [m, K] (contiguous; FP8: without transpose).
        gemm: the block GEMM (see the module docstring).
        out: the GEMM output for all P m rows.
        group: the tensor-parallel group.
    """
    size = group_size(group)
    out_blocks = out.chunk(size)
    symm = _symmetric_memory(group) if out.device.type == "cuda" else None
    if symm is None:
        gathered = all_gather(shard, group)
        for q in range(size):
            gemm(row_block(gathered, q, size), out_blocks[q])
        return gathered
    payload = _payload(shard).contiguous()
    gathered = payload.new_empty((size * payload.shape[0],) + tuple(payload.shape[1:]))
    symm._pipelined_all_gather_and_consume(
        payload, lambda block, q: gemm(_like(shard, block), out_blocks[q]), gathered, group.group_name,
    )
    return _like(shard, gathered)


def gemm_reduce_scatter(a: Operand, gemm: BlockGemm, n: int, dtype: torch.dtype, group: Any) -> torch.Tensor:
    """This rank's rows of sum over ranks of Y, Y [M, n] = the GEMM of ``a`` [M, K] (P blocks of M / P rows).

    On the pipelined path the P partials of this rank's rows are summed locally (``torch.sum``: float32
    accumulation, one rounding).
    """
    size, rank = group_size(group), group_rank(group)
    rows = a.shape[0] if not isinstance(a, Float8Tensor) else a.data.shape[0]
    if rows % size:
        raise ValueError(f"reduce_scatter needs dim 0 ({rows}) divisible by the group size {size}")
    device = a.data.device if isinstance(a, Float8Tensor) else a.device
    symm = _symmetric_memory(group) if device.type == "cuda" else None
    if symm is None:
        y = torch.empty(rows, n, dtype=dtype, device=device)
        for q, out in enumerate(y.chunk(size)):
            gemm(row_block(a, q, size), out)
        return reduce_scatter(y, group)
    partials = torch.empty(rows, n, dtype=dtype, device=device)  # block q: rank q's partial of this rank's rows
    symm._pipelined_produce_and_all2all(lambda q, out: gemm(row_block(a, q, size), out), partials, group.group_name)
    return partials.view(size, rows // size, n).sum(dim=0)
