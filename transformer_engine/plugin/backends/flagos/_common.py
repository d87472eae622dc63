"""Pieces shared by the flagos kernel files: the FP8 cast, the amax reduction and launch heuristics.

FP8 cast (catalog contract): q = cast_fp8(clip(y, -fp8_max, fp8_max)) with round-to-nearest-even,
NaN stays NaN, +-inf saturates. Kernels store q as its uint8 code (the output is viewed as uint8),
computed one of two ways, chosen per launch by the ``HW_CAST`` constexpr:

- hardware: ``cvt.rn.satfinite`` through ``y.to(tl.float8e4nv / tl.float8e5)`` (NVIDIA compute
  capability >= 8.9, where Triton lowers fp32 -> fp8 to that instruction, F2FP.SATFINITE in SASS).
  satfinite is the clip: +-inf and |y| > fp8_max give +-fp8_max, NaN gives NaN;
- emulated, in integer arithmetic on the float32 bit pattern: used by the interpreter (whose float
  casts truncate) and by older GPUs. For |y| = 2^e (1 + f) in the FP8 normal range the code is
  the RNE rounding of the bit pattern to MBITS mantissa bits, re-biased; below it the code is
  round_half_even(|y| / 2^(1 - EBIAS - MBITS)), which also yields the smallest normal on carry.

amax = max |y| over finite y: each program reduces its block, then one relaxed ``tl.atomic_max`` on
the int32 bit pattern (for non-negative floats the int order is the float order) into a zeroed
int32 buffer that the launcher returns viewed as float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.backends._device import cuda_properties
from transformer_engine.plugin.backends._fp8 import check_fp8_dtype
from transformer_engine.plugin.core.config import triton_interpret

__all__ = [
    "INTERPRET",
    "cdiv",
    "next_power_of_2",
    "MAX_FUSED_SIZE",
    "NO_FP8",
    "Fp8Format",
    "Fp8Outputs",
    "fp8_format",
    "fp8_outputs",
    "device_guard",
    "hw_fp8_cast",
    "num_programs_hint",
    "row_block",
    "rows_view",
    "warps_for",
]

#: True when this module was imported with TRITON_INTERPRET on (Triton's rule: 1 / true / yes / on): every kernel
#: then runs in Triton's CPU interpreter, so launches must take the emulated FP8 casts.
INTERPRET = triton_interpret()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. Host code uses this, not ``triton.cdiv``: Triton 3.x made that a
    ``constexpr_function`` whose host call costs several microseconds (argument unwrapping)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1); the host-side twin of ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


#: Rows longer than this are not handled by the one-block-per-row kernels (registers would spill).
MAX_FUSED_SIZE = 32768


@dataclass(frozen=True)
class Fp8Format:
    """Constexprs of one FP8 format: largest finite value, mantissa bits and exponent bias."""

    fp8_max: float
    mbits: int
    ebias: int

    def constexprs(self, hw_cast: bool) -> Dict[str, object]:
        """Keyword constexprs of every FP8-writing kernel."""
        return dict(FP8_MAX=self.fp8_max, MBITS=self.mbits, EBIAS=self.ebias, HW_CAST=hw_cast)


_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(448.0, 3, 7),
    torch.float8_e5m2: Fp8Format(57344.0, 2, 15),
}

#: Constexprs passed when a kernel writes no FP8 (the FP8 branches are compiled out).
NO_FP8 = dict(FP8_MAX=1.0, MBITS=3, EBIAS=7, HW_CAST=False)


def fp8_format(fp8_dtype: torch.dtype) -> Fp8Format:
    """The :class:`Fp8Format` of ``fp8_dtype``; ValueError for anything but E4M3 / E5M2."""
    fmt = _FORMATS.get(fp8_dtype)
    if fmt is None:
        check_fp8_dtype(fp8_dtype)  # raises: E4M3 and E5M2 are its only FP8 dtypes
    return fmt


def hw_fp8_cast(device: torch.device) -> bool:
    """True when kernels on ``device`` may use the hardware fp32 -> fp8 conversion (sm_89+, compiled)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip is not None:
        return False
    properties = cuda_properties(device)  # cached per device
    return (properties.major, properties.minor) >= (8, 9)


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """Context that makes ``t``'s GPU current for a launch (Triton launches on the current device); none
    while torch.compile traces (Inductor launches on the device of the kernel's tensors)."""
    if torch.compiler.is_compiling():
        return _NO_GUARD
    index = t.get_device()  # -1 on the CPU
    if index < 0 or INTERPRET or index == torch._C._cuda_getDevice():  # (CUDA is initialized: t lives there)
        return _NO_GUARD
    return torch.cuda.device(index)


