"""Head-count checks of the attention constructors (DotProductAttention, MultiheadAttention, TransformerLayer).

Rules (NVIDIA TE's, stated up front instead of surfacing as a ``ZeroDivisionError`` or as silently
narrower projections):

- ``num_attention_heads`` >= 1;
- ``num_gqa_groups`` (None = one per head) >= 1 and divides ``num_attention_heads``;
- ``tp_size`` divides both (each rank holds whole heads and whole groups);
- the head size is ``kv_channels`` when given (>= 1), else ``hidden_size // num_attention_heads``,
  and then ``hidden_size`` must be divisible by ``num_attention_heads``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from .._checks import check_sizes

__all__ = ["check_heads", "head_size", "check_kv_channels"]


def check_heads(owner: str, num_attention_heads, num_gqa_groups, tp_size: int = 1) -> int:
    """Check the head and group counts; returns the number of key/value groups.

    Raises:
        TypeError / ValueError: a count is not a positive integer, or the divisibility rules fail.
    """
    check_sizes(owner, num_attention_heads=num_attention_heads)
    groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
    if num_gqa_groups is not None:
        check_sizes(owner, num_gqa_groups=num_gqa_groups)
    if num_attention_heads % groups:
        raise ValueError(
            f"{owner}: num_gqa_groups={groups} must divide num_attention_heads={num_attention_heads} "
            "(each key/value group serves the same number of query heads)"
        )
    if groups % tp_size or num_attention_heads % tp_size:
        raise ValueError(
            f"{owner}: num_attention_heads={num_attention_heads} and num_gqa_groups={groups} must both be "
            f"multiples of tp_size={tp_size} (each tensor-parallel rank holds whole heads)"
        )
    return groups


def head_size(owner: str, hidden_size, num_attention_heads: int, kv_channels: Optional[int]) -> int:
    """``kv_channels`` if given, else ``hidden_size // num_attention_heads`` (which must divide exactly).

    Call after :func:`check_heads`. TE's rule: ``kv_channels=None`` (or 0, which TE treats as not given)
    means "derive it"; a negative value is an error.

    Raises:
        TypeError / ValueError: ``hidden_size`` is not a positive integer, ``kv_channels`` is negative,
            or ``hidden_size`` is not divisible by ``num_attention_heads`` without ``kv_channels``.
    """
    check_sizes(owner, hidden_size=hidden_size)
    if kv_channels is not None and kv_channels != 0:
        check_sizes(owner, kv_channels=kv_channels)
        return kv_channels
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"{owner}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads} "
            f"(the heads would cover only {hidden_size // num_attention_heads * num_attention_heads} of the "
            f"{hidden_size} features); choose a head count that divides hidden_size, or pass kv_channels=<head size>"
        )
    return hidden_size // num_attention_heads


def check_kv_channels(owner: str, kv_channels: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    """DotProductAttention's ``kv_channels``: one positive int, or (d_qk, d_v) of positive ints."""
    if isinstance(kv_channels, (tuple, list)):
        if len(kv_channels) != 2:
            raise ValueError(f"{owner}: kv_channels={kv_channels!r} must be an int or a pair (d_qk, d_v)")
        d_qk, d_v = kv_channels
    else:
        d_qk = d_v = kv_channels
    try:
        check_sizes(owner, d_qk=d_qk, d_v=d_v)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: kv_channels={kv_channels!r} must be a positive integer (the head size) "
                         "or a pair of them (d_qk, d_v)") from None
    return d_qk, d_v
