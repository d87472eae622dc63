"""Reference (pure PyTorch) implementations: one block of blockwise attention. See plugin/catalog/attention.py.

For one batch entry and query head n (kv head n // (h / h_kv)), in float32, over the block's keys:
    S = scale Q K^T (+ B),  S_ij = -inf where masked (mask type, window, attn_mask)
    lse_i = log sum_j exp S_ij,  P = exp(S - lse),  O = (P M / (1 - p)) V
Backward with the merged (final) O and lse of these queries:
    P = exp(S - lse),  D_i = sum_d dO_id O_id,  dS = P (dO V^T M / (1 - p) - D)
    dQ = scale dS K,  dK = scale dS^T Q,  dV = (P M / (1 - p))^T dO,  dB = dS summed to B's shape
The forward keeps its dropout mask in ctx (the reference ``fused_attn_fwd``'s ctx class).
"""

import torch

from transformer_engine.plugin.backends._checks import check_attention_block_config
from transformer_engine.plugin.core import Reject

from .attention import _AttentionCtx, _Segment, _check_qkv, _probs, _qkv_heads, _reduce_to, _score_operands, _scores
from .misc import dropout_bwd, dropout_fwd

__all__ = ["attention_block_fwd", "attention_block_bwd"]

_WHOLE = _Segment(slice(None), None, None)


def _operands(q, k, v, config, attn_mask, attn_bias):
    check_attention_block_config(config)
    return _score_operands(config, _check_qkv(q, k, v, config, None, None), attn_mask, attn_bias, None)


def attention_block_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """(out bshd in q's dtype, lse float32 [b, h, s_q], ctx) of one block (see the module docstring).

    Raises:
        ValueError / TypeError: a config the block ops do not take, inconsistent shapes, or optional tensors
            missing or given against the config.
    """
    operands = _operands(q, k, v, config, attn_mask, attn_bias)
    qh, kh, vh = _qkv_heads(q, k, v, _WHOLE)
    p, lse = _probs(qh, kh, config, operands, _WHOLE)
    keep = None
    if config.dropout_p > 0:
        p, keep = dropout_fwd(p, config.dropout_p)
    return (p @ vh).transpose(1, 2).to(q.dtype), lse.squeeze(-1), _AttentionCtx(config, (keep,))


def attention_block_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """(dq, dk, dv in their inputs' dtypes, dbias float32 in attn_bias's shape or None) of one block, given the
    merged ``out`` (bshd) and ``lse`` (float32 [b, h, s_q]) of its queries.

    Raises:
        ValueError / TypeError: as the forward, or a ctx from another backend or another config.
    """
    if not isinstance(ctx, _AttentionCtx) or ctx.config != config:
        raise ValueError("ctx must come from the reference attention_block_fwd called with the same config")
    operands = _operands(q, k, v, config, attn_mask, attn_bias)
    qh, kh, vh = _qkv_heads(q, k, v, _WHOLE)
    do, o = dout.float().transpose(1, 2), out.float().transpose(1, 2)
    lse = lse.float().unsqueeze(-1)
    p = torch.exp(_scores(qh, kh, config, operands, _WHOLE) - lse.masked_fill(torch.isneginf(lse), 0.0))
    dp = do @ vh.transpose(-1, -2)
    (keep,) = ctx.keep_masks
    p_drop = p
    if keep is not None:
        p_drop, dp = dropout_bwd(p, keep, config.dropout_p), dropout_bwd(dp, keep, config.dropout_p)
    ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
    h_kv, scale = k.shape[-2], config.softmax_scale
    dq = scale * (ds @ kh)
    dk = (scale * (ds.transpose(-1, -2) @ qh)).unflatten(1, (h_kv, -1)).sum(dim=2)
    dv = (p_drop.transpose(-1, -2) @ do).unflatten(1, (h_kv, -1)).sum(dim=2)
    dbias = None if attn_bias is None else _reduce_to(ds, operands.attn_bias.shape).reshape(attn_bias.shape)
    return dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), dbias


def _supports_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """Only a ctx made by this backend's :func:`attention_block_fwd` (the catalog's rule: the backward runs where the
    ctx was made)."""
    return True if isinstance(ctx, _AttentionCtx) else Reject("ctx was not made by the reference attention_block_fwd")


SUPPORTS = {"attention_block_bwd": _supports_bwd}
