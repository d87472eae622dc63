"""Float64 oracles shared by the attention tests, written from TE's documented formulas (no library code).

- :func:`allowed_mask`: which keys each query sees (padding, causal, window, arbitrary mask, alignment);
- :func:`attention`: softmax(scale Q K^T + bias) V with GQA and softmax sinks;
- :func:`max_logit`: the largest attended score of each head (``return_max_logit``);
- :func:`rope_angles` / :func:`rotate`: rotary embedding, each feature pair turned by its angle.
"""

from __future__ import annotations

import torch


def allowed_mask(b, s_q, s_kv, mask_type, window, bottom_right, lens_q=None, lens_kv=None, arbitrary=None):
    """bool [b, 1, s_q, s_kv], True = attended, element by element from TE's rules."""
    lens_q = lens_q or [s_q] * b
    lens_kv = lens_kv or [s_kv] * b
    left, right = window
    if "causal" in mask_type:
        right = 0
    out = torch.zeros(b, 1, s_q, s_kv, dtype=torch.bool)
    for n in range(b):
        real_q, real_kv = (lens_q[n], lens_kv[n]) if "padding" in mask_type else (s_q, s_kv)
        off = real_kv - real_q if bottom_right else 0
        for i in range(s_q):
            for j in range(s_kv):
                ok = i < real_q and j < real_kv
                ok = ok and (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                ok = ok and (arbitrary is None or not bool(arbitrary[n, 0, i, j]))
                out[n, 0, i, j] = ok
    return out


def attention(q, k, v, allowed, scale, bias=None, alpha=None):
    """float64 O [b, s_q, h, d_v] of bshd inputs; ``bias`` post-scale [.., h|1, s_q, s_kv]; ``alpha`` [h] sink logits."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~allowed, float("-inf"))
    if alpha is not None:
        sink = alpha.double().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)[..., : allowed.shape[-1]]
    return torch.einsum("bhij,bjhd->bihd", p, v)


def max_logit(q, k, allowed, scale, bias=None):
    """float64 [h]: the largest attended score scale q_i . k_j (+ bias) of each head over the batch (-inf if none)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def rope_angles(positions, d_rot, base=10000.0):
    """float64 [n, d_rot / 2]: theta_k(p) = p * base^(-2k / d_rot)."""
    k = torch.arange(d_rot // 2, dtype=torch.float64)
    return torch.as_tensor(positions, dtype=torch.float64)[:, None] * base ** (-2 * k / d_rot)


def rotate(x, positions, d_rot, interleaved):
    """float64 oracle: each pair (a, b) of the first d_rot features turns by theta_k(position)."""
    x = x.double()
    theta = rope_angles(positions.reshape(-1), d_rot).reshape(*positions.shape, 1, d_rot // 2)
    if interleaved:
        a, b = x[..., 0:d_rot:2], x[..., 1:d_rot:2]
    else:
        a, b = x[..., : d_rot // 2], x[..., d_rot // 2 : d_rot]
    ra, rb = a * torch.cos(theta) - b * torch.sin(theta), b * torch.cos(theta) + a * torch.sin(theta)
    rotated = torch.stack([ra, rb], dim=-1).flatten(-2) if interleaved else torch.cat([ra, rb], dim=-1)
    return torch.cat([rotated, x[..., d_rot:]], dim=-1)
