"""Matrix multiplication with optional FP8 operands.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): M = 0 or N = 0 give an empty D; K = 0
gives D = bias (or zeros, or ``out``
unchanged with ``accumulate``); NaN and inf propagate as in a float32 matmul; operands may have any
strides (a transposed view is read as it is).
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype


@declare(mutates=("out",))
def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, a_scale_inv: Optional[Tensor] = None, b_scale_inv: Optional[Tensor] = None,
         trans_a: bool = False, trans_b: bool = False, out_dtype: Optional[dtype] = None, out: Optional[Tensor] = None,
         accumulate: bool = False, use_split_accumulator: bool = True) -> Tensor:
    """D = op(a) @ op(b) + bias, with op(t) = t^T when its ``trans_*`` flag is set; row-major 2-D operands.

    FP8 operands carry their per-tensor ``*_scale_inv``: D = (a_s * a_scale_inv) @ (b_s * b_scale_inv).
    The product accumulates in float32; ``bias`` ([N]) is added in float32 before the cast to
    ``out_dtype`` (default: a's dtype, required when a is FP8). With ``accumulate`` the result is
    added into ``out`` (D = out + ...), which is also returned; otherwise ``out``, if given, receives D.
    ``use_split_accumulator`` asks Hopper FP8 kernels for the slower, more exact accumulation.
    Linear layers use: fprop y = gemm(x, W, trans_b=True); dgrad dx = gemm(dy, W);
    wgrad dW = gemm(dy, x, trans_a=True).
    Returns: D [M, N].
    """


@declare(mutates=("out",))
def gemm_blockwise(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, a_block: Tuple[int, int], b_block: Tuple[int, int],
                   out_dtype: dtype, bias: Optional[Tensor] = None, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """D = A @ B^T + bias on block-scaled FP8 operands (Float8BlockScaling), both read along K ("TN").

    A[i, k] = a[i, k] * a_scale_inv[i // a_block[0], k // a_block[1]] and likewise B from b;
    the product accumulates in float32, bias ([N]) is added in float32, then one cast to ``out_dtype``.
    With ``accumulate`` D = out + A @ B^T + bias (``out`` required), returned as ``out``.
    Args: a: [M, K] FP8, b: [N, K] FP8, both row-major; a_scale_inv [ceil(M / a_block[0]),
    ceil(K / a_block[1])] and b_scale_inv likewise, float32, any strides; a_block, b_block: (rows, cols)
    tiles, (1, 128) or (128, 128) for Float8BlockScaling (at most one of them 2-D on cuBLASLt).
    Linear layers use: fprop y = gemm_blockwise(x, W); dgrad dx = gemm_blockwise(dy, W^T); wgrad
    dW = gemm_blockwise(dy^T, x^T), each operand quantized along the GEMM's K.
    Returns: D [M, N].
    """


@declare
def gemm_grouped(a: Tensor, b: Tensor, m_splits: Tuple[int, ...], a_scale_inv: Optional[Tensor] = None,
                 b_scale_inv: Optional[Tensor] = None, out_dtype: Optional[dtype] = None, bias: Optional[Tensor] = None,
                 use_split_accumulator: bool = True) -> Tensor:
    """G GEMMs over the row splits of a: D[rows of g] = a_g @ b[g]^T + bias[g] (``gemm(a_g, b[g], trans_b=True)`` each).

    a: [M, K] split into G row blocks by ``m_splits`` (non-negative, summing to M); b: [G, N, K] (each b[g] a 2-D
    operand of any strides, such as views of one weight transpose); bias: None or [G, N]. FP8 operands carry one
    scale_inv per split, float32 [G] (any stride): a_g's is a_scale_inv[g], b[g]'s b_scale_inv[g]. Accumulation,
    bias, ``out_dtype`` and ``use_split_accumulator`` as in ``gemm``. A grouped linear layer uses: fprop
    y = gemm_grouped(x, W) with W [G, N, K]; dgrad dx = gemm_grouped(dy, W^T) with W^T [G, K, N].
    Returns: D [M, N].
    """


@declare
def gemm_grouped_wgrad(a_t: Tensor, b_t: Tensor, m_splits: Tuple[int, ...], a_scale_inv: Optional[Tensor] = None,
                       b_scale_inv: Optional[Tensor] = None, out_dtype: Optional[dtype] = None,
                       use_split_accumulator: bool = True) -> Tensor:
    """G GEMMs over column splits that share K: D[g] = a_t[:, cols of g] @ b_t[:, cols of g]^T.

    a_t: [N, M], b_t: [K, M], their columns split into G blocks by ``m_splits`` (non-negative, summing to M); an
    empty split gives D[g] = 0. Scales, accumulation and ``out_dtype`` as in ``gemm_grouped``. A grouped linear
    layer's weight gradients: dW = gemm_grouped_wgrad(dy^T, x^T), dW[g] = dy_g^T @ x_g.
    Returns: D [G, N, K].
    """
