"""TE's attention masks, sliding windows and ALiBi, turned into what the catalog's attention op takes.

TE names a mask by ``attn_mask_type`` (no_mask, padding, causal, padding_causal, causal_bottom_right,
padding_causal_bottom_right, arbitrary) plus a padding mask or ``cu_seqlens``, a ``window_size``
(left, right) and a diagonal alignment (``bottom_right_diagonal``). Query i may see key j when

    i + off - left <= j <= i + off + right        (a side of -1 is unbounded; causal is right = 0)

with off = 0 (top-left) or off = s_kv - s_q (bottom-right), where for padded batches s_q and s_kv are
each sequence's real lengths. ALiBi adds -slope_h * |i + off - j| to the scores.

The catalog op (``AttentionConfig``) knows top-left causal, bottom-right causal and bottom-right
windows / ALiBi over the tensor's (or, for "thd", each packed sequence's) lengths. What it cannot
say directly (padding in a padded batch, top-left windows when s_q != s_kv, an arbitrary mask) is
passed as one explicit bool ``attn_mask`` (True = masked out) or an explicit post-scale ALiBi bias.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

__all__ = [
    "ATTN_MASK_TYPES",
    "MaskSpec",
    "Padding",
    "MaskPlan",
    "canonical_mask_type",
    "check_set_window_size",
    "resolve_bottom_right",
    "padding_from_mask",
    "padding_from_lengths",
    "default_alibi_slopes",
    "plan_masks",
]

ATTN_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
Offset = Union[int, torch.Tensor]


def canonical_mask_type(attn_mask_type: str) -> str:
    """TE's spelling rules: "padding,causal", "causal,padding" and "causal_padding" mean "padding_causal".

    Raises:
        ValueError: not one of :data:`ATTN_MASK_TYPES` (after those aliases).
    """
    name = attn_mask_type.replace(",", "_")
    name = "padding_causal" if name == "causal_padding" else name
    if name not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {', '.join(ATTN_MASK_TYPES)}")
    return name


def check_set_window_size(mask_type: str, window_size: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """TE's window rule: causal types need (-1, 0) or (>=0, 0); the others (-1, -1) or (>=0, >=0).

    None becomes the type's default; a near miss ((-1, -1) for a causal type, (>=0, >0) for a causal
    type, (-1, 0) for a non-causal one) is corrected with a warning, as TE does.

    Raises:
        ValueError: a window that fits neither rule (e.g. (-2, 0) or (3, -1)).
    """
    causal = "causal" in mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    left, right = (int(w) for w in window_size)
    if causal:
        if (left, right) == (-1, -1) or (left >= 0 and right != 0):
            warnings.warn(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type}")
            return (left, 0)
        if right != 0 or left < -1:
            raise ValueError(f"window_size={window_size} must be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type}")
        return (left, 0)
    if (left, right) == (-1, 0):
        warnings.warn(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type}")
        return (-1, -1)
    if (left, right) != (-1, -1) and (left < 0 or right < 0):
        raise ValueError(f"window_size={window_size} must be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type}")
    return (left, right)


def resolve_bottom_right(mask_type: str, bottom_right_diagonal: Optional[bool]) -> bool:
    """False for causal / padding_causal, True for the *_bottom_right types, else the given value (default True)."""
    if mask_type in ("causal", "padding_causal"):
        return False
    if bottom_right_diagonal is None or mask_type.endswith("bottom_right"):
        return True
    return bool(bottom_right_diagonal)


@dataclass(frozen=True)
class MaskSpec:
    """One call's masking settings after TE's rules.

    Attributes:
        mask_type: canonical TE mask type.
        window_size: (left, right) after :func:`check_set_window_size` (causal types have right = 0).
        bottom_right: diagonal alignment of the window, the causal mask and ALiBi.
    """

    mask_type: str
    window_size: Tuple[int, int]
    bottom_right: bool

    @property
    def padded(self) -> bool:
        """True for the padding types."""
        return self.mask_type.startswith("padding")


@dataclass(frozen=True, eq=False)
class Padding:
    """Which tokens of a padded batch are real.

    Attributes:
        pad_q: bool [b, s_q], True = padding token.
        pad_kv: bool [b, s_kv].
        lens_q, lens_kv: int64 [b] real lengths (the diagonal offsets use them).
    """

    pad_q: torch.Tensor
    pad_kv: torch.Tensor
    lens_q: torch.Tensor
    lens_kv: torch.Tensor


def padding_from_mask(attention_mask, s_q: int, s_kv: int) -> Padding:
    """Padding from TE's bool masks: one [b, 1, 1, s] (self-attention) or a pair ([b,1,1,s_q], [b,1,1,s_kv]).

    Raises:
        ValueError: a mask that is not bool or whose length does not match the sequences.
    """
    mask_q, mask_kv = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask, attention_mask)
    pads = []
    for name, mask, length in (("query", mask_q, s_q), ("key/value", mask_kv, s_kv)):
        if mask.dtype != torch.bool or mask.shape[-1] != length or mask[0].numel() != length:
            raise ValueError(
                f"the {name} padding mask must be bool [b, 1, 1, {length}] (True = padding), got "
                f"{mask.dtype} {tuple(mask.shape)}; for cross-attention pass a (query, key/value) pair"
            )
        pads.append(mask.reshape(mask.shape[0], length))
    lens = [(~p).sum(dim=1) for p in pads]
    return Padding(pads[0], pads[1], lens[0], lens[1])


def padding_from_lengths(lens_q: torch.Tensor, lens_kv: torch.Tensor, s_q: int, s_kv: int) -> Padding:
    """Padding of right-padded sequences with real lengths ``lens_q`` / ``lens_kv`` ([b] each)."""
    lens_q, lens_kv = lens_q.long(), lens_kv.long()
    pad_q = torch.arange(s_q, device=lens_q.device)[None, :] >= lens_q[:, None]
    pad_kv = torch.arange(s_kv, device=lens_kv.device)[None, :] >= lens_kv[:, None]
    return Padding(pad_q, pad_kv, lens_q, lens_kv)


def default_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """TE's default ALiBi slopes (float32 [h]): m_k = 2^(-8k/n), k = 1..n, n = 2^floor(log2 h);
    the h - n extra heads take 2^(-4k/n) for odd k = 1, 3, ..."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, n + 1, dtype=torch.float64))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 2 * (num_heads - n), 2, dtype=torch.float64))
        slopes = torch.cat([slopes, extra])
    return slopes.to(dtype=torch.float32, device=device)


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """What the catalog op gets for one call.

    Attributes:
        mask_type: catalog mask type ("no_mask", "causal" or "causal_bottom_right").
        window_size: catalog window (bottom-right aligned over the catalog's lengths).
        attn_mask: explicit bool mask [b or 1, 1, s_q, s_kv] (True = masked out), or None.
        alibi_bias: explicit float32 ALiBi bias [b or 1, h, s_q, s_kv] to pass as a post-scale bias
            (None when the catalog's own ALiBi alignment is the wanted one).
    """

    mask_type: str
    window_size: Tuple[int, int]
    attn_mask: Optional[torch.Tensor]
    alibi_bias: Optional[torch.Tensor]


