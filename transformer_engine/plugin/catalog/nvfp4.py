"""NVFP4 (NVIDIA TE's NVFP4BlockScaling): E2M1 values, one E4M3 scale per 16 elements, one float32 amax per tensor.

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign: code = sign << 3 | k for the k-th magnitude.
Two codes share a byte, the first element of each pair in the low nibble (TE's ``cvt.rn.satfinite.e2m1x2``
operand order). Each block of 16 consecutive elements along the last dim of x [R, C] (or each 16 x 16
tile with ``block_2d``, the rows of a tile sharing its scale) carries an E4M3 decode scale, stored as its
uint8 bit pattern; the tensor carries its float32 amax. Every step below is one float32 operation,
rounded to nearest even, in TE's order (``custom_recipes/quantization_nvfp4.py`` and the CUDA kernels):

    amax    = max |x| over the tensor, NaN ignored (TE's fmaxf), +-inf counted
    S_enc   = min(2688 / amax, fp32_max), 1 where amax = 0 or S_enc = 0 (amax = inf);  2688 = 448 * 6
    S_dec   = 1 / S_enc
    b_amax  = max |x| over the block or tile, NaN ignored
    s       = cast_e4m3(min((b_amax / 6) * S_enc, 448))        (round to nearest even, saturating)
    enc     = min(1 / (s * S_dec), fp32_max)                   (fp32_max for s = 0)
    q       = e2m1(clip(x * enc, -6, 6))                        (nearest, ties to the even code; NaN -> +6;
                                                                 -0 keeps its sign)
    x_hat   = q * ((s * amax) * fp32(1 / 2688))                 (TE's dequantize kernel)

Stochastic rounding replaces the nearest by one of the two neighbours lo <= |y| <= hi of y = x * enc:
hi with probability (|y| - lo) / (hi - lo), decided by r = bits >> 8 < ((|y| - lo) / (hi - lo)) * 2^24 with
32 random bits per element, bits = h(i ^ h(seed_lo ^ h(seed_hi ^ copy))): h is the lowbias32 integer hash
(x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, all mod 2^32), i the
row-major index of the element in its copy (mod 2^32), seed_lo / seed_hi the low / high 32 bits of the
int64 seed, copy 0 for the row-wise copy and 1 for the column-wise one. Counter-based, so every device
(and a Triton kernel) draws the same bits; TE draws Philox bits on the GPU instead (not reproducible here).

The random Hadamard transform (RHT) of a row v of 16 elements is v @ (D H16) / 4, with H16 the Sylvester
Hadamard matrix (H[i, j] = (-1)^popcount(i & j)) and D = diag(signs), TE's fixed signs
(+ + + - + - - - - - - + - + - -), sign mask 0xD7E8 (bit i set where sign i is -1). It is orthogonal, so
two copies transformed along the GEMM's K keep their product: (A R)(B R)^T = A B^T. Computed in float64
and rounded once to x's dtype (TE rounds its bfloat16 RHT output to bfloat16).

4over6 (``four_over_six`` "MAE" or "MSE"; NVIDIA TE's ``nvfp4_4over6``, ``quantize_4over6_nvfp4.cuh``) quantizes
every block (or 16 x 16 tile) twice and keeps the candidate with the smaller error in the input's domain:
map-to-6 is the rule above, map-to-4 expands the block scale by 1.5 so that E2M1's 4 reaches what 6 reaches
in map-to-6. The global scale's E4M3 bound ``e4m3_max`` (448, or 256 to leave the expanded scales room) sets
S_enc and the decode; every step is one float32 operation in TE's order:

    S_enc   = min((6 * e4m3_max) / amax, fp32_max), 1 where amax = 0 or S_enc = 0;  S_dec = 1 / S_enc
    base    = (b_amax / 6) * S_enc
    s_6     = cast_e4m3(min(base, 448)),  s_4 = cast_e4m3(min(base * 1.5, 448))
    q_c     = e2m1(clip(x * enc_c, -6, 6)),  enc_c = min(1 / (s_c * S_dec), fp32_max)      (c = 4, 6)
    d_c[i]  = (((e2m1(q_c[i]) * s_c) * amax) / (6 * e4m3_max)) - x[i];  e = |d| (MAE) or d * d (MSE)
    err_c   = ((e_c[0] + e_c[1]) + e_c[2]) + ... + e_c[15]                (the block's 16, in element order)
    2-D:      err_c of a tile from its 16 row errors r_0..r_15 in TE's warp-shuffle tree:
              a_i = r_i + r_(i+8), b_i = a_i + a_(i+4), c_i = b_i + b_(i+2), err_c = c_0 + c_1
    keep      map-to-4 iff err_4 < err_6 (a tie or a NaN error keeps map-to-6)
    x_hat   = q * ((s * amax) * fp32(1 / (6 * e4m3_max)))

The column-wise copy is the same rule on x^T (a tile's "rows" are then x's columns, so with ``block_2d`` the
two copies' choices may differ where float32 sums in the two orders do). Without 4over6 ``e4m3_max`` must be
448; 4over6 refuses the RHT and stochastic rounding (as TE). TE's opt-in float16 error
(``NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH``) is not offered.

Alignment: the row-wise copy needs C % 16 == 0, the column-wise copy R % 16 == 0, ``block_2d`` both
(TE's NVFP4Quantizer asks both of every tensor; its fused kernels 32, and RHT only for bfloat16 input).

Example (6 -> code 7, -3 -> 0xD, 0.75 -> 1.0 (a tie, to the even code 2); the block holding the amax
always gets scale 448 = E4M3 0x7E):

>>> import torch
>>> from transformer_engine.plugin import ops
>>> x = torch.tensor([[6.0, -3.0, 0.75, 0.0] + [0.0] * 12])
>>> data, scale, amax, _, _, _ = ops.quantize_nvfp4(x, True, False, False, False, False, None)
>>> [hex(b) for b in data[0, :2].tolist()], hex(scale.item()), amax.tolist()
(['0xd7', '0x2'], '0x7e', [6.0])
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype

#: the error modes of 4over6 (NVIDIA TE's ``nvfp4_4over6_err_mode``)
FOUR_OVER_SIX_MODES = ("MAE", "MSE")
#: the global scale's E4M3 bounds (TE's ``nvfp4_e4m3_max``): 448, or 256 under 4over6
E4M3_BOUNDS = (448, 256)


def check_e4m3_max(e4m3_max, name: str = "e4m3_max") -> None:
    """ValueError unless ``e4m3_max`` is 448 or 256 (an int, not a bool)."""
    if isinstance(e4m3_max, bool) or e4m3_max not in E4M3_BOUNDS:
        raise ValueError(f"{name}={e4m3_max!r}: the NVFP4 global scale's E4M3 bound is 448, or 256 under 4over6")


def check_four_over_six(four_over_six: Optional[str], e4m3_max, *, rht: bool, stochastic_rounding: bool) -> None:
    """ValueError unless the 4over6 settings of an NVFP4 cast are ones NVIDIA TE runs (the rule of ``quantize_nvfp4``,
    checked by its implementations and, before any work, by the quantizers that will call it): ``four_over_six``
    None, "MAE" or "MSE"; ``e4m3_max`` 448, or 256 with 4over6; 4over6 neither with the RHT nor with stochastic
    rounding."""
    if four_over_six is not None and four_over_six not in FOUR_OVER_SIX_MODES:
        raise ValueError(f"four_over_six={four_over_six!r}: pass None (off), or the 4over6 error mode 'MAE' or 'MSE'")
    check_e4m3_max(e4m3_max)
    if four_over_six is None:
        if e4m3_max != 448:
            raise ValueError(f"e4m3_max={e4m3_max} without 4over6: NVFP4 quantization without 4over6 uses the E4M3 bound 448 "
                             "(as NVIDIA TE); pass e4m3_max=448, or four_over_six='MAE' / 'MSE'")
        return
    for on, what in ((rht, "rht=True (the random Hadamard transform)"), (stochastic_rounding, "stochastic_rounding=True")):
        if on:
            raise ValueError(f"four_over_six={four_over_six!r} with {what}: NVFP4 4over6 quantization does not support it "
                             "(as NVIDIA TE); quantize this tensor without one of the two")


@declare
def quantize_nvfp4(x: Tensor, rowwise: bool, columnwise: bool, block_2d: bool, rht: bool, stochastic_rounding: bool,
                   seed: Optional[Tensor] = None, four_over_six: Optional[str] = None, e4m3_max: int = 448) -> Tuple[Optional[Tensor],
                                                                                                                     Optional[Tensor],
                                                                                                                     Optional[Tensor],
                                                                                                                     Optional[Tensor],
                                                                                                                     Optional[Tensor],
                                                                                                                     Optional[Tensor]]:
    """NVFP4 cast of a 2-D tensor into its row-wise and/or column-wise copies (math in the module docstring).

    (data, scale, amax) = blocks of 16 along the rows of x; (data_t, scale_t, amax_t) = blocks of 16
    along the rows of x_t = x^T, or of RHT(x^T) with ``rht`` (its amax is then the amax of RHT(x^T)).
    Args: x: [M, N] float32/bfloat16/float16; rowwise, columnwise: which copies to write (at least one);
    block_2d: 16 x 16 tiles (weights: the two copies' scales are then transposes of each other, but for
    4over6's choices, see the module docstring);
    rht: the random Hadamard transform on the column-wise copy (inputs and gradients, for wgrad);
    stochastic_rounding: round each element to a random neighbour (gradients); seed: its one-element
    int64 tensor (required with stochastic rounding, refused without; draw a fresh one per call);
    four_over_six: None, or "MAE" / "MSE": 4over6 choosing each block's candidate by that error;
    e4m3_max: the global scale's E4M3 bound, 448, or 256 (4over6 only).
    Returns: (data uint8 [M, N / 2], scale uint8 [M, N / 16] (E4M3 bits), amax float32 [1], data_t uint8
    [N, M / 2], scale_t uint8 [N, M / 16], amax_t float32 [1]); the copy not asked for is three Nones.
    Scales are compact (TE pads them to [roundup(rows, 128), roundup(cols / 16, 4)]).
    Raises ValueError when N % 16 (row-wise or 2-D) or M % 16 (column-wise or 2-D) != 0, for another
    four_over_six or e4m3_max, e4m3_max 256 without 4over6, and 4over6 with rht or stochastic_rounding.
    """


@declare
def dequantize_nvfp4(q: Tensor, scale: Tensor, amax: Tensor, out_dtype: dtype, e4m3_max: int = 448) -> Tensor:
    """x[i, j] = e2m1(q)[i, j] * ((e4m3(scale[i, j // 16]) * amax) * fp32(1 / (6 * e4m3_max))), float32, cast to ``out_dtype``.

    Args: q: uint8 [M, K / 2] (two E2M1 codes a byte, low nibble first); scale: uint8 [M, K / 16] (E4M3
    bits); amax: the copy's float32 amax, one element; e4m3_max: the bound it was quantized with (448, or
    256 under 4over6). Returns: x [M, K].
    """


@declare(mutates=("out",))
def gemm_nvfp4(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, a_amax: Tensor, b_amax: Tensor, out_dtype: dtype,
               bias: Optional[Tensor] = None, out: Optional[Tensor] = None, accumulate: bool = False, a_e4m3_max: int = 448,
               b_e4m3_max: int = 448) -> Tensor:
    """D = A @ B^T + bias on NVFP4 operands, both read along K ("TN").

    A = dequantize_nvfp4(a, a_scale, a_amax, e4m3_max=a_e4m3_max), B likewise with b's; the product
    accumulates in float32, bias ([N]) is added in float32, then one cast to ``out_dtype``. With
    ``accumulate`` D = out + A @ B^T + bias (``out`` required), returned as ``out``.
    Args: a: uint8 [M, K / 2], b: uint8 [N, K / 2], K % 16 == 0; a_scale uint8 [M, K / 16], b_scale uint8
    [N, K / 16]; a_amax, b_amax: one-element float32; a_e4m3_max, b_e4m3_max: each operand's global scale
    bound (448, or 256 under 4over6). Linear layers use: fprop y = gemm_nvfp4(x, W);
    dgrad dx = gemm_nvfp4(dy, W^T); wgrad dW = gemm_nvfp4(dy^T, x^T), each operand the copy quantized
    along K (wgrad's two with the RHT). Returns: D [M, N].
    """
