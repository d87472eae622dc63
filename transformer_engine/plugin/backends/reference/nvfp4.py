"""Reference (pure PyTorch) NVFP4 ops. See plugin/catalog/nvfp4.py for the contract and the math.

Per copy (x2d [R, C], its amax), each step one float32 operation in TE's order
(``custom_recipes/quantization_nvfp4.py``, ``cast/nvfp4/core_nvfp4.cuh``):

    S_enc = min(2688 / amax, fp32_max) (1 for amax = 0 or inf),  S_dec = 1 / S_enc
    s     = cast_e4m3(min((b_amax / 6) * S_enc, 448)),  enc = min(1 / (s * S_dec), fp32_max)
    q     = e2m1(clip(x * enc, -6, 6)),  x_hat = q * ((s * amax) * fp32(1 / 2688))

E2M1 rounding compares |y| with the seven midpoints of the grid (a tie goes to the even code, as
``cvt.rn``); stochastic rounding draws counter-based bits (lowbias32 hash, see the catalog) so that
every device gives the same result for a seed. The RHT runs in float64 (exact for 16 terms of
comparable size) and is rounded once to x's dtype. 4over6 casts each copy twice (map-to-6: s as above,
map-to-4: its scale before the E4M3 cast times 1.5, both under the bound ``e4m3_max``: 2688 = 6 * 448 above
becomes 6 * e4m3_max) and keeps per block the candidate ``_nvfp4_4over6`` picks. ``gemm_nvfp4`` dequantizes
both operands to float32 and runs the reference float32 GEMM.
"""

from __future__ import annotations

import struct
from typing import Optional, Tuple

import torch

from .._fp8 import check_out_dtype
from .._nvfp4_checks import NVFP4_BLOCK, check_gemm_nvfp4, check_nvfp4_operand, check_quantize_nvfp4
from ._nvfp4_4over6 import block_errors, keep_map_to_4
from .gemm import gemm

__all__ = ["quantize_nvfp4", "dequantize_nvfp4", "gemm_nvfp4"]

#: elements per NVFP4 block, also the RHT size and the 2-D tile side
BLOCK = NVFP4_BLOCK
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: E2M1 magnitudes by code 0..7 (code 8 + k is -E2M1_VALUES[k])
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: (midpoint between codes k and k + 1, whether a tie rounds up): ties go to the even code
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E2M1_NAN_CODE = 7  # NaN -> +6 (cuda_fp4.h: "NaN input values result in positive MAXNORM")
#: TE's fixed RHT signs (``get_wgrad_sign_vector``; sign mask 0xD7E8)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_FP32_MAX = torch.finfo(torch.float32).max
#: map-to-4's expansion of the block scale under 4over6 (E2M1's 4 then reaches what 6 reaches in map-to-6)
MAP_TO_4 = 1.5


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


#: fp32(1 / (6 * e4m3_max)) by the global scale's bound, TE's factor_inv (2688 = 6 * 448, 1536 = 6 * 256)
_DECODE_FACTORS = {bound: _fp32(1.0 / (E2M1_MAX * bound)) for bound in (448, 256)}
_U32 = 0xFFFFFFFF


# -- scales ----------------------------------------------------------------------------------------
def amax_ignoring_nan(t: torch.Tensor, dims=None) -> torch.Tensor:
    """max |t| (over ``dims``, all by default) in float32, NaN ignored and +-inf counted (TE's fmaxf); 0 if empty."""
    if dims is None and t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    magnitude = t.detach().float().abs()
    magnitude = torch.where(torch.isnan(magnitude), 0.0, magnitude)
    return magnitude.amax() if dims is None else magnitude.amax(dim=dims)


