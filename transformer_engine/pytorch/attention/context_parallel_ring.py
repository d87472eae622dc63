"""The "p2p" ring of context parallelism (see :mod:`.context_parallel` for the layout and the math).

K/V blocks travel rank r -> r+1 (isend / irecv posted before the block's compute); each block's partial output and
log-sum-exp merge exactly; the backward runs the same ring with the global lse, each block's dK / dV accumulator
travelling with it. Each block is one catalog call: ``attention_block_fwd`` returns its O and lse (cuDNN or
FlashAttention-2 on the GPU; the reference backend's float32 math elsewhere, and for masks they cannot take:
packed sequences, windows, biases), ``attention_block_bwd`` takes the merged O and lse, from which it forms the
block's share of the gradients. Outputs merge in float32 (:mod:`.blockwise`); dQ and the travelling dK / dV
accumulate in float32.

An attention bias (TE's ``core_attention_bias``, "pre_scale_bias" / "post_scale_bias") holds this rank's query rows
and every key column in sequence order, [1 or b, 1 or h, 1 or s_q, S_kv]; the block of rank j's keys adds the
columns at j's positions (S = scale (q k^T + B), or scale q k^T + B), and its gradient dB = dS (times the scale
for "pre_scale_bias") collects into those columns, summed over broadcast dimensions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from transformer_engine.plugin import ops

from .blockwise import block_config, merge_block
from .context_parallel_packed import packed_hidden

if TYPE_CHECKING:
    from .context_parallel import CPAttention, CPGroup

__all__ = ["RingAttention"]


class _Ring:
    """Point-to-point messages to the next rank of the group and from the previous one."""

    def __init__(self, cp: CPGroup):
        size, rank = cp.size, cp.rank
        self.group, self.rank, self.size = cp.group, rank, size
        self.next, self.prev = cp.global_rank((rank + 1) % size), cp.global_rank((rank - 1) % size)

    def shift(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Post send(x -> next) and recv(<- prev); the returned function waits and gives what arrived."""
        x = x.contiguous()
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:  # the sent x stays referenced by ops until its send completed
                work.wait()
            ops.clear()
            return buf

        return wait


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    sizes = [x.numel() for x in like]
    return [part.view(x.shape) for part, x in zip(flat.split(sizes), like)]


