"""Reference (pure PyTorch) GEMM. See plugin/catalog/gemm.py for the contract.

    D = op(a) @ op(b) + bias,   op(t) = t^T when its trans_* flag is set,
    FP8 operands enter dequantized: t = t_fp8 * t_scale_inv,
    everything in float32 (the product, the bias add and the accumulate into ``out``), then one cast.

No vendor kernel is used here: this is the oracle the cuBLASLt path (``torch._scaled_mm``) of the
vendor backend is tested against, so ``use_split_accumulator`` has nothing to change (float32
accumulation is the most exact one on offer).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._checks import check_gemm_output, gemm_result_dtype
from .._fp8 import check_tensor, is_fp8, scalar_f32
from .quantization import dequantize_blockwise

__all__ = ["gemm", "gemm_blockwise"]


def _operand_f32(t, scale_inv, name: str) -> torch.Tensor:
    """A 2-D operand in float32, dequantized (t * scale_inv) when it is FP8."""
    check_tensor(t, name)
    if t.dim() != 2:
        raise ValueError(f"gemm operand {name} must be 2-D (row-major [rows, cols]), got shape {tuple(t.shape)}")
    if is_fp8(t):
        if scale_inv is None:
            raise ValueError(f"{name} is FP8 ({t.dtype}) but {name}_scale_inv is None; pass its per-tensor scale_inv")
        return t.float() * scalar_f32(scale_inv, f"{name}_scale_inv")
    if scale_inv is not None:
        raise ValueError(f"{name}_scale_inv was given but {name} is {t.dtype}, not FP8; pass {name}_scale_inv=None")
    if not t.is_floating_point():
        raise TypeError(f"gemm operand {name} has dtype {t.dtype}; it must be a floating-point or FP8 tensor")
    return t.float()


def _result_dtype(a: torch.Tensor, out_dtype, out, accumulate: bool) -> torch.dtype:
    """out_dtype, else out's dtype, else a's dtype (which an FP8 ``a`` cannot provide)."""
    if out_dtype is None and out is None and is_fp8(a):
        raise ValueError(f"a is FP8 ({a.dtype}), so gemm needs out_dtype (e.g. torch.bfloat16)")
    return gemm_result_dtype(out_dtype, out, accumulate, default=a.dtype)


def _check_shapes(a_op: torch.Tensor, b_op: torch.Tensor, bias, out, shapes: str) -> Tuple[int, int]:
    """(M, N) of op(a) [M, K] @ op(b) [K, N]; ValueError naming both shapes when they do not fit."""
    (m, k), (k_b, n) = a_op.shape, b_op.shape
    if k != k_b:
        raise ValueError(f"gemm inner dimensions differ: op(a) is {tuple(a_op.shape)}, op(b) is {tuple(b_op.shape)} ({shapes})")
    check_gemm_output(m, n, bias, out)
    return m, n


def gemm(a, b, bias=None, a_scale_inv=None, b_scale_inv=None, trans_a=False, trans_b=False, out_dtype=None, out=None, accumulate=False,
         use_split_accumulator=True):
    """D = op(a) @ op(b) + bias (+ out when ``accumulate``), accumulated in float32.

    Args:
        a, b: 2-D high-precision or FP8 tensors; op(a) is [M, K], op(b) is [K, N].
        bias: optional [N], added in float32.
        a_scale_inv, b_scale_inv: one-element scale_inv of an FP8 operand (None otherwise).
        trans_a, trans_b: use the transpose of a / b.
        out_dtype: result dtype; default out's dtype if ``out`` is given, else a's dtype.
        out: optional [M, N] tensor that receives D (or is accumulated into).
        accumulate: D = out + op(a) @ op(b) + bias; needs ``out``.
        use_split_accumulator: accepted for TE parity; float32 accumulation is already exact here.

    Returns:
        D [M, N] in the result dtype (``out`` itself when it is given).

    Raises:
        ValueError: non-2-D operands, mismatched shapes, FP8 without scale_inv or out_dtype,
        accumulate without out. TypeError: non-float operands.
    """
    a_f32 = _operand_f32(a, a_scale_inv, "a")
    b_f32 = _operand_f32(b, b_scale_inv, "b")
    result_dtype = _result_dtype(a, out_dtype, out, accumulate)
    a_op = a_f32.t() if trans_a else a_f32
    b_op = b_f32.t() if trans_b else b_f32
    shapes = f"a {tuple(a.shape)} trans_a={bool(trans_a)}, b {tuple(b.shape)} trans_b={bool(trans_b)}"
    _check_shapes(a_op, b_op, bias, out, shapes)
    d = a_op @ b_op
    if bias is not None:
        d = d + bias.float()
    if accumulate:
        d = d + out.float()
    if out is None:
        return d.to(result_dtype)
    return out.copy_(d)


def _block_operand_f32(t, scale_inv, block, name: str) -> torch.Tensor:
    """A block-scaled FP8 operand dequantized to float32: t[i, k] * scale_inv[i // block[0], k // block[1]]."""
    check_tensor(t, name)
    if not is_fp8(t):
        raise TypeError(f"gemm_blockwise operand {name} has dtype {t.dtype}; it must be FP8 (torch.float8_e4m3fn / e5m2)")
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"{name}_block={block!r} must be a (rows, cols) tile shape such as (1, 128) or (128, 128)")
    return dequantize_blockwise(t, scale_inv, block[0], block[1], torch.float32)


def gemm_blockwise(a, b, a_scale_inv, b_scale_inv, a_block, b_block, out_dtype, bias=None, out=None, accumulate=False):
    """D = A @ B^T + bias (+ out when ``accumulate``) with A, B the dequantized block-scaled operands, in float32.

    Args: as in plugin/catalog/gemm.py (a [M, K], b [N, K], both FP8 with their tile scales).

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        TypeError: a non-FP8 operand. ValueError: a bad tile shape, scale_inv of the wrong shape,
        operands whose K differ, a bad bias / out, accumulate without out.
    """
    a_f32 = _block_operand_f32(a, a_scale_inv, a_block, "a")
    b_f32 = _block_operand_f32(b, b_scale_inv, b_block, "b")
    return gemm(a_f32, b_f32, bias=bias, trans_b=True, out_dtype=out_dtype, out=out, accumulate=accumulate)
