"""Launch configurations of the flash-attention kernels (``_attention_kernels``) and the pruning that keeps
the ones that fit a device: a tile model per kernel (shared memory per pipeline stage, fp32 registers per
thread) checked before anything is compiled.

Config lists: (BLOCK_M query rows, BLOCK_N key rows, num_warps, num_stages). The measurements behind the
first entries (autotuner timings on the H200, 2026-11-22) are in docs/performance-history.md; under the
interpreter one small config exercises the multi-block paths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ._common import INTERPRET

__all__ = []

_FWD_SHAPES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4))
_DKDV_SHAPES = ((32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 8, 3), (32, 64, 4, 3))
_DQ_SHAPES = ((128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4))
# of 255 per thread: room for pointers, masks and the bf16 copies of P / dS; checked against ptxas's
# counts for sm_90 (configs above it spilled registers, those at or below it did not, or barely)
_MAX_REGS_PER_THREAD = 160


def _configs(shapes):
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


@dataclass(frozen=True)
class _Footprint:
    """A kernel's tile model, for pruning configs that cannot fit before they are compiled.

    Attributes:
        resident: the block kept for the whole program ("BLOCK_M": queries, "BLOCK_N": keys); the
            other axis is streamed, two 2-byte tiles (K and V, or Q and dO) per pipeline stage.
        resident_tiles: 2-byte [resident, HEAD_DIM] tiles kept (Q; Q and dO; K and V).
        accumulators: fp32 [resident, HEAD_DIM] accumulators (O; dQ; dK and dV).
        scores: fp32 [BLOCK_M, BLOCK_N] tiles live at once (S; P and dP).
    """

    resident: str
    resident_tiles: int
    accumulators: int
    scores: int

    def fits(self, config, head_dim: int, smem_budget: int) -> bool:
        """shared memory = 2 D (resident_tiles kept + 2 stages streamed) bytes <= the device's, and
        registers = (accumulators kept D + scores BLOCK_M BLOCK_N) / threads <= _MAX_REGS_PER_THREAD."""
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        kept, streamed = (block_m, block_n) if self.resident == "BLOCK_M" else (block_n, block_m)
        smem = 2 * head_dim * (self.resident_tiles * kept + 2 * config.num_stages * streamed)
        regs = (self.accumulators * kept * head_dim + self.scores * block_m * block_n) / (32 * config.num_warps)
        return smem <= smem_budget and regs <= _MAX_REGS_PER_THREAD

    def pruner(self) -> dict:
        """``prune_configs_by`` for triton.autotune: the configs that fit (the last one if none does)."""

        def fits_device(configs, named_args, **kwargs):
            head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
            budget = _shared_memory_bytes(named_args["Q"].device.index or 0)
            return [c for c in configs if self.fits(c, head_dim, budget)] or configs[-1:]

        return {"early_config_prune": fits_device}


_FWD_FOOTPRINT = _Footprint("BLOCK_M", resident_tiles=1, accumulators=1, scores=1)
_DQ_FOOTPRINT = _Footprint("BLOCK_M", resident_tiles=2, accumulators=1, scores=2)
_DKDV_FOOTPRINT = _Footprint("BLOCK_N", resident_tiles=2, accumulators=2, scores=2)

_TUNING_KEY = ["HEAD_DIM", "CAUSAL", "HAS_LO", "HAS_HI", "IS_VARLEN"]
