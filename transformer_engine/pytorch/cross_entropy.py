"""``parallel_cross_entropy``: cross entropy over logits whose vocabulary may be split across ranks.

For a row of logits z over the vocabulary V, target class t and label smoothing eps:

    lse  = log sum_j exp(z_j)
    loss = (1 - eps) (lse - z_t) + eps (lse - (1/V) sum_j z_j)            (0 for rows with t = ignore_idx)
    dz_j = dloss (exp(z_j - lse) - (1 - eps) [j == t] - eps / V)          (0 for ignored rows)

Vocab parallel (``dist_process_group`` of P ranks): rank r holds the columns [r V_r, (r+1) V_r) of every
row, V = P V_r. The full-vocabulary terms are rebuilt from per-shard ones with two all-reduces:

    lse_r = log sum_{j in shard r} exp(z_j)                  (the catalog op on the shard)
    m = max_r lse_r                                          (all-reduce MAX)
    [sum_r exp(lse_r - m), z_t, sum_j z_j]                   (one all-reduce SUM; z_t from its owner, 0 elsewhere)
    lse = m + log sum_r exp(lse_r - m)

and each rank's gradient is the formula above on its own columns, with the global lse and V: no
communication in backward.

The kernels are the catalog's ``cross_entropy_fwd`` / ``cross_entropy_bwd``. Their contract covers one
shard that holds every row's target, so the vocab-parallel case uses the forward op only for lse_r and
composes the rest (target logits, the smoothing sum, and the backward, where a row's target may live on
another rank) from torch ops around the collectives. Under ``torch.compile`` the catalog ops are the
custom ops of every catalog op (their contract gives an out-of-range target a NaN row: no
data-dependent check to trace).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch

from transformer_engine.plugin import ops

from .parallel import comm

__all__ = ["parallel_cross_entropy"]


def _check_inputs(inp: torch.Tensor, target: torch.Tensor, label_smoothing: float, ignore_idx: int) -> None:
    """Shapes, dtypes and settings; raises before any work."""
    if not isinstance(inp, torch.Tensor) or not inp.dtype.is_floating_point or inp.dim() not in (2, 3):
        raise ValueError(f"inp must be floating-point logits [tokens, V] or [B, SQ, V], got "
                         f"{getattr(inp, 'dtype', type(inp).__name__)} of shape {tuple(getattr(inp, 'shape', ()))}")
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype == torch.bool:
        got = getattr(target, "dtype", type(target).__name__)
        raise TypeError(f"target must be a tensor of integer class indices, got {got}")
    if target.numel() != inp.shape[:-1].numel():
        raise ValueError(f"target has {target.numel()} entries but inp {tuple(inp.shape)} has "
                         f"{inp.shape[:-1].numel()} tokens: one target per token")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be a float in [0, 1]")
    if isinstance(ignore_idx, bool) or not isinstance(ignore_idx, int):
        raise TypeError(f"ignore_idx={ignore_idx!r} must be an int")


def _check_targets(target: torch.Tensor, vocab: int, ignore_idx: int) -> None:
    """Every target in [0, vocab) or equal to ignore_idx: a ValueError eagerly, an async assert when traced
    (a host sync there would break the graph). The backends differ on a bad target (NaN or an error)."""
    bad = (target != ignore_idx) & ((target < 0) | (target >= vocab))
    message = (f"parallel_cross_entropy: every target must be in [0, {vocab}) (the full vocabulary) "
               f"or equal ignore_idx={ignore_idx}")
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), message)
    elif bool(bad.any()):
        raise ValueError(f"{message}; got {target[bad][:4].tolist()}")


def _grad_logits(grad: torch.Tensor, z: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, kept: torch.Tensor,
                 lse: torch.Tensor, eps: float, vocab: int) -> torch.Tensor:
    """dz_j = g (exp(z_j - lse) - eps / V - (1 - eps) [j == t]) over z's columns, in torch ops: the one-hot
    term only where this shard ``owned`` the target (at column ``local_t``), g = 0 on rows not ``kept``."""
    dz = torch.exp(z.float() - lse[:, None]) - eps / vocab
    hit = torch.where(owned, -(1.0 - eps), 0.0).to(dz.dtype)
    dz = dz.scatter_add(1, torch.where(owned, local_t, 0)[:, None], hit[:, None])
    return (dz * torch.where(kept, grad.float(), 0.0)[:, None]).to(z.dtype)


def _vocab_parallel_fwd(z: torch.Tensor, target: torch.Tensor, eps: float, ignore_idx: int, group: Any,
                        shard: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss float32 [N], global lse float32 [N]) of the full-vocabulary rows, from this rank's columns
    [lo, lo + V_r) (``shard`` = (lo, V)) and two all-reduces (see the module docstring)."""
    lo, vocab = shard
    kept = target != ignore_idx
    local_t = target - lo
    owned = kept & (local_t >= 0) & (local_t < z.shape[1])
    # lse_r from the op: every row marked ignored, so no target is looked up in this shard
    _, lse_r = ops.cross_entropy_fwd(z, torch.full_like(target, ignore_idx), label_smoothing=0.0, ignore_index=ignore_idx)
    m = comm.all_reduce_max(lse_r, group)
    z_t = torch.where(owned, z.gather(1, torch.where(owned, local_t, 0)[:, None])[:, 0].float(), 0.0)
    z_sum = z.sum(dim=-1, dtype=torch.float32) if eps else torch.zeros_like(lse_r)
    sums = comm.all_reduce(torch.stack([torch.exp(lse_r - m), z_t, z_sum]), group)
    lse = m + torch.log(sums[0])
    loss = (1.0 - eps) * (lse - sums[1]) + eps * (lse - sums[2] / vocab)
    return torch.where(kept, loss, 0.0), lse


