"""The MoE router functions of TE's ``transformer_engine.pytorch.router``, in plain PyTorch.

For logits x [..., E] (E experts), every score is computed in float32 whatever x's dtype:

    softmax        s = softmax(x)
    sigmoid        s = 1 / (1 + exp(-x))
    sqrtsoftplus   s = sqrt(softplus(x)),  softplus(x) = log(1 + exp(x))  (= x where x > 20)

Top-k routing picks k experts per token on routing scores r and weighs them:

    softmax, pre (use_pre_softmax)   r = s,      p_i = s_i                                (i in top-k)
    softmax, post                    r = x,      p_i = exp(x_i) / sum_{j in top-k} exp(x_j)
    sigmoid / sqrtsoftplus           r = s + b,  p_i = s_i / (sum_{j in top-k} s_j + 1e-20)  (k > 1)
                                                 p_i = s_i                                 (k = 1)

then probs = scaling_factor * p scattered into a dense [..., E] tensor (zero off the top-k), returned
in x's dtype with a bool routing map. The expert bias b only steers the choice, it never enters p.
Group-limited top-k splits E into ``num_groups`` equal groups, scores each group by the sum of its
top (k / group_topk) routing scores, keeps the best ``group_topk`` groups and picks the top k among
their experts. Ties go to the lower expert index (a stable descending sort).

Gradients flow to ``logits`` (and to ``probs`` in the aux loss) only; routing maps and indices are not
differentiable, and neither ``expert_bias`` nor ``tokens_per_expert`` receive a gradient. The VJPs are
the autograd of the float32 compositions below, rounded once to the input's dtype.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = [
    "RoutingMapFormat",
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
]

_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_ROUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
_TOKENS_PER_EXPERT_DTYPES = (torch.int16, torch.int32, torch.int64, torch.float32, torch.bfloat16)
_EPSILON = 1e-20  # keeps s / sum(s) finite when every selected score underflows
_SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it, as in TE's kernels


class RoutingMapFormat(enum.IntEnum):
    """Layout of a routing map: ``BYTEMAP`` bool[..., E]; ``BITMAP_U8`` uint8[..., ceil(E / 8)] with
    bit (e % 8) of byte (e // 8) set when the token routes to expert e (LSB first)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


# ----------------------------------------------------------------------------------------------
# Argument checks (plain integer and dtype comparisons, run before any tensor work)
# ----------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor) -> int:
    """Return E, the number of experts, after checking the logits' rank and dtype."""
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., num_experts] with num_experts >= 1, got {tuple(logits.shape)}")
    if logits.dtype not in _ROUTER_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not supported; use float32, bfloat16 or float16")
    return logits.shape[-1]


def _check_score_function(score_function: str) -> None:
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r} is unknown; use one of {_SCORE_FUNCTIONS}")


def _check_topk(topk: int, num_experts: int) -> None:
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")


def _check_groups(topk: int, num_experts: int, num_groups: Optional[int], group_topk: int) -> None:
    """Rules of group-limited top-k (checked only when group_topk >= 1)."""
    if num_groups is None or num_groups < 1:
        raise ValueError(f"num_groups={num_groups} must be a positive integer when group_topk={group_topk}")
    if num_experts % num_groups != 0:
        raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    if group_topk > num_groups:
        raise ValueError(f"group_topk={group_topk} must be <= num_groups={num_groups}")
    if topk % group_topk != 0:
        raise ValueError(f"topk={topk} must be divisible by group_topk={group_topk}")
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(
            f"topk / group_topk = {topk // group_topk} experts per group exceeds the group size "
            f"num_experts / num_groups = {num_experts // num_groups}"
        )


def _check_expert_bias(expert_bias: torch.Tensor, score_function: str, num_experts: int) -> None:
    if score_function == "softmax":
        raise ValueError("expert_bias is only supported with score_function 'sigmoid' or 'sqrtsoftplus', got 'softmax'")
    if expert_bias.dtype != torch.float32 or expert_bias.shape != (num_experts,):
        raise ValueError(
            f"expert_bias must be a float32 tensor of shape ({num_experts},), "
            f"got {expert_bias.dtype} of shape {tuple(expert_bias.shape)}"
        )


