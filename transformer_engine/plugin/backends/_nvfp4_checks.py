"""Argument checks of the NVFP4 ops (plugin/catalog/nvfp4.py), shared by the reference and flagos backends.

Raised before any work, naming the value and the rule; a backend that implements an NVFP4 op calls these so
that its errors are the reference's.
"""

from __future__ import annotations

import torch

from transformer_engine.plugin.backends._checks import check_gemm_output, gemm_result_dtype
from transformer_engine.plugin.backends._fp8 import check_bool, check_scalar, check_tensor
from transformer_engine.plugin.catalog.nvfp4 import E4M3_BOUNDS, FOUR_OVER_SIX_MODES, check_e4m3_max, check_four_over_six

__all__ = ["E4M3_BOUNDS", "FOUR_OVER_SIX_MODES", "NVFP4_BLOCK", "check_e4m3_max", "check_gemm_nvfp4", "check_nvfp4_operand",
           "check_quantize_nvfp4"]

#: elements per NVFP4 block (TE's NVFP4_BLOCK_SCALING_SIZE)
NVFP4_BLOCK = 16
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _check_aligned(size: int, which: str, shape, why: str) -> None:
    if size % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 quantization of x with shape {tuple(shape)}: its {which} dim ({size}) must be divisible by {NVFP4_BLOCK} "
            f"({why}, as in NVIDIA TE); pad it to a multiple of {NVFP4_BLOCK}"
        )


def _check_seed(stochastic_rounding: bool, seed) -> None:
    if not stochastic_rounding:
        if seed is not None:
            raise ValueError("a seed was given with stochastic_rounding=False; pass seed=None, or stochastic_rounding=True")
        return
    if seed is None:
        raise ValueError("stochastic_rounding=True needs a seed: a one-element int64 tensor, fresh for every call")
    check_scalar(seed, "seed")
    if seed.dtype != torch.int64:
        raise TypeError(f"seed has dtype {seed.dtype}; it must be a one-element torch.int64 tensor")


def check_quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed, four_over_six=None,
                         e4m3_max=448) -> None:
    """The arguments of ``quantize_nvfp4``: TypeError / ValueError naming the value and the rule."""
    check_tensor(x, "x")
    if x.dtype not in _HIGH_PRECISION:
        raise TypeError(f"x has dtype {x.dtype}; NVFP4 quantizes float32, bfloat16 or float16 tensors")
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D x [M, N], got shape {tuple(x.shape)}; reshape it to 2-D first")
    for value, name in ((rowwise, "rowwise"), (columnwise, "columnwise"), (block_2d, "block_2d"), (rht, "rht"),
                        (stochastic_rounding, "stochastic_rounding")):
        check_bool(value, name)
    if not (rowwise or columnwise):
        raise ValueError("quantize_nvfp4 with rowwise=False and columnwise=False writes nothing; ask for at least one copy")
    if rowwise or block_2d:
        _check_aligned(x.shape[1], "last", x.shape, "one E4M3 scale per 16 consecutive elements of a row")
    if columnwise or block_2d:
        _check_aligned(x.shape[0], "first", x.shape, "the column-wise copy has one scale per 16 rows; 2-D tiles are 16 x 16")
    _check_seed(stochastic_rounding, seed)
    check_four_over_six(four_over_six, e4m3_max, rht=rht, stochastic_rounding=stochastic_rounding)


def check_nvfp4_operand(q, scale, amax, name: str, e4m3_max=448) -> None:
    """One NVFP4 operand: q uint8 [M, K / 2] (packed E2M1), scale uint8 [M, K / 16] (E4M3 bits), amax one float32,
    e4m3_max 448 or 256."""
    check_tensor(q, name)
    check_tensor(scale, f"{name} scale")
    if q.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"{name} ({q.dtype}) and its scale ({scale.dtype}) must be torch.uint8 (packed E2M1 codes, E4M3 bits)")
    if q.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K / 2], got shape {tuple(q.shape)}")
    m, k = q.shape[0], 2 * q.shape[1]
    if k % NVFP4_BLOCK or tuple(scale.shape) != (m, k // NVFP4_BLOCK):
        raise ValueError(
            f"{name} {tuple(q.shape)} (K = {k}) with scales {tuple(scale.shape)}: NVFP4 needs K % {NVFP4_BLOCK} == 0 and "
            f"scales [{m}, K / {NVFP4_BLOCK}]"
        )
    check_scalar(amax, f"{name} amax")
    if amax.dtype != torch.float32:
        raise TypeError(f"the amax of {name} has dtype {amax.dtype}; it must be a one-element float32 tensor")
    check_e4m3_max(e4m3_max, "e4m3_max" if name == "q" else f"{name}_e4m3_max")


def check_gemm_nvfp4(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias, out, accumulate, a_e4m3_max=448,
                     b_e4m3_max=448) -> torch.dtype:
    """The arguments of ``gemm_nvfp4`` (both operands, accumulate / out / out_dtype, the shapes); returns D's dtype.

    D's dtype is out_dtype, else out's dtype, else float32; a [M, K / 2] and b [N, K / 2] share K; accumulate
    needs out; bias is [N], out [M, N].
    """
    check_nvfp4_operand(a, a_scale, a_amax, "a", a_e4m3_max)
    check_nvfp4_operand(b, b_scale, b_amax, "b", b_e4m3_max)
    dtype = gemm_result_dtype(out_dtype, out, accumulate, default=torch.float32)
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"gemm_nvfp4 inner dimensions differ: a {tuple(a.shape)} holds K = {2 * k}, b {tuple(b.shape)} "
                         f"K = {2 * k_b}; quantize both operands along the same K")
    check_gemm_output(m, n, bias, out)
    return dtype
