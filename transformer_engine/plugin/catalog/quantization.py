"""FP8 quantization ops: per-tensor casts, transposes, amax, block scaling, delayed-scaling update.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available):
- empty tensors and zero-size dims are fine: empty q / q_t, amax 0 (so current scaling's scale is 1),
  dbias of N zeros;
- NaN stays NaN in q (a NaN code), +-inf saturates to +-fp8_max; every amax (and each block's
  amax) skips NaN and +-inf; a non-finite amax given to a scale function leaves the scale at 1
  (current / block scaling) or at its old value (delayed scaling);
- inputs may have any strides; q, q_t and dbias are new contiguous tensors; the returned amax is a
  0-d float32 tensor, with ``amax_out`` a 0-d view of that slot.
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype


@declare(mutates=("amax_out",))
def quantize(x: Tensor, scale: Tensor, fp8_dtype: dtype, amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-tensor saturating cast to FP8.

    q = cast_fp8(clip(x * scale, -fp8_max, fp8_max)),  scale_inv = 1 / scale,  amax = max|x| (finite x)

    Args: x: any shape, float32/bfloat16/float16; scale: float32, one element; fp8_dtype: the FP8 dtype;
    amax_out: None, or a one-element float32 tensor on x's device holding a value >= 0 (an amax history
    slot): the op then also sets amax_out = max(amax_out, amax) in place and returns amax_out as amax.
    Returns: (q, scale_inv, amax): q has x's shape in ``fp8_dtype``; scale_inv and amax are 0-d float32.
    NaN in x stays NaN in q; +-inf saturates to +-fp8_max.
    """


@declare
def dequantize(q: Tensor, scale_inv: Tensor, out_dtype: dtype) -> Tensor:
    """x = q * scale_inv, computed in float32 and cast to ``out_dtype``.

    Returns: x with q's shape.
    """