def _format_value(routing_map_format: Union[str, int]) -> RoutingMapFormat:
    """Accept the enum, its int value, or the strings 'bytemap' / 'bitmap_u8'."""
    if isinstance(routing_map_format, str):
        names = {"bytemap": RoutingMapFormat.BYTEMAP, "bitmap_u8": RoutingMapFormat.BITMAP_U8}
        if routing_map_format in names:
            return names[routing_map_format]
    elif isinstance(routing_map_format, int) and routing_map_format in (0, 1):
        return RoutingMapFormat(routing_map_format)
    raise ValueError(
        f"routing_map_format={routing_map_format!r} is unknown; use 'bytemap' / 'bitmap_u8', "
        "RoutingMapFormat.BYTEMAP / BITMAP_U8, or 0 / 1"
    )


def _check_topk_indices(topk_indices: torch.Tensor, logits: torch.Tensor, topk: int, fmt: RoutingMapFormat) -> None:
    expected = (*logits.shape[:-1], topk)
    if fmt != RoutingMapFormat.BYTEMAP:
        raise ValueError(
            "topk_indices returns dense indices instead of a routing map; leave routing_map_format as 'bytemap'"
        )
    if topk_indices.dtype not in _INDEX_DTYPES or tuple(topk_indices.shape) != expected:
        raise ValueError(
            f"topk_indices must be an int16/int32/int64 tensor of shape {expected}, "
            f"got {topk_indices.dtype} of shape {tuple(topk_indices.shape)}"
        )
    if topk_indices.device != logits.device:
        raise ValueError(f"topk_indices is on {topk_indices.device} but logits are on {logits.device}")


# ----------------------------------------------------------------------------------------------
# The math, in float32
# ----------------------------------------------------------------------------------------------


def _scores(x: torch.Tensor, score_function: str) -> torch.Tensor:
    """s = score_function(x) over the expert axis."""
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return F.softplus(x, threshold=_SOFTPLUS_THRESHOLD).sqrt()


