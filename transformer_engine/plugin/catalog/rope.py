"""Rotary position embedding (RoPE), forward and backward.

freqs: float32 [s, 1, 1, d_rot] (from ``RotaryPositionEmbedding``); only the first d_rot features of
the head dim are rotated, the rest pass through. With c = cos(freqs), s = sin(freqs) at each
token's position (its index in the sequence, plus ``start_positions[b]`` when given):
- non-interleaved: out = x * c + rotate_half(x) * s, rotate_half([x1, x2]) = [-x2, x1] (halves);
- interleaved: pairs (x_{2i}, x_{2i+1}) rotate to (x_{2i} c - x_{2i+1} s, x_{2i+1} c + x_{2i} s).
The backward applies the inverse rotation (s -> -s) to the output gradient.
``tensor_format`` is "sbhd", "bshd" or "thd" (packed, positions restart at each ``cu_seqlens``
boundary); ``cp_size``/``cp_rank`` select this rank's chunks under context parallelism (sequence
split into 2 * cp_size chunks, rank r holding chunks r and 2 * cp_size - 1 - r).

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): empty tensors (zero batch or heads)
give empty results; NaN and inf propagate
through the rotation as in float32 math; t may have any strides (an sbhd view of a bshd tensor).
"""

from __future__ import annotations

from typing import Optional

from transformer_engine.plugin.core.catalog import Tensor, declare


@declare
def fused_rope_forward(t: Tensor, freqs: Tensor, tensor_format: str = "sbhd", interleaved: bool = False,
                       start_positions: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None, cp_size: int = 1,
                       cp_rank: int = 0) -> Tensor:
    """out = rope(t, freqs); same shape and dtype as t."""


@declare
def fused_rope_backward(grad_out: Tensor, freqs: Tensor, tensor_format: str = "sbhd", interleaved: bool = False,
                        start_positions: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None, cp_size: int = 1,
                        cp_rank: int = 0) -> Tensor:
    """grad_t = rope^-1(grad_out, freqs)."""
