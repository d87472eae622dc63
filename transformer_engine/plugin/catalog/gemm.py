"""Matrix multiplication with optional FP8 operands."""

from transformer_engine.plugin.core.catalog import declare


@declare
def gemm(a, b, bias=None, a_scale_inv=None, b_scale_inv=None, trans_a=False, trans_b=False, out_dtype=None, out=None, accumulate=False, use_split_accumulator=True):
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
