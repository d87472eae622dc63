"""Rotary position embedding (RoPE) of (b, s, h, d) (or (s, b, h, d)) query / key tensors.

With positions p = 0..s-1 and timescales t_i = min_w * (max_w / min_w)^(2i/d), i < d/2, each pair
(x1, x2) of coordinates is rotated by the angle p / t_i:

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)

"alternate" pairs coordinate i with i + d/2; "consecutive" pairs 2i with 2i + 1.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

__all__ = ["rotary_pos_emb"]

_GROUP_METHODS = ("consecutive", "alternate")


def rotary_pos_emb(x: jax.Array, windows: Tuple[int, int], transpose_batch_sequence: bool, group_method: str):
    """Apply RoPE along the sequence axis of ``x`` (see the module docstring), in x's dtype.

    Raises:
        ValueError: an unknown group method or an odd head dimension.
    """
    if group_method not in _GROUP_METHODS:
        raise ValueError(f"rotary_pos_emb_group_method must be one of {_GROUP_METHODS}, got {group_method!r}")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary position embedding needs an even head dimension, got {d}")
    min_w, max_w = windows
    seq_axis = 0 if transpose_batch_sequence else 1
    fraction = 2.0 * jnp.arange(d // 2, dtype=jnp.float32) / d
    timescale = min_w * (max_w / min_w) ** fraction
    angle = jnp.arange(x.shape[seq_axis], dtype=jnp.float32)[:, None] / timescale  # (s, d/2)
    angle = angle[:, None, None, :] if seq_axis == 0 else angle[None, :, None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x32 = x.astype(jnp.float32)
    if group_method == "alternate":
        x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)
