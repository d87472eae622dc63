"""MXFP8 (OCP Microscaling v1.0, as NVIDIA TE runs it): 32-element blocks, E8M0 scales, FP8 values.

Each block of 32 consecutive elements along the last dim of x [M, N] (the row-wise copy), or along
its first dim (the column-wise copy, stored transposed as ``data_t`` [N, M] with its blocks along its
own rows), shares one E8M0 scale: a power of two 2^(s - 127) coded by its biased exponent s, a uint8
in [0, 254]; s = 255 is NaN. With fp8_max = 448 (E4M3) or 57344 (E5M2), per block B:

    amax  = max |x| over B, NaN ignored (TE's fmaxf), +-inf counted
    v     = fp32(amax * fp32(1 / fp8_max))                  (a product with the rounded reciprocal, as TE's kernels)
    s     = biased exponent of v rounded up to a power of two, saturating and finite: 0 for v <= 2^-127
            (zero blocks included), 254 for v = inf, 255 for v = NaN (TE's ``float_to_e8m0``; it equals
            ``cvt.rp.satfinite.ue8m0x2.f32`` on sm100), so 2^(s - 127) = 2^ceil(log2(v)) on [2^-127, 2^127]
    q     = cast_fp8(clip(x * 2^(127 - s), -fp8_max, fp8_max))  (fp32 product, round to nearest even;
            +-inf saturates to +-fp8_max, NaN stays NaN); 2^(127 - s) is NaN for s = 255
    x_hat = q * 2^(s - 127)                                   (dequantize: exact in float32)

Rounding the scale up means |x| / 2^(s - 127) <= fp8_max up to the rounding of v: no value saturates
except when v rounded down onto a power of two. The row-wise and column-wise copies are two
quantizations of x (each block has its own amax), never one made from the other.

Alignment (TE's): the row-wise copy needs N % 32 == 0, the column-wise copy M % 32 == 0.
An MXFP8 GEMM D = A @ B^T reads both operands along K with their scales along K; emulated, it is the
float32 GEMM of the dequantized operands (exact up to the order of the float32 accumulation).
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype


@declare
def quantize_mxfp8(x: Tensor, fp8_dtype: dtype, rowwise: bool, columnwise: bool) -> Tuple[Optional[Tensor], Optional[Tensor],
                                                                                          Optional[Tensor], Optional[Tensor]]:
    """MXFP8 cast of a 2-D tensor into its row-wise and/or column-wise copies (math in the module docstring).

    (data, scale) = blocks of 32 along the rows of x,  (data_t, scale_t) = blocks of 32 along the rows of x^T
    Args: x: [M, N] float32/bfloat16/float16; fp8_dtype: torch.float8_e4m3fn (MXFP8BlockScaling's default)
    or torch.float8_e5m2; rowwise, columnwise: which copies to write (at least one).
    Returns: (data [M, N] fp8, scale uint8 [M, N / 32], data_t [N, M] fp8, scale_t uint8 [N, M / 32]); the
    copies not asked for are None. Raises ValueError when N % 32 (row-wise) or M % 32 (column-wise) != 0.
    """


@declare
def dequantize_mxfp8(q: Tensor, scale_e8m0: Tensor, out_dtype: dtype) -> Tensor:
    """x[i, j] = q[i, j] * 2^(scale_e8m0[i, j // 32] - 127), computed in float32 and cast to ``out_dtype``.

    Args: q: [M, K] fp8; scale_e8m0: uint8 [M, K / 32] (255 decodes NaN). Returns: x [M, K].
    """


@declare(mutates=("out",))
def gemm_mxfp8(a: Tensor, b: Tensor, a_scale_e8m0: Tensor, b_scale_e8m0: Tensor, out_dtype: dtype, bias: Optional[Tensor] = None,
               out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """D = A @ B^T + bias on MXFP8 operands, both read along K ("TN").

    A = dequantize_mxfp8(a, a_scale_e8m0), B = dequantize_mxfp8(b, b_scale_e8m0); the product accumulates
    in float32, bias ([N]) is added in float32, then one cast to ``out_dtype``. With ``accumulate``
    D = out + A @ B^T + bias (``out`` required), returned as ``out``.
    Args: a: [M, K] fp8, b: [N, K] fp8, row-major, K % 32 == 0; a_scale_e8m0 uint8 [M, K / 32],
    b_scale_e8m0 uint8 [N, K / 32]. Linear layers use: fprop y = gemm_mxfp8(x, W); dgrad
    dx = gemm_mxfp8(dy, W^T); wgrad dW = gemm_mxfp8(dy^T, x^T), each operand the copy quantized along K.
    Returns: D [M, N].
    """