def _top(r: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of r along the last axis, ties to the lower index."""
    ranked = torch.sort(r, dim=-1, descending=True, stable=True)
    return ranked.values[..., :k], ranked.indices[..., :k]


def _select(r: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: int) -> torch.Tensor:
    """Indices [..., k] of the experts chosen on routing scores r, group-limited when group_topk >= 1."""
    if group_topk >= 1:
        grouped = r.unflatten(-1, (num_groups, -1))
        group_scores = _top(grouped, topk // group_topk)[0].sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept = kept.scatter(-1, _top(group_scores, group_topk)[1], value=True)
        r = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)
    return _top(r, topk)[1]


def _to_bitmap(routing_map: torch.Tensor) -> torch.Tensor:
    """Pack bool[..., E] into uint8[..., ceil(E / 8)], bit e % 8 of byte e // 8 (LSB first)."""
    num_experts = routing_map.shape[-1]
    padded = F.pad(routing_map.long(), (0, -num_experts % 8))
    bit_values = torch.pow(2, torch.arange(8, device=routing_map.device))
    return (padded.unflatten(-1, (-1, 8)) * bit_values).sum(dim=-1).to(torch.uint8)


def _dense_map(indices: torch.Tensor, like: torch.Tensor, fmt: RoutingMapFormat) -> torch.Tensor:
    """The routing map of top-k ``indices`` in layout ``fmt``."""
    routing_map = torch.zeros_like(like, dtype=torch.bool).scatter(-1, indices, value=True)
    return _to_bitmap(routing_map) if fmt == RoutingMapFormat.BITMAP_U8 else routing_map


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    scaling_factor: Optional[float],
    score_function: str,
    expert_bias: Optional[torch.Tensor],
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
    topk_indices: Optional[torch.Tensor] = None,
):
    """Top-k MoE routing with a score function (see the module docstring for the math).

    Args:
        logits: [..., E] router logits in float32, bfloat16 or float16.
        topk: experts per token, 1 <= topk <= E.
        use_pre_softmax: softmax only: score then select (True) or select then score (False).
        num_groups: number of expert groups for group-limited top-k.
        group_topk: groups kept per token; None or 0 disables grouping.
        scaling_factor: multiplies the probabilities; None means 1.
        score_function: "softmax", "sigmoid" or "sqrtsoftplus".
        expert_bias: float32 [E] added to the scores for selection only (sigmoid / sqrtsoftplus).
        routing_map_format: "bytemap" (bool[..., E]) or "bitmap_u8" (uint8[..., ceil(E / 8)]).
        topk_indices: optional int16/int32/int64 [..., topk] buffer; when given it is filled with the
            chosen expert ids (descending routing score) and returned instead of the routing map.

    Returns:
        (probs, routing_map): probs [..., E] in logits' dtype, zero off the top-k and differentiable
        with respect to logits; routing_map in ``routing_map_format`` (or ``topk_indices``).

    Raises:
        ValueError: unsupported dtype or score function, topk outside [1, E], inconsistent grouping,
            expert_bias with softmax or of the wrong dtype / shape, a bad routing_map_format or
            topk_indices buffer.

    Example:
        >>> probs, routing_map = fused_topk_with_score_function(
        ...     logits=torch.tensor([[1.0, 3.0, 2.0, 0.0]]), topk=2, use_pre_softmax=False, num_groups=None,
        ...     group_topk=None, scaling_factor=None, score_function="softmax", expert_bias=None)
        >>> routing_map
        tensor([[False,  True,  True, False]])
        >>> round(probs.sum().item(), 6)
        1.0
    """
    num_experts = _check_logits(logits)
    _check_score_function(score_function)
    _check_topk(topk, num_experts)
    group_topk = group_topk or 0
    if group_topk < 0:
        raise ValueError(f"group_topk={group_topk} must be None or a positive integer")
    if group_topk:
        _check_groups(topk, num_experts, num_groups, group_topk)
    if expert_bias is not None:
        _check_expert_bias(expert_bias, score_function, num_experts)
    fmt = _format_value(routing_map_format)
    if topk_indices is not None:
        _check_topk_indices(topk_indices, logits, topk, fmt)

    x = logits.float()
    if score_function == "softmax" and not use_pre_softmax:
        indices = _select(x.detach(), topk=topk, num_groups=num_groups, group_topk=group_topk)
        weights = torch.softmax(x.gather(-1, indices), dim=-1)
    else:
        scores = _scores(x, score_function)
        routing_scores = scores if expert_bias is None else scores + expert_bias
        indices = _select(routing_scores.detach(), topk=topk, num_groups=num_groups, group_topk=group_topk)
        weights = scores.gather(-1, indices)
        if score_function != "softmax" and topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _EPSILON)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    probs = torch.zeros_like(x).scatter(-1, indices, weights).to(logits.dtype)
    if topk_indices is not None:
        return probs, topk_indices.copy_(indices)
    return probs, _dense_map(indices, like=x, fmt=fmt)


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
):
    """Dense scores and top-k routing map for the load-balancing loss.

    scores = softmax(x) for softmax, else s / (sum_{all experts} s + 1e-20) with s = score_function(x)
    (normalised over every expert, whatever topk is); the routing map marks the top-k of scores.

    Args:
        logits: [..., E] router logits in float32, bfloat16 or float16.
        topk: experts per token, 1 <= topk <= E.
        score_function: "softmax", "sigmoid" or "sqrtsoftplus".
        routing_map_format: "bytemap" or "bitmap_u8", as in :func:`fused_topk_with_score_function`.

    Returns:
        (routing_map, scores): the routing map, and scores [..., E] in float32 (differentiable with
        respect to logits, over all experts).

    Raises:
        ValueError: unsupported dtype or score function, topk outside [1, E], a bad routing_map_format.

    Example:
        >>> routing_map, scores = fused_compute_score_for_moe_aux_loss(
        ...     logits=torch.tensor([[0.0, 2.0, 1.0]]), topk=1, score_function="sigmoid")
        >>> routing_map
        tensor([[False,  True, False]])
        >>> round(scores.sum().item(), 6)
        1.0
    """
    num_experts = _check_logits(logits)
    _check_score_function(score_function)
    _check_topk(topk, num_experts)
    fmt = _format_value(routing_map_format)

    scores = _scores(logits.float(), score_function)
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + _EPSILON)
    indices = _top(scores.detach(), topk)[1]
    return _dense_map(indices, like=scores, fmt=fmt), scores


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Union[int, torch.Tensor],
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-style load-balancing loss.

    aux_loss = C * sum_e (sum_t probs[t, e]) * tokens_per_expert[e],
    C = num_experts * coeff / (topk * total_num_tokens^2); d aux_loss / d probs[t, e] = C * tokens_per_expert[e].
    Sums run in float32. probs may hold several sequences side by side (num_cols a multiple of num_experts).

    Args:
        probs: [num_tokens, num_cols] router probabilities in float32, bfloat16 or float16.
        tokens_per_expert: [num_cols] token counts (int16/int32/int64/float32/bfloat16); no gradient.
        total_num_tokens: the token count of the batch the counts refer to: a positive int, or a
            one-element int64 tensor (kept on device: no host synchronisation).
        num_experts: experts per sequence; must divide num_cols.
        topk: experts per token (>= 1).
        coeff: the loss coefficient.

    Returns:
        The loss, a 0-dim tensor in probs' dtype, differentiable with respect to probs.

    Raises:
        ValueError: probs not 2-D or of an unsupported dtype, tokens_per_expert of the wrong length or
            dtype, num_experts not dividing num_cols, non-positive topk, num_experts or total_num_tokens.

    Example:
        >>> fused_moe_aux_loss(probs=torch.full((2, 4), 0.25), tokens_per_expert=torch.tensor([1, 1, 1, 1]),
        ...                    total_num_tokens=2, num_experts=4, topk=2, coeff=1.0)
        tensor(1.)
    """
    if probs.dim() != 2 or probs.dtype not in _ROUTER_DTYPES:
        raise ValueError(
            f"probs must be a 2-D float32/bfloat16/float16 tensor [num_tokens, num_cols], "
            f"got {probs.dtype} of shape {tuple(probs.shape)}"
        )
    num_cols = probs.shape[1]
    if tokens_per_expert.shape != (num_cols,) or tokens_per_expert.dtype not in _TOKENS_PER_EXPERT_DTYPES:
        raise ValueError(
            f"tokens_per_expert must be a tensor of shape ({num_cols},) in one of {_TOKENS_PER_EXPERT_DTYPES}, "
            f"got {tokens_per_expert.dtype} of shape {tuple(tokens_per_expert.shape)}"
        )
    if num_experts < 1 or num_cols % num_experts != 0:
        raise ValueError(f"num_experts={num_experts} must be positive and divide probs.shape[1]={num_cols}")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1")
    if isinstance(total_num_tokens, torch.Tensor):
        if total_num_tokens.numel() != 1 or total_num_tokens.dtype != torch.int64:
            raise ValueError(
                f"a tensor total_num_tokens must hold one int64 value, "
                f"got {total_num_tokens.dtype} with {total_num_tokens.numel()} elements"
            )
        num_tokens = total_num_tokens.detach().reshape(()).float()
        coefficient = num_experts * coeff / topk / num_tokens / num_tokens
    elif total_num_tokens < 1:
        raise ValueError(f"total_num_tokens={total_num_tokens} must be >= 1")
    else:
        coefficient = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)

    weighted = probs.float().sum(dim=0) * tokens_per_expert.detach().float()
    return (weighted.sum() * coefficient).to(probs.dtype)