def _diagonal(s_q: int, offset: Offset, device) -> torch.Tensor:
    """i + off as [s_q, 1], or [b, s_q, 1] for per-sequence offsets [b]."""
    i = torch.arange(s_q, device=device)[:, None]
    return i + (offset.to(device)[:, None, None] if torch.is_tensor(offset) else offset)


def _band(s_q: int, s_kv: int, offset: Offset, window: Tuple[int, int], device) -> Optional[torch.Tensor]:
    """bool [b or 1, 1, s_q, s_kv]: True where j < i + off - left or j > i + off + right (None if unbounded)."""
    left, right = window
    diag, j = _diagonal(s_q, offset, device), torch.arange(s_kv, device=device)
    outside = [j < diag - left] if left >= 0 else []
    outside += [j > diag + right] if right >= 0 else []
    if not outside:
        return None
    masked = outside[0] if len(outside) == 1 else outside[0] | outside[1]
    return masked.reshape(-1, 1, s_q, s_kv)


def _alibi(slopes: torch.Tensor, s_q: int, s_kv: int, offset: Offset, device) -> torch.Tensor:
    """float32 [b or 1, h, s_q, s_kv]: -slope_h |i + off - j| (slopes [h] or [b, h])."""
    distance = (_diagonal(s_q, offset, device) - torch.arange(s_kv, device=device)).abs().float()
    h = slopes.shape[-1]
    return -slopes.float().to(device).reshape(-1, h, 1, 1) * distance.reshape(-1, 1, s_q, s_kv)


def _same(a: Offset, b: Offset) -> bool:
    if not torch.is_tensor(a) and not torch.is_tensor(b):
        return a == b
    return bool(torch.all(torch.as_tensor(a) == torch.as_tensor(b).to(torch.as_tensor(a).device)))


def _or(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None or b is None:
        return a if b is None else b
    return a | b.to(a.device)


def plan_masks(
    spec: MaskSpec,
    s_q: int,
    s_kv: int,
    padding: Optional[Padding],
    user_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    thd: bool,
    device,
) -> MaskPlan:
    """The catalog mask type, window and explicit tensors for one call (see the module docstring).

    Args:
        spec: the resolved TE settings.
        s_q, s_kv: the (padded) sequence lengths of the scores.
        padding: real tokens: for a padded "bshd" batch its padding; for "thd" the packed sequences'
            lengths (their catalog offsets); None when every token is real.
        user_mask: the "arbitrary" bool mask (broadcastable to [b, h, s_q, s_kv]) or None.
        alibi_slopes: ALiBi slopes when the bias type is "alibi", else None.
        thd: the catalog call is "thd" (lengths per packed sequence).
        device: where explicit tensors are built.

    Returns:
        The :class:`MaskPlan`.
    """
    lens_diff = None if padding is None else padding.lens_kv - padding.lens_q
    catalog_off: Offset = lens_diff if thd else s_kv - s_q
    wanted_off: Offset = 0
    if spec.bottom_right:
        wanted_off = lens_diff if lens_diff is not None else s_kv - s_q
    aligned = _same(catalog_off, wanted_off)
    left, right = spec.window_size
    causal = "causal" in spec.mask_type
    explicit = spec.mask_type == "arbitrary" or (spec.padded and not thd) or (left >= 0 and not aligned)
    alibi = None
    if alibi_slopes is not None and not aligned:
        alibi = _alibi(alibi_slopes, s_q, s_kv, wanted_off, device)
    if not explicit:
        mask_type = "no_mask"
        if causal:
            mask_type = "causal_bottom_right" if spec.bottom_right else "causal"
        window = (left, -1) if causal else (left, right)
        return MaskPlan(mask_type, window, None, alibi)
    masked = _band(s_q, s_kv, wanted_off, spec.window_size, device)
    if spec.padded and padding is not None:
        masked = _or(masked, (padding.pad_q[:, :, None] | padding.pad_kv[:, None, :])[:, None])
    if user_mask is not None:
        masked = _or(masked, user_mask.to(device=device, dtype=torch.bool))
    return MaskPlan("no_mask", (-1, -1), masked, alibi)
