"""GEMMs pipelined with their sequence-parallel collectives (TE's ``ub_overlap_ag`` / ``ub_overlap_rs``).

A GEMM whose input is all-gathered, or whose output is reduce-scattered, over a group of P ranks
splits into P row blocks, one per rank, so that moving one block overlaps computing another:

    all_gather_gemm      Y = gemm(all_gather(A_r))       block q of Y = gemm(A_q), as soon as A_q arrives
    gemm_reduce_scatter  Y_r = (sum_q gemm_q(A))[rows r]  gemm(block q of A) is computed while the block
                                                         for the previous rank is being pulled by it

On CUDA with PyTorch's symmetric memory (``torch.distributed._symmetric_memory``: a workspace every
rank of the group can address, and barriers across them) the blocks travel by copy engines between
the GPUs' buffers, leaving every SM to the GEMMs (an NCCL collective running beside a GEMM takes SMs
from it, which is why overlapping NCCL collectives gains little). The block GEMMs run one after the
other on the current stream; the copies and barriers run on a side stream, so that a barrier (where
a rank waits for the slower one) sits under a GEMM too. (PyTorch's own pipelines run two block GEMMs
side by side on two streams; at these sizes each GEMM fills the GPU, so they only slow each other
and the copy that waits for the first one ends up exposed.) Elsewhere (gloo, CPU, a group without
peer access) the same block GEMMs run around one ordinary collective: the same results, no overlap.

The GEMM is given as ``gemm(a, out[, bias])``: the product for the rows of operand ``a``, written into
``out`` (a new tensor when None); a third argument, when passed, is the bias to add instead of the
GEMM's own (None: no bias).
FP8 operands (:class:`Float8Tensor`) travel as their uint8 payload and keep their (shared) scale_inv.
"""

from __future__ import annotations

import functools
import socket
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..quantization.float8_tensor import Float8Tensor
from .comm import all_gather, group_rank, group_size, payload, reduce_scatter, with_payload

__all__ = ["BlockGemm", "all_gather_gemm", "gemm_reduce_scatter", "row_block", "splits_by_rows"]

Operand = Union[torch.Tensor, Float8Tensor]
BlockGemm = Callable[..., torch.Tensor]  # gemm(a, out[, bias]): see the module docstring


def splits_by_rows(a: Operand) -> bool:
    """True when :func:`row_block` can split ``a``: high precision, or FP8 with one scale (a block-scaled
    operand's scales are laid out per tile of the whole tensor)."""
    return not isinstance(a, Float8Tensor) or type(a) is Float8Tensor


def row_block(a: Operand, index: int, blocks: int) -> Operand:
    """Rows [index M / blocks, (index + 1) M / blocks) of a [M, K] operand (an FP8 one without its transpose)."""
    if isinstance(a, Float8Tensor):
        return Float8Tensor(a.data.chunk(blocks)[index], a.scale_inv)
    return a.chunk(blocks)[index]


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
    if not hasattr(symm, "get_symm_mem_workspace") or dist.get_backend(group) != "nccl":
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
    moved = payload(shard).contiguous()
    gathered = moved.new_empty((size * moved.shape[0],) + tuple(moved.shape[1:]))
    blocks = gathered.chunk(size)
    mem = symm.get_symm_mem_workspace(group.group_name, min_size=moved.numel() * moved.element_size())
    rank, main, side = mem.rank, torch.cuda.current_stream(), _side_stream(moved.device)
    mem.get_buffer(rank, moved.shape, moved.dtype).copy_(moved)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        mem.barrier(channel=0)  # every shard is in its rank's buffer
    gemm(shard, out_blocks[rank])
    blocks[rank].copy_(moved)
    for step in range(1, size):
        src = (rank + step) % size
        with torch.cuda.stream(side):
            blocks[src].copy_(mem.get_buffer(src, moved.shape, moved.dtype))  # by copy engine, under the GEMMs
        main.wait_stream(side)
        gemm(with_payload(shard, blocks[src]), out_blocks[src])
    with torch.cuda.stream(side):
        mem.barrier(channel=0)  # every rank has read every buffer: they may be written again
    main.wait_stream(side)
    return with_payload(shard, gathered)


def gemm_reduce_scatter(a: Operand, gemm: BlockGemm, n: int, dtype: torch.dtype, group: Any,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's rows of sum over ranks of Y, Y [M, n] = the GEMM of ``a`` [M, K] (P blocks of M / P rows),
    plus ``bias``: the GEMM of each rank's own block adds it (in its epilogue), so the sum holds it once.

    Pipelined (a ring of P - 1 steps): step s computes the block for rank r + s into this rank's buffer,
    then, while the next block is computed, pulls the block rank r - s computed for this rank; the P
    partials of this rank's rows are then summed locally (``torch.sum``: float32 accumulation, one rounding).
    """
    size, rank = group_size(group), group_rank(group)
    rows = a.shape[0]
    if rows % size:
        raise ValueError(f"reduce_scatter needs dim 0 ({rows}) divisible by the group size {size}")
    symm = _symmetric_memory(group) if a.device.type == "cuda" else None
    if symm is None:
        y = torch.empty(rows, n, dtype=dtype, device=a.device)
        for q, out in enumerate(y.chunk(size)):
            gemm(row_block(a, q, size), out, bias if q == rank else None)
        return reduce_scatter(y, group)
    m = rows // size
    partials = torch.empty(rows, n, dtype=dtype, device=a.device)  # block q: rank q's partial of this rank's rows
    blocks = partials.chunk(size)
    mem = symm.get_symm_mem_workspace(group.group_name, min_size=2 * m * n * partials.element_size())
    main, side = torch.cuda.current_stream(), _side_stream(a.device)
    for step in range(1, size):
        slot = (step % 2) * m * n  # two buffers: one is written while the other is read
        if step >= 3:
            main.wait_stream(side)  # the buffer of step - 2 has been read by every rank
        gemm(row_block(a, (rank + step) % size, size), mem.get_buffer(rank, (m, n), dtype, slot), None)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            mem.barrier(channel=1)  # every rank's block of this step is written
            blocks[(rank - step) % size].copy_(mem.get_buffer((rank - step) % size, (m, n), dtype, slot))
            mem.barrier(channel=1)  # and read
    gemm(row_block(a, rank, size), blocks[rank], bias)
    main.wait_stream(side)
    return partials.view(size, m, n).sum(dim=0)


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the copies and barriers of ``device`` (one per device, reused by every pipeline)."""
    return torch.cuda.Stream(device)