def global_encode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """S_enc = min(fp32((6 * e4m3_max) / amax), fp32_max), 1 where amax = 0 or S_enc = 0 (TE's
    ``compute_global_encode_scaling_factor_FP4``; 6 * e4m3_max is 2688, or 1536 under 4over6's bound 256)."""
    s_enc = (torch.full_like(amax, E2M1_MAX * e4m3_max) / amax).clamp(max=_FP32_MAX)
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def block_scale_e4m3(block_amax: torch.Tensor, s_enc: torch.Tensor, expand: float = 1.0) -> torch.Tensor:
    """s = cast_e4m3(min(fp32(fp32(b_amax / 6) * S_enc) [* expand], 448)) as uint8 bits (round to nearest even,
    saturating); ``expand`` 1.5 gives 4over6's map-to-4 scale (one more float32 product).

    The divisor is a tensor: PyTorch's CUDA division by a Python scalar multiplies by its rounded reciprocal.
    """
    s_dec_b = (block_amax / torch.full_like(block_amax, E2M1_MAX)) * s_enc
    if expand != 1.0:
        s_dec_b = s_dec_b * expand
    return s_dec_b.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(scale: torch.Tensor) -> torch.Tensor:
    """The float32 value of uint8 E4M3 bits."""
    return scale.view(torch.float8_e4m3fn).float()