_COUNTERS: Dict[Tuple[torch.device, int], torch.Tensor] = {}


def stream_counters(device: torch.device) -> torch.Tensor:
    """int32 [2] zeros owned by ``device``'s current stream, for a kernel that reduces through atomics and
    zeroes them again when it ends (no fill launch per call). Kept for the process: a kernel captured in a
    CUDA graph keeps using the one of its capture stream."""
    stream = 0
    if device.type == "cuda" and not INTERPRET:  # the stream's handle, without building a Stream object per call
        stream = torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch._C._cuda_getDevice())
    counters = _COUNTERS.get((device, stream))
    if counters is None:
        counters = _COUNTERS[(device, stream)] = torch.zeros(2, dtype=torch.int32, device=device)
    return counters


def num_programs_hint(device: torch.device, per_sm: int = 2) -> int:
    """How many persistent programs fill ``device``: ``per_sm`` per SM on a GPU, 4 in the interpreter."""
    if device.type != "cuda" or INTERPRET:
        return 4
    return per_sm * cuda_properties(device).multi_processor_count


def warps_for(elements: int) -> int:
    """num_warps for a program holding ``elements`` values: 4 up to 2K, 8 to 8K, 16 to 32K, then 32."""
    if elements <= 2048:
        return 4
    if elements <= 8192:
        return 8
    return 16 if elements <= 32768 else 32