class _CrossEntropyFunction(torch.autograd.Function):
    """Per-row loss float32 [N] of logits z [N, V_r] (this rank's columns) against target int64 [N]."""

    @staticmethod
    def forward(ctx, z, target, label_smoothing, ignore_idx, group, shard):
        """loss per row; ``shard`` = (first column held here, full vocabulary), None on one rank."""
        if shard is None:
            loss, lse = ops.cross_entropy_fwd(z, target, label_smoothing=label_smoothing, ignore_index=ignore_idx)
        else:
            loss, lse = _vocab_parallel_fwd(z, target, label_smoothing, ignore_idx, group, shard)
        ctx.save_for_backward(z, target, lse)
        ctx.settings = (label_smoothing, ignore_idx, shard)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """dz from the saved logits and global lse; no communication."""
        z, target, lse = ctx.saved_tensors
        eps, ignore_idx, shard = ctx.settings
        if shard is None:
            dz = ops.cross_entropy_bwd(grad_loss, z, target, lse=lse, label_smoothing=eps, ignore_index=ignore_idx)
        else:
            lo, vocab = shard
            kept = target != ignore_idx
            local_t = target - lo
            owned = kept & (local_t >= 0) & (local_t < z.shape[1])
            dz = _grad_logits(grad_loss, z, local_t, owned, kept, lse, eps, vocab)
        return dz, None, None, None, None, None


def _shard(group: Any, vocab_local: int) -> Optional[Tuple[int, int]]:
    """(first column of this rank's shard, full vocabulary), or None without a group of several ranks."""
    if group is None:
        return None
    world = comm.group_size(group)
    return None if world == 1 else (comm.group_rank(group) * vocab_local, world * vocab_local)


def parallel_cross_entropy(
    inp: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: Optional[torch.distributed.ProcessGroup] = None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cross entropy of logits against class targets, optionally with the vocabulary split across ranks.

    loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j), lse = log sum_j exp(z_j), over the full
    vocabulary; math in float32 for any logits dtype.

    Args:
        inp: logits [tokens, V_r] or [B, SQ, V_r] (or [SQ, B, V_r]); V_r = V / P on each of the P ranks of
            ``dist_process_group``, rank r holding the columns [r V_r, (r+1) V_r) (equal shards).
        target: integer class indices in [0, V) (the full vocabulary), one per token (inp's leading shape).
        label_smoothing: eps in [0, 1].
        reduce_loss: return the mean loss over the non-ignored tokens (shape [1]) instead of one per token.
        dist_process_group: the group the vocabulary is split over; None = all of it on this rank.
        ignore_idx: target value whose tokens get loss 0 and no gradient.
        is_cg_capturable: accepted for TE compatibility; the backward here never syncs with the host.
        _input: deprecated name of ``inp``.

    Returns:
        float32 loss of shape inp.shape[:-1], or [1] with ``reduce_loss``.

    Raises:
        ValueError: inp not 2-D / 3-D floating point, a target count that differs from the token count,
            eps outside [0, 1], or a target outside [0, V) that is not ``ignore_idx``.
        TypeError: target not an integer tensor, or ignore_idx not an int.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> [round(v, 4) for v in parallel_cross_entropy(z, torch.tensor([0, -100])).tolist()]
        [0.2395, 0.0]
    """
    if _input is not None:
        warnings.warn("parallel_cross_entropy: '_input' is deprecated, pass 'inp'", FutureWarning, stacklevel=2)
        inp = _input
    _check_inputs(inp, target, label_smoothing, ignore_idx)
    shard = _shard(dist_process_group, inp.shape[-1])
    flat_target = target.reshape(-1).long()
    _check_targets(flat_target, inp.shape[-1] if shard is None else shard[1], ignore_idx)
    z = inp.reshape(-1, inp.shape[-1])
    loss = _CrossEntropyFunction.apply(z, flat_target, float(label_smoothing), ignore_idx, dist_process_group, shard)
    if reduce_loss:
        kept = (flat_target != ignore_idx).sum().clamp(min=1)
        return (loss.sum() / kept).reshape(1)
    return loss.reshape(inp.shape[:-1])