def _block_amax(blocks: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """b_amax [R, C / 16] of blocks [R, C / 16, 16]; with ``block_2d`` each 16 x 16 tile's, repeated on its rows."""
    if not block_2d:
        return amax_ignoring_nan(blocks, dims=-1)
    rows, cols, _ = blocks.shape
    tiles = blocks.reshape(rows // BLOCK, BLOCK, cols, BLOCK)
    return amax_ignoring_nan(tiles, dims=(1, 3)).repeat_interleave(BLOCK, dim=0)


# -- E2M1 ------------------------------------------------------------------------------------------
def e2m1_codes_nearest(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 of |y| <= 6 rounded to the nearest E2M1 value, ties to the even code (NaN -> 0)."""
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        code += (magnitude >= midpoint) if tie_up else (magnitude > midpoint)
    return code


def e2m1_codes_stochastic(magnitude: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Magnitude codes of |y| <= 6 rounded up from lo to hi iff (bits >> 8) < ((|y| - lo) / (hi - lo)) * 2^24."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=magnitude.device)
    lo_code = sum((magnitude >= v).to(torch.uint8) for v in E2M1_VALUES[1:])  # the largest value <= |y|
    lo = values[lo_code.long()]
    step = values[(lo_code + 1).clamp(max=7).long()] - lo  # 0 at 6: never rounds up
    fraction = torch.where(step > 0, (magnitude - lo) / torch.where(step > 0, step, 1.0), 0.0)
    round_up = (bits >> 8).float() < fraction * 2.0**24
    return lo_code + round_up.to(torch.uint8)


def _e2m1_signed_codes(y: torch.Tensor, bits: Optional[torch.Tensor]) -> torch.Tensor:
    """E2M1 codes (sign << 3 | magnitude code) of y after saturation to +-6; NaN -> +6, -0 keeps its sign."""
    magnitude = y.abs().clamp(max=E2M1_MAX)
    code = e2m1_codes_nearest(magnitude) if bits is None else e2m1_codes_stochastic(magnitude, bits)
    code = code | (torch.signbit(y).to(torch.uint8) << 3)
    return torch.where(torch.isnan(y), _E2M1_NAN_CODE, code).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C / 2] from codes [R, C]: element 2j in the low nibble, 2j + 1 in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes 0..15 (any shape; code 8 is -0)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return torch.cat((magnitudes, -magnitudes))[codes.long()]


def decode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """float32 [R, 2 C] values of packed uint8 [R, C] (low nibble first)."""
    return e2m1_values(torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], 2 * q.shape[1]))


# -- stochastic rounding bits ----------------------------------------------------------------------
def _mul_u32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), in 16-bit halves so that no int64 product overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _U32


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of [0, 2^32) with good avalanche (int64 tensors holding uint32 values)."""
    x = x ^ (x >> 16)
    x = _mul_u32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul_u32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: torch.Tensor, copy: int, shape: Tuple[int, int], device: torch.device) -> torch.Tensor:
    """32 random bits (int64) per element of a copy: h(i ^ h(seed_lo ^ h(seed_hi ^ copy))), i row-major mod 2^32."""
    seed = seed.detach().reshape(()).to(device=device, dtype=torch.int64)
    key = hash_u32((seed & _U32) ^ hash_u32(((seed >> 32) & _U32) ^ copy))
    index = torch.arange(shape[0] * shape[1], dtype=torch.int64, device=device).reshape(shape)
    return hash_u32((index & _U32) ^ key)


# -- random Hadamard transform ---------------------------------------------------------------------
def rht_matrix(device=None) -> torch.Tensor:
    """R = diag(RHT_SIGNS) @ H16 / 4 in float64 (orthogonal; H[i, j] = (-1)^popcount(i & j), Sylvester's)."""
    index = torch.arange(BLOCK, device=device)
    parity = torch.zeros(BLOCK, BLOCK, dtype=torch.int64, device=device)
    for bit in range(4):
        parity ^= ((index[:, None] & index[None, :]) >> bit) & 1
    hadamard = 1.0 - 2.0 * parity.double()
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64, device=device)
    return signs[:, None] * hadamard / 4.0


def rht_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Each 16 consecutive elements v of a row of x2d [R, C] mapped to v @ R, in float64, rounded to x2d's dtype."""
    rows, cols = x2d.shape
    blocks = x2d.double().reshape(rows, cols // BLOCK, BLOCK)
    return (blocks @ rht_matrix(x2d.device)).reshape(rows, cols).to(x2d.dtype)


# -- quantize --------------------------------------------------------------------------------------
def _encode(blocks: torch.Tensor, scale: torch.Tensor, s_dec: torch.Tensor, bits: Optional[torch.Tensor]) -> torch.Tensor:
    """E2M1 codes [R, C] of blocks [R, C / 16, 16] under their scales: e2m1(x * min(1 / (s * S_dec), fp32_max))."""
    rows, n_blocks, _ = blocks.shape
    enc = torch.reciprocal(decode_e4m3(scale) * s_dec).clamp(max=_FP32_MAX)
    return _e2m1_signed_codes((blocks * enc.unsqueeze(-1)).reshape(rows, n_blocks * BLOCK), bits)


def _four_over_six(blocks: torch.Tensor, block_amax: torch.Tensor, amax: torch.Tensor, s_enc: torch.Tensor, *,
                   block_2d: bool, mode: str, e4m3_max: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes [R, C], scale uint8 [R, C / 16]): per block the map-to-4 or the map-to-6 candidate, whichever
    ``keep_map_to_4`` picks from their errors (module docstring)."""
    s_dec = torch.reciprocal(s_enc)
    candidates = []
    for expand in (MAP_TO_4, 1.0):
        scale = block_scale_e4m3(block_amax, s_enc, expand)
        codes = _encode(blocks, scale, s_dec, None)
        error = block_errors(blocks, e2m1_values(codes).reshape(blocks.shape), decode_e4m3(scale), amax, e4m3_max, mode)
        candidates.append((codes, scale, error))
    (codes_4, scale_4, error_4), (codes_6, scale_6, error_6) = candidates
    map_to_4 = keep_map_to_4(error_4, error_6, block_2d)
    codes = torch.where(map_to_4.repeat_interleave(BLOCK, dim=1), codes_4, codes_6)
    return codes, torch.where(map_to_4, scale_4, scale_6)


def _quantize_copy(x2d: torch.Tensor, amax: torch.Tensor, block_2d: bool, bits: Optional[torch.Tensor],
                   four_over_six: Optional[str] = None, e4m3_max: int = 448) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [R, C / 2], scale uint8 [R, C / 16]): the NVFP4 copy of x2d [R, C] with its amax (0-d float32)."""
    rows, cols = x2d.shape
    s_enc = global_encode_scale(amax, e4m3_max)
    blocks = x2d.float().reshape(rows, cols // BLOCK, BLOCK)
    block_amax = _block_amax(blocks, block_2d)
    if four_over_six is not None:
        codes, scale = _four_over_six(blocks, block_amax, amax, s_enc, block_2d=block_2d, mode=four_over_six, e4m3_max=e4m3_max)
        return pack_e2m1(codes), scale
    scale = block_scale_e4m3(block_amax, s_enc)
    return pack_e2m1(_encode(blocks, scale, torch.reciprocal(s_enc), bits)), scale


def quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed=None, four_over_six=None, e4m3_max=448):
    """NVFP4 cast of x [M, N] into its row-wise copy (blocks along N) and/or column-wise copy (x^T or RHT(x^T)),
    with 4over6's choice per block when ``four_over_six`` is "MAE" or "MSE" (global scale bound ``e4m3_max``).

    Returns:
        (data uint8 [M, N / 2], scale uint8 [M, N / 16], amax float32 [1], data_t uint8 [N, M / 2],
        scale_t uint8 [N, M / 16], amax_t float32 [1]), three Nones for a copy not asked for.

    Raises:
        TypeError: x is not a float32/bfloat16/float16 tensor, a flag is not a bool, seed is not int64.
        ValueError: x not 2-D, neither copy asked for, a dim not divisible by 16, a seed missing or unwanted,
            another four_over_six or e4m3_max, e4m3_max 256 without 4over6, 4over6 with rht or stochastic rounding.

    Example (one block: 6 -> code 7, -3 -> code 0xD, 0.75 -> 1.0 (tie to even), scale 448 = 0x7E):

    >>> x = torch.tensor([[6.0, -3.0, 0.75, 0.0] + [0.0] * 12])
    >>> data, scale, amax, _, _, _ = quantize_nvfp4(x, True, False, False, False, False)
    >>> [hex(b) for b in data[0, :2].tolist()], hex(scale.item()), amax.tolist()
    (['0xd7', '0x2'], '0x7e', [6.0])
    """
    check_quantize_nvfp4(x, rowwise, columnwise, block_2d, rht, stochastic_rounding, seed, four_over_six, e4m3_max)
    row = col = (None, None, None)
    if rowwise:
        amax = amax_ignoring_nan(x)
        bits = random_bits(seed, 0, tuple(x.shape), x.device) if stochastic_rounding else None
        row = (*_quantize_copy(x, amax, block_2d, bits, four_over_six, e4m3_max), amax.reshape(1))
    if columnwise:
        x_t = rht_rows(x.t()) if rht else x.t()
        amax_t = amax_ignoring_nan(x_t)
        bits = random_bits(seed, 1, tuple(x_t.shape), x.device) if stochastic_rounding else None
        col = (*_quantize_copy(x_t, amax_t, block_2d, bits, four_over_six, e4m3_max), amax_t.reshape(1))
    return (*row, *col)


# -- dequantize and GEMM ---------------------------------------------------------------------------
def _dequantize_f32(q: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """x = e2m1(q) * fp32(fp32(s * amax) * fp32(1 / (6 * e4m3_max))) in float32 (TE's dequantize kernel)."""
    m, k = q.shape[0], 2 * q.shape[1]
    block_scale = (decode_e4m3(scale) * amax.detach().reshape(()).to(scale.device)) * _DECODE_FACTORS[e4m3_max]
    blocks = decode_e2m1(q).reshape(m, k // BLOCK, BLOCK) * block_scale.unsqueeze(-1)
    return blocks.reshape(m, k)


def dequantize_nvfp4(q, scale, amax, out_dtype, e4m3_max=448):
    """x[i, j] = e2m1(q)[i, j] * ((e4m3(scale[i, j // 16]) * amax) * fp32(1 / (6 * e4m3_max))), float32, cast to ``out_dtype``.

    Raises:
        TypeError: q or scale not uint8, amax not float32. ValueError: shapes that do not fit, a bad out_dtype,
        e4m3_max other than 448 or 256.
    """
    check_nvfp4_operand(q, scale, amax, "q", e4m3_max)
    check_out_dtype(out_dtype)
    return _dequantize_f32(q, scale, amax, e4m3_max).to(out_dtype)


def gemm_nvfp4(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias=None, out=None, accumulate=False, a_e4m3_max=448,
               b_e4m3_max=448):
    """D = A @ B^T + bias (+ out when ``accumulate``) on the dequantized NVFP4 operands (each with its E4M3 bound), in float32.

    Raises:
        TypeError / ValueError: as :func:`dequantize_nvfp4` for either operand; K that differ, a bad
        bias / out, accumulate without out (see the reference ``gemm``).
    """
    check_gemm_nvfp4(a, b, a_scale, b_scale, a_amax, b_amax, out_dtype, bias, out, accumulate, a_e4m3_max, b_e4m3_max)
    return gemm(_dequantize_f32(a, a_scale, a_amax, a_e4m3_max), _dequantize_f32(b, b_scale, b_amax, b_e4m3_max), bias=bias,
                trans_b=True, out_dtype=out_dtype, out=out, accumulate=accumulate)
