"""FlashAttention-2 (PyTorch's aten flash ops) as ``attention_block_fwd`` / ``attention_block_bwd``: a ring's blocks.

See plugin/catalog/attention.py for the contract. Forward: ``aten._scaled_dot_product_flash_attention`` returns
the block's O and lse [b, h, s_q] (float32) as the contract states them. Backward:
``aten._scaled_dot_product_flash_attention_backward`` given the *merged* O and lse: the kernel forms
P = exp(S - lse) and D_i = sum_d dO_id O_id from them, which is the block's share of the whole attention's
gradient (the same identity NVIDIA TE's p2p context parallelism relies on). Dropout: the forward's philox seed
and offset travel in ctx, so the backward regenerates the block's mask.

GQA / MQA: kv heads repeated to h heads, their gradients summed over each group (as ``fused_attn_*``).
Declined (``SUPPORTS``, with the reason): what flash cannot take (masks, biases, windows, float32, head dims),
a top-left causal mask with s_q != s_kv (flash's causal flag is bottom-right aligned) and query rows that
see no key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from transformer_engine.plugin.backends._checks import check_attention_block_config
from transformer_engine.plugin.core import Reject

from .attention import _Call, _Device, _flash_gap, _from_heads, _in_layout_of, _to_heads

__all__ = ["attention_block_fwd", "attention_block_bwd"]


@dataclass(frozen=True, eq=False)
class FlashBlockCtx:
    """The forward's config and the flash op's outputs its backward takes (sequence offsets and lengths, rng state)."""

    config: object
    saved: Tuple


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """True, or a Reject naming what flash cannot take (the reference backend then runs the block)."""
    if config.qkv_format != "bshd" or config.softmax_type != "vanilla" or config.bias_type != "no_bias" or config.has_window:
        return Reject("flash blocks take bshd, the vanilla softmax, no bias and no window")
    if q.dim() != 4 or q.numel() == 0 or k.numel() == 0:
        return Reject("flash blocks take non-empty 4-D bshd tensors")
    s_q, s_kv = q.shape[1], k.shape[1]
    if config.mask_type == "causal" and s_q != s_kv or config.mask_type == "causal_bottom_right" and s_q > s_kv:
        return Reject(f"mask_type={config.mask_type!r} with s_q={s_q}, s_kv={s_kv}: flash's causal flag is bottom-right "
                      "aligned, and rows with no key are not its case")
    if q.device.type != "cuda":
        return Reject(f"inputs are on {q.device.type}, not on a CUDA device")
    gap = _flash_gap(_Call.of(q, k, v, config, attn_mask, attn_bias), _Device.of(q.device))
    return True if gap is None else Reject(gap)


def attention_block_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """(out bshd in q's dtype, lse float32 [b, h, s_q], :class:`FlashBlockCtx`) of one block on the flash kernel.

    Raises:
        ValueError: a config the block ops do not take; NotImplementedError: a call this backend declines.
    """
    check_attention_block_config(config)
    verdict = _supports_fwd(q, k, v, config, attn_mask, attn_bias)
    if not verdict:
        raise NotImplementedError(f"vendor.cuda attention_block_fwd: {verdict.reason}")
    group = q.shape[2] // k.shape[2]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        _to_heads(q), _to_heads(k, group), _to_heads(v, group), config.dropout_p, config.mask_type != "no_mask", False,
        scale=config.softmax_scale,
    )
    return _from_heads(res[0]), res[1], FlashBlockCtx(config, tuple(res[2:8]))


def attention_block_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """(dq, dk, dv, None): the block's share of the gradients, from the merged ``out`` and ``lse``.

    Raises:
        ValueError: ctx from another backend or another config.
    """
    if not isinstance(ctx, FlashBlockCtx) or ctx.config != config:
        raise ValueError("ctx must come from the vendor.cuda attention_block_fwd called with the same config")
    group = q.shape[2] // k.shape[2]
    cum_q, cum_k, max_q, max_k, seed, offset = ctx.saved
    outh = _to_heads(out)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _in_layout_of(_to_heads(dout), outh), _to_heads(q), _to_heads(k, group), _to_heads(v, group), outh, lse.contiguous(),
        cum_q, cum_k, max_q, max_k, config.dropout_p, config.mask_type != "no_mask", seed, offset, scale=config.softmax_scale,
    )
    return _from_heads(dq), _from_heads(dk, group), _from_heads(dv, group), None


def _supports_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """Only a ctx made by this backend's forward."""
    return True if isinstance(ctx, FlashBlockCtx) else Reject("ctx was not made by the vendor.cuda attention_block_fwd")


SUPPORTS = {"attention_block_fwd": _supports_fwd, "attention_block_bwd": _supports_bwd}
