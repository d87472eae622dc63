"""Reference (pure PyTorch) fused softmax family. See plugin/catalog/softmax.py for the contract.

Forward (float32, result in x's dtype):  y = softmax(scale * x + m, dim=-1), where m is
    0 (scaled), -10000 where ``mask`` is True (masked), or -inf where j > i (upper-triangular,
    top-left aligned) or j > i + sk - sq (aligned-causal, bottom-right aligned);
    a row whose every position is masked gives zeros.
Backward (every variant, float32, result in dy's dtype):  dx = scale * y * (dy - sum(dy * y, dim=-1)).

The masked variant sets masked scores to -10000 (as TE's kernel) rather than adding -10000 to
scale * x: both give the same y in float32 (exp(-10000 - max) underflows to 0 in either form),
and this one also ignores whatever value a masked position holds (inf included).
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.plugin.backends._checks import check_softmax_bwd, check_softmax_input, check_softmax_mask

__all__ = [
    "scaled_softmax_forward",
    "scaled_softmax_backward",
    "scaled_masked_softmax_forward",
    "scaled_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax_forward",
    "scaled_upper_triang_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax_forward",
    "scaled_aligned_causal_masked_softmax_backward",
]

_MASK_VALUE = -10000.0


def _softmax(x: torch.Tensor, scale: float, masked: Optional[torch.Tensor], fill: float) -> torch.Tensor:
    """softmax(scale * x, -1) with ``fill`` at masked positions; fully masked rows give 0; in x's dtype."""
    logits = x.float() * float(scale)
    if masked is None:
        return torch.softmax(logits, dim=-1).to(x.dtype)
    y = torch.softmax(logits.masked_fill(masked, fill), dim=-1)
    all_masked = masked.all(dim=-1, keepdim=True)
    return torch.where(all_masked, torch.zeros_like(y), y).to(x.dtype)


def _causal_mask(sq: int, sk: int, offset: int, device) -> torch.Tensor:
    """[sq, sk] boolean, True where j > i + offset."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j > i + offset


def _softmax_backward(dy, y, scale) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y, -1)) in float32, cast to dy's dtype."""
    check_softmax_bwd(dy, y)
    dy_f32, y_f32 = dy.float(), y.float()
    dx = float(scale) * y_f32 * (dy_f32 - (dy_f32 * y_f32).sum(dim=-1, keepdim=True))
    return dx.to(dy.dtype)


def scaled_softmax_forward(x, scale):
    """y = softmax(scale * x, dim=-1), computed in float32, in x's dtype."""
    check_softmax_input(x, None, "any shape")
    return _softmax(x, scale, None, 0.0)


def scaled_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _softmax_backward(dy, y, scale)


def scaled_masked_softmax_forward(x, mask, scale):
    """y = softmax(scale * x - 10000 * mask); x [b, h, sq, sk], mask [b or 1, 1, sq, sk], True = masked.

    Raises:
        ValueError: x not 4-D, or a mask that is not boolean [b or 1, 1, sq, sk].
    """
    check_softmax_input(x, 4, "[b, h, sq, sk]")
    check_softmax_mask(x, mask)
    return _softmax(x, scale, mask, _MASK_VALUE)


def scaled_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _softmax_backward(dy, y, scale)


def scaled_upper_triang_masked_softmax_forward(x, scale):
    """y = softmax(scale * x with x[.., i, j > i] = -inf); x is [b*h, sq, sk]."""
    check_softmax_input(x, 3, "[b*h, sq, sk]")
    return _softmax(x, scale, _causal_mask(x.shape[1], x.shape[2], 0, x.device), float("-inf"))


def scaled_upper_triang_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _softmax_backward(dy, y, scale)


def scaled_aligned_causal_masked_softmax_forward(x, scale):
    """y = softmax(scale * x with x[.., i, j > i + sk - sq] = -inf); x is [b, h, sq, sk]."""
    check_softmax_input(x, 4, "[b, h, sq, sk]")
    sq, sk = x.shape[2], x.shape[3]
    return _softmax(x, scale, _causal_mask(sq, sk, sk - sq, x.device), float("-inf"))


def scaled_aligned_causal_masked_softmax_backward(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y))."""
    return _softmax_backward(dy, y, scale)