def row_block(rows: int, cols: int, target: int = 4096) -> Tuple[int, int]:
    """(BLOCK_N, ROWS): the whole row padded to a power of two, and rows per program.

    Short rows are batched so that a program handles about ``target`` elements.
    """
    block_n = next_power_of_2(max(cols, 1))
    rows_per_program = max(1, min(target // block_n, next_power_of_2(max(rows, 1))))
    return block_n, rows_per_program


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (any row stride works), else a contiguous copy."""
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[-1] else t.contiguous()


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """t as [M, N] (N = last dim) with a unit column stride: a view when possible, else a copy."""
    if t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1):
        return t  # already [M, N] with unit column stride (the common case: no view to make)
    cols = t.shape[-1]
    try:
        rows = t.view(-1, cols)
    except RuntimeError:
        rows = t.reshape(-1, cols)
    return rows if rows.stride(-1) == 1 or cols == 1 else rows.contiguous()


class Fp8Outputs:
    """The buffers of one FP8-writing launch (a plain slotted class: built once per cast, on the hot path).

    Attributes:
        q: the FP8 result (what the op returns).
        q_bits: the same storage viewed as uint8 (what kernels store).
        scale_inv: 0-d float32, written by the kernel (1 / scale).
        amax_bits: 0-d int32 that ``tl.atomic_max`` reduces into: a zeroed new buffer, or the caller's
            ``amax_out`` slot (then max(amax_out, amax) lands in the slot).
        amax: amax_bits as the float32 tensor the op returns.
        fmt: the constexprs of the format.
    """

    __slots__ = ("q", "q_bits", "scale_inv", "amax_bits", "amax", "fmt")

    def __init__(self, q, scale_inv, amax_bits, amax, fmt: Fp8Format):
        self.q, self.q_bits, self.scale_inv = q, q.view(torch.uint8), scale_inv
        self.amax_bits, self.amax, self.fmt = amax_bits, amax, fmt


def fp8_outputs(shape, fp8_dtype: torch.dtype, device: torch.device, amax_out: Optional[torch.Tensor] = None) -> Fp8Outputs:
    """Allocate q (``shape``, ``fp8_dtype``) and scale_inv for one launch, and a zeroed amax unless the
    kernel accumulates into ``amax_out`` (a float32 slot holding a value >= 0, validated by the caller)."""
    q = torch.empty(shape, dtype=fp8_dtype, device=device)
    fmt = fp8_format(fp8_dtype)
    if amax_out is not None:  # no zero fill, no record afterwards: two fewer launches per cast
        scale_inv = torch.empty((), dtype=torch.float32, device=device)
        amax = amax_out if amax_out.dim() == 0 else amax_out.view(())  # 0-d, as without a slot
        return Fp8Outputs(q, scale_inv, amax_out.view(torch.int32), amax, fmt)
    if torch.compiler.is_compiling():  # traced: two buffers (Inductor cannot pass a dtype view of a slice to a kernel)
        amax = torch.zeros((), dtype=torch.float32, device=device)
        return Fp8Outputs(q, torch.empty((), dtype=torch.float32, device=device), amax.view(torch.int32), amax, fmt)
    scalars = torch.zeros(2, dtype=torch.int32, device=device)  # one allocation for both
    amax_bits = scalars[1]
    return Fp8Outputs(q, scalars[0].view(torch.float32), amax_bits, amax_bits.view(torch.float32), fmt)


@triton.jit
def _tile_offsets(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows as int64, cols, mask) of output tile ``tile`` of an [M, N] grid of tiles."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tile.to(tl.int64)  # plain ops have N = numel: tile * BLOCK_N may pass 2^31
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows, cols, mask


@triton.jit
def _fp8_encode(y, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EBIAS: tl.constexpr, HW_CAST: tl.constexpr):
    """uint8 code of cast_fp8(clip(y, -FP8_MAX, FP8_MAX)), round-to-nearest-even, NaN kept."""
    y = y.to(tl.float32)
    if HW_CAST:
        # cvt.rn.satfinite already is the contract: +-inf and |y| > FP8_MAX give +-FP8_MAX, NaN stays
        # NaN; an explicit clip would only add three instructions per element
        if MBITS == 3:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        is_nan = y != y
        clipped = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = clipped.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |clip(y)|, finite
        e = a >> 23  # biased float32 exponent
        # normal FP8: round the bit pattern to MBITS mantissa bits (ties to even), then re-bias
        SHIFT: tl.constexpr = 23 - MBITS
        rounded = a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)
        normal = (rounded >> SHIFT) - ((127 - EBIAS) << MBITS)
        # subnormal FP8: significand / 2^t rounded half to even, t = distance to the FP8 quantum
        sig = (a & 0x7FFFFF) | 0x800000
        t = tl.maximum(tl.minimum((151 - EBIAS - MBITS) - e, 25), 1)  # clamped: unused outside 1..25
        quot = sig >> t
        rem = sig - (quot << t)
        half = 1 << (t - 1)
        up = (rem > half) | ((rem == half) & ((quot & 1) == 1))
        sub = quot + up.to(tl.int32)
        code = tl.where(e >= 128 - EBIAS, normal, sub)
        code = (tl.where(is_nan, 0x7F, code) | sign).to(tl.uint8)
    return code


@triton.jit
def _fp8_decode(code, MBITS: tl.constexpr, EBIAS: tl.constexpr, HW_CAST: tl.constexpr):
    """float32 value of a uint8 FP8 code (exact; NaN codes give NaN, E5M2 infinities inf)."""
    if HW_CAST:
        if MBITS == 3:
            value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            value = code.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        b = code.to(tl.int32)
        negative = (b & 0x80) != 0
        e = (b >> MBITS) & ((1 << (7 - MBITS)) - 1)
        m = b & ((1 << MBITS) - 1)
        normal = (((e + (127 - EBIAS)) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        quantum = tl.full(e.shape, (128 - EBIAS - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
        magnitude = tl.where(e == 0, m.to(tl.float32) * quantum, normal)
        if MBITS == 3:
            magnitude = tl.where((e == 15) & (m == 7), float("nan"), magnitude)
        else:
            magnitude = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), magnitude)
        value = tl.where(negative, -magnitude, magnitude)
    return value


@triton.jit
def _finite_abs(y):
    """|y| in float32 where y is finite, NaN where it is not (the amax operand).

    y + 0 * y is y for finite y and NaN for +-inf and NaN (0 * inf = NaN): one FFMA, the |.| being
    free in the FMNMX that consumes it. tl.maximum / tl.max (IEEE maxNum) skip NaN operands, so the
    non-finite elements drop out of the amax. No mask: the lanes a kernel masks off hold 0 (its
    masked loads give 0 and its math keeps 0 there, or makes NaN, which drops out as well).
    """
    y = y.to(tl.float32)
    return tl.abs(y + y * 0.0)


@triton.jit
def _amax_commit(amax_ptr, acc):
    """amax <- max(amax, max(acc)) by one relaxed atomic on the int32 view.

    acc: a 1-D tensor of _finite_abs values (reduce 2-D tiles along axis 1 first: the full
    reduction of a 2-D tile reshapes it through shared memory). Its max is NaN only when no element
    is finite; that block then contributes 0. Relaxed order: the launcher reads amax after the
    kernel, so no fence is needed and the atomic is a fire-and-forget RED.
    """
    block_max = tl.max(acc, axis=0)
    block_max = tl.where(block_max == block_max, block_max, 0.0)
    tl.atomic_max(amax_ptr, block_max.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _scale_inv_store(scale_inv_ptr, scale):
    """Program 0 writes scale_inv = 1 / scale (IEEE division, as torch.reciprocal)."""
    if tl.program_id(0) == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
