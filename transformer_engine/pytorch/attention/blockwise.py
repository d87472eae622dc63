"""Blockwise attention: the keys split into blocks, each one catalog call, the outputs merged by their log-sum-exp.

For blocks b of the keys of the same queries, each with O_b and lse_b from ``attention_block_fwd``:

    lse = logaddexp_b lse_b,   O = sum_b exp(lse_b - lse) O_b                         (exact, merged in float32)

and each block's share of the gradients comes from ``attention_block_bwd`` given the merged O and lse (dQ sums
the shares, dK / dV are the blocks' own). Context parallelism's ring merges the blocks that travel to it
(:mod:`.context_parallel_ring`); "all_gather" splits a causal query chunk's keys into the keys before the chunk (no
mask) and its own diagonal block (causal, top-left), so that both run on cuDNN, whose causal flag cannot align
the whole chunk bottom-right (:func:`blockwise_attention`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from transformer_engine.plugin import ops
from transformer_engine.plugin.catalog.attention import AttentionConfig

__all__ = ["block_config", "blockwise_attention", "merge_block"]


def block_config(settings, mask_type: str, bias: Optional[torch.Tensor] = None) -> AttentionConfig:
    """The catalog config of a block: the call's scale and dropout (``settings``: a CPAttention), the block's mask
    type, its bias (if any) added after the scale."""
    return AttentionConfig(softmax_scale=settings.softmax_scale, mask_type=mask_type, dropout_p=settings.dropout_p,
                           bias_type="no_bias" if bias is None else "post_scale_bias")


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no visible key) as 0, so that exp(-inf - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge_block(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], rows: slice, o_b: torch.Tensor,
                lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out float32 bshd, lse) merged over ``rows`` with a block's (o_b bshd, lse_b), in place:
    lse' = logaddexp(lse, lse_b), out' = exp(lse - lse') out + exp(lse_b - lse') o_b. With out None (the first
    block, which must cover every row): the block itself."""
    if out is None:
        return o_b.float(), lse_b
    new = torch.logaddexp(lse[..., rows], lse_b)
    weight_old = torch.exp(lse[..., rows] - _finite(new)).transpose(1, 2).unsqueeze(-1)
    weight_b = torch.exp(lse_b - _finite(new)).transpose(1, 2).unsqueeze(-1)
    out[:, rows].mul_(weight_old).addcmul_(o_b, weight_b)
    lse[..., rows] = new
    return out, lse


class _BlockwiseAttention(torch.autograd.Function):
    """O of q over the keys of ``blocks`` ((key slice, mask type) covering k in order), see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: Sequence[Tuple[slice, str]], settings):
        out, lse, contexts = None, None, []
        for keys, mask_type in blocks:
            o_b, lse_b, ctx_b = ops.attention_block_fwd(q, k[:, keys], v[:, keys], config=block_config(settings, mask_type))
            contexts.append(ctx_b)
            out, lse = merge_block(out, lse, slice(None), o_b, lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.settings, ctx.contexts = blocks, settings, contexts
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dks, dvs = None, [], []
        for (keys, mask_type), ctx_b in zip(ctx.blocks, ctx.contexts):
            dq_b, dk_b, dv_b, _ = ops.attention_block_bwd(dout, q=q, k=k[:, keys], v=v[:, keys], out=out, lse=lse, ctx=ctx_b,
                                                          config=block_config(ctx.settings, mask_type))
            dq = dq_b.float() if dq is None else dq.add_(dq_b)
            dks.append(dk_b)
            dvs.append(dv_b)
        return dq.to(q.dtype), torch.cat(dks, dim=1), torch.cat(dvs, dim=1), None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[Tuple[slice, str]], settings) -> torch.Tensor:
    """bshd O of q over k, v split into ``blocks`` ((key slice, "no_mask" / "causal") in order, covering every key);
    ``settings`` (a CPAttention) gives the softmax scale and dropout."""
    return _BlockwiseAttention.apply(q, k, v, tuple(blocks), settings)