def _blocks(step: int, ring: _Ring, settings: CPAttention, s_q: int, s_kv: int, device):
    """(query rows, key rows, mask type, hidden) of the step's block for this rank (see the module docstring); mask
    type "causal" (top-left) or "no_mask"; hidden: bool [rows, keys], True where a mask hides a key from a query,
    or None (nothing hidden beyond the mask type)."""
    every_q, every_kv = slice(0, s_q), slice(0, s_kv)
    src = (ring.rank - step) % ring.size
    if settings.packed is not None:
        hidden = packed_hidden(settings.packed, ring.rank, src, ring.size, causal=settings.causal, window_size=settings.window_size,
                               device=device)
        return every_q, every_kv, "no_mask", hidden
    if settings.windowed:
        return every_q, every_kv, "no_mask", _window_hidden(settings, ring, src, s_q, device)
    if not settings.causal:
        return every_q, every_kv, "no_mask", None
    if src == ring.rank:  # the local order of positions is increasing: the diagonal block's causal mask is top-left
        return every_q, every_kv, "causal", None
    if src < ring.rank:
        return every_q, slice(0, s_kv // 2), "no_mask", None
    return slice(s_q // 2, s_q), every_kv, "no_mask", None


def _positions(rank: int, size: int, length: int, device) -> torch.Tensor:
    """Sequence positions of a rank's 2L tokens: chunks ``rank`` and 2P-1-``rank`` of L tokens."""
    first = torch.arange(length, device=device)
    return torch.cat([rank * length + first, (2 * size - 1 - rank) * length + first])


def _window_hidden(settings: CPAttention, ring: _Ring, src: int, s_local: int, device) -> torch.Tensor:
    """What a sliding window (and the causal mask) hides in the block of this rank's queries and rank ``src``'s keys:
    key position j is hidden from query position i where j - i > right (0 when causal) or i - j > left."""
    length = s_local // 2
    offset = _positions(src, ring.size, length, device)[None, :] - _positions(ring.rank, ring.size, length, device)[:, None]
    left, right = settings.window_size
    right = 0 if settings.causal else right
    hidden = offset > right if right >= 0 else torch.zeros_like(offset, dtype=torch.bool)
    return hidden | (offset < -left) if left >= 0 else hidden


def _bias_factor(settings: CPAttention) -> float:
    """What multiplies the bias in S (and dS in its gradient): the softmax scale before it, 1 after it."""
    return settings.softmax_scale if settings.bias_type == "pre_scale_bias" else 1.0


def _bias_columns(ring: _Ring, src: int, s_kv: int, cols: slice, device) -> torch.Tensor:
    """The sequence positions of the keys of rank ``src`` that a block reads (its ``cols``): the bias columns."""
    return _positions(src, ring.size, s_kv // 2, device)[cols]


def _bias_rows(bias: torch.Tensor, rows: slice) -> torch.Tensor:
    """The bias rows of a block's queries (all of a bias broadcast over the queries)."""
    return bias if bias.shape[-2] == 1 else bias[..., rows, :]


def _bias_block(bias: Optional[torch.Tensor], settings: CPAttention, ring: _Ring, step: int, rows: slice, cols: slice, s_kv: int,
                device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the step's block's additive term of S, its key columns): the bias at the block's query rows and at the
    positions of its keys, scaled as its type says; (None, None) without a bias."""
    if bias is None:
        return None, None
    columns = _bias_columns(ring, (ring.rank - step) % ring.size, s_kv, cols, device)
    return _bias_factor(settings) * _bias_rows(bias, rows).index_select(-1, columns).float(), columns


def _ring_forward(q, k, v, bias, settings: CPAttention, ring: _Ring):
    """(out bshd in q's dtype, lse float32 [b, h, s_q], the blocks' ctx); q, k, v "bshd". Each block is one
    ``attention_block_fwd`` (with dropout, its probabilities normalised by its own lse, rescaled by the merge)."""
    s_q, s_kv = q.shape[1], k.shape[1]
    out, lse, kv, contexts = None, None, _pack(k, v), []
    for step in range(ring.size):
        arriving = ring.shift(kv) if step < ring.size - 1 else None  # overlaps the block's compute
        k_blk, v_blk = _unpack(kv, (k, v))
        rows, cols, mask_type, hidden = _blocks(step, ring, settings, s_q, s_kv, q.device)
        block_bias, _ = _bias_block(bias, settings, ring, step, rows, cols, s_kv, q.device)
        o_b, lse_b, ctx_b = ops.attention_block_fwd(q[:, rows], k_blk[:, cols], v_blk[:, cols],
                                                    config=block_config(settings, mask_type, block_bias), attn_mask=hidden,
                                                    attn_bias=block_bias)
        contexts.append(ctx_b)
        out, lse = merge_block(out, lse, rows, o_b, lse_b)  # step 0 (this rank's own keys) covers every query row
        if arriving is not None:
            kv = arriving()
    return out.to(q.dtype), lse, contexts


def _ring_backward(dout, q, k, v, bias, out, lse, contexts, settings: CPAttention, ring: _Ring):
    """(dq, dk, dv, dbias) in the inputs' dtypes (dbias None without a bias): the forward's ring again, each block's
    ``attention_block_bwd`` given the merged out and lse, with dK/dV travelling with K/V."""
    s_q, s_kv = q.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dbias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    kv, dkv_arriving = _pack(k, v), None
    for step in range(ring.size):
        arriving = ring.shift(kv) if step < ring.size - 1 else None
        k_blk, v_blk = _unpack(kv, (k, v))
        rows, cols, mask_type, hidden = _blocks(step, ring, settings, s_q, s_kv, q.device)
        block_bias, columns = _bias_block(bias, settings, ring, step, rows, cols, s_kv, q.device)
        dq_b, dk_b, dv_b, dbias_b = ops.attention_block_bwd(
            dout[:, rows], q=q[:, rows], k=k_blk[:, cols], v=v_blk[:, cols], out=out[:, rows], lse=lse[..., rows], ctx=contexts[step],
            config=block_config(settings, mask_type, block_bias), attn_mask=hidden, attn_bias=block_bias,
        )
        dq[:, rows] += dq_b
        if dbias is not None:
            _bias_rows(dbias, rows).index_add_(-1, columns, _bias_factor(settings) * dbias_b)
        dkv = dkv_arriving() if dkv_arriving is not None else k.new_zeros(k.numel() + v.numel(), dtype=torch.float32)
        dk_acc, dv_acc = _unpack(dkv, (k, v))
        dk_acc[:, cols] += dk_b
        dv_acc[:, cols] += dv_b
        dkv_arriving = ring.shift(dkv)  # the block's gradient follows the block; after P hops it is home
        if arriving is not None:
            kv = arriving()
    dk, dv = _unpack(dkv_arriving(), (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if dbias is None else dbias.to(bias.dtype)


class RingAttention(torch.autograd.Function):
    """"p2p" context parallelism: ring forward with the log-sum-exp merge, ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias: Optional[torch.Tensor], settings: CPAttention, cp: CPGroup):
        out, lse, contexts = _ring_forward(q, k, v, bias, settings, _Ring(cp))
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.settings, ctx.cp, ctx.contexts = settings, cp, contexts  # the blocks' ctx: e.g. their dropout masks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = _ring_backward(dout, q, k, v, bias, out, lse, ctx.contexts, ctx.settings, _Ring(ctx.cp))
        return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None