@declare(mutates=("amax_out",))
def cast_transpose(x: Tensor, scale: Tensor, fp8_dtype: dtype, amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize a 2-D tensor and also write its transpose (the layout the wgrad/dgrad GEMMs need).

    q = quantize(x),  q_t = q^T (contiguous)
    Args: x: [M, N]; scale, fp8_dtype, amax_out: as in ``quantize``. Returns: (q [M, N], q_t [N, M], scale_inv, amax) as in ``quantize``.
    """


@declare(mutates=("amax_out",))
def quantize_transposed(x: Tensor, scale: Tensor, fp8_dtype: dtype, amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Only the transposed half of ``cast_transpose``, for an operand that only a transposed GEMM reads
    (a weight's W^T for dgrad): the row-major q is not written.

    q_t = quantize(x)^T (contiguous)
    Args: x: [M, N]; scale, fp8_dtype, amax_out: as in ``quantize``. Returns: (q_t [N, M], scale_inv, amax) as in ``quantize``.
    """


@declare(mutates=("amax_out",))
def cast_transpose_grouped(x: Tensor, m_splits: Tuple[int, ...], scale: Tensor, fp8_dtype: dtype,
                           amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``cast_transpose`` of the row splits x = [x_0; ...; x_{G-1}] of one tensor, split g with its own scale.

    q[rows of g] = quantize(x_g, scale[g]),  q_t = q^T (the whole matrix: x_g^T is q_t[:, o_g : o_g + m_g]),
    scale_inv[g] = 1 / scale[g],  amax[g] = max|x_g| (finite; 0 for an empty split)
    Args: x: [M, K]; m_splits: G >= 1 non-negative row counts summing to M; scale: float32 [G] (any stride);
    fp8_dtype: as in ``quantize``; amax_out: None, or float32 [G] (any stride) on x's device holding values >= 0
    (a role's slots of an amax history row): the op then sets amax_out[g] = max(amax_out[g], amax[g]) in place and
    returns amax_out as amax. Returns: (q [M, K], q_t [K, M], scale_inv [G], amax [G]), float32 vectors.
    """


@declare
def column_sums_grouped(x: Tensor, m_splits: Tuple[int, ...], out_dtype: Optional[dtype] = None) -> Tensor:
    """Column sums of each row split of x [M, N]: out[g, j] = sum of x[r, j] over the rows r of split g (the bias
    gradients of a grouped linear layer), accumulated in float32 and rounded once to ``out_dtype`` (None: float32).

    Args: x: [M, N] float; m_splits: G >= 1 non-negative row counts summing to M. Returns: [G, N] (zeros for an
    empty split). Non-finite x propagate as in a float32 sum.
    """


@declare(mutates=("amax_out",))
def cast_transpose_dbias(x: Tensor, scale: Tensor, fp8_dtype: dtype, amax_out: Optional[Tensor] = None,
                         dbias_dtype: Optional[dtype] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``cast_transpose`` of the output gradient plus the bias gradient, from one read of x.

    (q, q_t, scale_inv, amax) = cast_transpose(x),  dbias[j] = sum_i x[i, j] accumulated in float32
    Args: x: [M, N] (dy of a linear layer); scale, fp8_dtype, amax_out: as in ``quantize``; dbias_dtype: the dtype
    dbias is returned in, rounded once from the float32 sum (None: float32). Returns: (q [M, N], q_t [N, M],
    scale_inv, amax, dbias [N]). Non-finite x propagate into dbias as in a float32 sum (NaN, +-inf, inf - inf = NaN).
    """


@declare
def fp8_transpose(q: Tensor) -> Tensor:
    """Contiguous transpose of a 2-D FP8 tensor (no rescaling): q_t[j, i] = q[i, j]."""


@declare
def compute_amax(x: Tensor) -> Tensor:
    """amax = max|x| over the finite elements of x, as a 0-d float32 tensor (0 for an empty x)."""


@declare
def scale_from_amax(amax: Tensor, fp8_dtype: dtype, amax_epsilon: float = 0.0, power_2_scale: bool = False) -> Tensor:
    """Current scaling's scale from an amax: scale = fp8_max / max(amax, amax_epsilon).

    1 where amax is 0, inf or NaN; float32 max where the quotient overflows; with ``power_2_scale``
    rounded down to a power of two, 2^floor(log2(scale)). fp8_max is 448 (E4M3) or 57344 (E5M2).
    Args: amax: 0-d float32 tensor. Returns: a 0-d float32 tensor on amax's device.
    """


@declare
def current_scale(x: Tensor, fp8_dtype: dtype, amax_epsilon: float = 0.0, power_2_scale: bool = False) -> Tuple[Tensor, Tensor]:
    """(scale, amax) of x for current scaling: amax = compute_amax(x), scale = scale_from_amax(amax, ...).

    The cast that follows (``quantize`` and the others) takes this scale; the backends may compute both
    in one launch. Returns: (scale, amax), 0-d float32 tensors on x's device.
    """


@declare
def current_scale_grouped(x: Tensor, m_splits: Tuple[int, ...], fp8_dtype: dtype, amax_epsilon: float = 0.0,
                          power_2_scale: bool = False) -> Tuple[Tensor, Tensor]:
    """``current_scale`` of each row split x_g of x [M, K] (``m_splits``: G >= 1 non-negative row counts summing to M).

    amax[g] = max|x_g| over finite elements (0 for an empty split), scale[g] = scale_from_amax(amax[g], ...).
    Returns: (scale [G], amax [G]), float32 on x's device.
    """


@declare
def quantize_blockwise(x: Tensor, fp8_dtype: dtype, block_rows: int, block_cols: int, power_2_scale: bool,
                       amax_epsilon: float) -> Tuple[Tensor, Tensor]:
    """Block-scaled FP8 cast of a 2-D tensor: one scale per ``block_rows x block_cols`` tile.

    For each tile T: a = max(max|T|, amax_epsilon); scale = fp8_max / a (1 if a == 0 or not finite);
    with power_2_scale, scale = 2^floor(log2(scale)) (so scale_inv = 2^ceil(log2(a / fp8_max)), the
    MXFP8 E8M0 rule for 1x32 tiles); q = cast_fp8(clip(T * scale)); scale_inv = 1 / scale.
    Float8BlockScaling uses 1x128 (activations, gradients) and 128x128 (weights) tiles.
    Args: x: [M, N]. Returns: (q [M, N], scale_inv float32 [ceil(M / block_rows), ceil(N / block_cols)]).
    scale_inv may have any strides (consumers accept any): the flagos kernels write the scales of
    1 x B tiles column-major and those of B x B tiles row-major, the layouts cuBLASLt reads.
    """


@declare
def cast_transpose_blockwise(x: Tensor, fp8_dtype: dtype, block_len: int, power_2_scale: bool,
                             amax_epsilon: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """1 x ``block_len`` block-scaled FP8 casts of x along both dimensions, from one read of x.

    (q, scale_inv) = quantize_blockwise(x, fp8_dtype, 1, block_len, power_2_scale, amax_epsilon)
    (q_t, scale_inv_t) = quantize_blockwise(x^T, fp8_dtype, 1, block_len, power_2_scale, amax_epsilon)
    q_t is not q^T: each copy has its own scales (blocks run along the rows of x for q, along its
    columns for q_t), so both GEMM layouts of Float8BlockScaling's 1-D operands (x, dy) come from one pass.
    Args: x: [M, N]. Returns: (q [M, N], scale_inv [M, ceil(N / block_len)], q_t [N, M],
    scale_inv_t [N, ceil(M / block_len)]); scale_inv tensors as in ``quantize_blockwise``.
    """


@declare
def cast_transpose_blockwise_dbias(x: Tensor, fp8_dtype: dtype, block_len: int, power_2_scale: bool, amax_epsilon: float,
                                   dbias_dtype: Optional[dtype] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``cast_transpose_blockwise`` of the output gradient plus the bias gradient, from the same reads of x.

    (q, scale_inv, q_t, scale_inv_t) = cast_transpose_blockwise(x, ...),  dbias[j] = sum_i x[i, j] in float32
    Args: x: [M, N] (dy of a linear layer); dbias_dtype: as in ``cast_transpose_dbias``; the rest as in
    ``cast_transpose_blockwise``. Returns: (q, scale_inv, q_t, scale_inv_t, dbias [N]). Non-finite x propagate
    into dbias as in a float32 sum.
    """


@declare
def block_amax_of_range(x: Tensor, rows: int, cols: int, start: int, block_rows: int, block_cols: int) -> Tensor:
    """Per-tile amax of part of a matrix: a shard of a block-scaled weight, as ZeRO / FSDP hold it.

    x holds the elements [start, start + x.numel()) of a [rows, cols] matrix in row-major order (any shape,
    read flattened). amax[i, j] = max |x| over the elements of the range in tile (i, j) of ``block_rows x
    block_cols`` (0 for a tile with none; inf and NaN propagate, as in ``quantize_blockwise``'s tiles).
    The MAX over the ranges of all shards is the whole matrix's tile amax.
    Returns: float32 [ceil(rows / block_rows), ceil(cols / block_cols)] on x's device.
    """


@declare
def quantize_blockwise_range(x: Tensor, amax: Tensor, rows: int, cols: int, start: int, block_rows: int, block_cols: int,
                             fp8_dtype: dtype, power_2_scale: bool, amax_epsilon: float) -> Tuple[Tensor, Tensor]:
    """``quantize_blockwise`` of part of a matrix, with given tile amaxes (the whole matrix's, reduced over the shards).

    x as in ``block_amax_of_range``; each tile's scale comes from ``amax`` [ceil(rows / block_rows), ceil(cols /
    block_cols)] by ``quantize_blockwise``'s rule, and q = cast_fp8(clip(x * scale of its tile)). With amax the MAX
    of every shard's ``block_amax_of_range``, the shards' q laid side by side are ``quantize_blockwise`` of the
    matrix, bit for bit. Returns: (q [x.numel()] in ``fp8_dtype``, scale_inv float32 of amax's shape); x may be empty.
    """


@declare
def dequantize_blockwise(q: Tensor, scale_inv: Tensor, block_rows: int, block_cols: int, out_dtype: dtype) -> Tensor:
    """x[i, j] = q[i, j] * scale_inv[i // block_rows, j // block_cols], cast to ``out_dtype``."""


@declare(key="amax_history")
def delayed_scaling_update(amax_history: Tensor, scale: Tensor, fp8_max: float, margin: float,
                           amax_compute_algo: str) -> Tuple[Tensor, Tensor]:
    """One delayed-scaling step for N tensors (TE's recipe contract).

    H = amax_history [L, N] whose row 0 holds this step's amaxes; s = scale [N].
    amax = max over all L rows ("max") or H[0] ("most_recent"), taken before the roll;
    s_new = (fp8_max / amax) / 2^margin where amax is finite and > 0, else the old s;
    an infinite s_new (tiny amax) becomes float32 max;
    H_new = roll(H, -1, dim 0) with row 0 zeroed.
    Args: fp8_max: float or float32 [N] (a float when traced by torch.compile); margin: float;
    amax_compute_algo: "max" or "most_recent".
    Returns: (H_new [L, N], s_new [N]), both new float32 tensors.
    """


@declare(key="amax_history", inplace=True, mutates=("amax_history", "scale", "scale_inv"))
def delayed_scaling_update_(amax_history: Tensor, scale: Tensor, scale_inv: Tensor, fp8_max: float, margin: float,
                            amax_compute_algo: str, amax: Optional[Tensor] = None) -> None:
    """``delayed_scaling_update`` in place on the columns that were cast this step, plus scale_inv.

    With ``amax`` [K], first H[0, :K] = max(H[0, :K], amax) (torch.maximum: NaN from either side);
    active[n] = H[0, n] != 0 (NaN counts as active); (H_new, s_new) = delayed_scaling_update(H, s, ...);
    H[:, n], s[n] = H_new[:, n], s_new[n] where active[n], else unchanged;  scale_inv = 1 / s (all n).
    Args: amax_history H float32 [L, N], scale s float32 [N], scale_inv float32 [N] (all on one device,
    any strides, updated in place); fp8_max, margin, amax_compute_algo as in ``delayed_scaling_update``
    (fp8_max a float when traced by torch.compile, whose custom op takes no tensor for it); amax: None or
    float32 [K], 0 < K <= N, on that device: this step's amaxes of columns 0..K-1 not yet recorded in H[0]
    (read only; columns K.. have none).
    Returns: None. Bit-identical to the fold, delayed_scaling_update, two ``where`` and ``reciprocal``.
    """


@declare(key="amax_histories", inplace=True)
def delayed_scaling_update_many_(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo):
    """``delayed_scaling_update_`` of several states in one call (one launch where the backend can).

    (H_i, s_i, scale_inv_i) = delayed_scaling_update_ applied in place to (amax_histories[i], scales[i],
    scale_invs[i]) with fp8_max, margin and amax_compute_algo, for every i; the states may differ in L and
    N and have any strides, and must not overlap.
    Args: three equally long lists of float32 tensors on one device, as ``delayed_scaling_update_``
    takes them; fp8_max: one float for all states; margin, amax_compute_algo as there.
    Returns: None. Bit-identical to the single-state op applied to each state: the delayed-scaling
    update of a step's modules without copying their states side by side and back.
    """
