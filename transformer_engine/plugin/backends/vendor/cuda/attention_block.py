"""PyTorch's cuDNN and FlashAttention-2 SDPA kernels as ``attention_block_fwd`` / ``attention_block_bwd``: a ring's blocks.

See plugin/catalog/attention.py for the contract. Forward: ``aten._scaled_dot_product_cudnn_attention`` (or
``_flash_attention``) returns the block's O and its log-sum-exp, which is the contract's lse (float32
[b, h, s_q]; cuDNN keeps a trailing unit dim). Backward: the kernels' backward ops given the *merged* O and lse:
they form P = exp(S - lse) and D_i = sum_d dO_id O_id from them, which is the block's share of the whole
attention's gradient (the identity NVIDIA TE's p2p context parallelism relies on too). Dropout: the forward's
philox seed and offset travel in ctx, so the backward regenerates the block's mask.

Kernels, in this order: cuDNN (the faster on Hopper), then flash, each where ``fused_attn_fwd``'s rules let it
run the call without a bias (``.attention``); a causal mask only where the kernel's flag has the asked alignment.
GQA / MQA: kv heads repeated to h heads, their gradients summed over each group (as ``fused_attn_*``).
Declined (``SUPPORTS``, with the reason): masks, biases, windows, float32, head dims neither kernel takes,
causal blocks neither flag expresses, and empty tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

import torch

from transformer_engine.plugin.backends._checks import check_attention_block_config
from transformer_engine.plugin.core import Reject

from .attention import _KERNELS, _Call, _causal_gap, _Device, _from_heads, _in_layout_of, _to_heads

__all__ = ["attention_block_fwd", "attention_block_bwd"]


_BLOCK_KERNELS = tuple(kernel for kernel in _KERNELS if kernel.name in ("cudnn", "flash"))


@dataclass(frozen=True, eq=False)
class BlockCtx:
    """The forward's kernel ("cudnn" or "flash"), config and the op's outputs its backward takes (sequence offsets
    and lengths, rng state)."""

    kernel: str
    config: object
    saved: Tuple


@functools.lru_cache(maxsize=256)
def block_kernel(call: _Call, device: _Device) -> Tuple[str, str]:
    """(kernel, "") for the first of cuDNN and flash that runs the block as asked (its causal flag native, no bias),
    or ("", why neither can)."""
    reasons = []
    for kernel in _BLOCK_KERNELS:
        causal_gap, _, causal_in_bias = _causal_gap(kernel, call)
        gap = kernel.gap(call, device) or causal_gap or (causal_in_bias and f"mask_type={call.mask_type!r}: its causal flag differs")
        if not gap:
            return kernel.name, ""
        reasons.append(f"{kernel.name}: {gap}")
    return "", "; ".join(reasons)


def _call_kernel(q, k, v, config) -> Tuple[str, str]:
    return block_kernel(_Call.of(q, k, v, config, None, None), _Device.of(q.device))


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """True, or a Reject naming what neither kernel takes (the reference backend then runs the block)."""
    if config.qkv_format != "bshd" or config.softmax_type != "vanilla" or config.bias_type != "no_bias" or config.has_window:
        return Reject("SDPA blocks take bshd, the vanilla softmax, no bias and no window")
    if q.dim() != 4 or q.numel() == 0 or k.numel() == 0:
        return Reject("SDPA blocks take non-empty 4-D bshd tensors")
    if attn_mask is not None or attn_bias is not None:
        return Reject("attn_mask / attn_bias: SDPA blocks take neither (the causal flag is their only mask)")
    if config.mask_type == "causal_bottom_right" and q.shape[1] > k.shape[1]:
        return Reject(f"mask_type='causal_bottom_right' with s_q={q.shape[1]} > s_kv={k.shape[1]}: rows with no key")
    if q.device.type != "cuda":
        return Reject(f"inputs are on {q.device.type}, not on a CUDA device")
    kernel, reason = _call_kernel(q, k, v, config)
    return True if kernel else Reject(reason)


def attention_block_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """(out bshd in q's dtype, lse float32 [b, h, s_q], :class:`BlockCtx`) of one block on cuDNN or flash.

    Raises:
        ValueError: a config the block ops do not take; NotImplementedError: a call this backend declines.
    """
    check_attention_block_config(config)
    verdict = _supports_fwd(q, k, v, config, attn_mask, attn_bias)
    if not verdict:
        raise NotImplementedError(f"vendor.cuda attention_block_fwd: {verdict.reason}")
    group = q.shape[2] // k.shape[2]
    (kernel, _), is_causal = _call_kernel(q, k, v, config), config.mask_type != "no_mask"
    qh, kh, vh = _to_heads(q), _to_heads(k, group), _to_heads(v, group)
    if kernel == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, compute_log_sumexp=True, dropout_p=config.dropout_p,
                                                                 is_causal=is_causal, return_debug_mask=False, scale=config.softmax_scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, config.dropout_p, is_causal, return_debug_mask=False,
                                                                 scale=config.softmax_scale)
    lse = res[1].reshape(res[1].shape[:3])  # cuDNN: [b, h, s_q, 1]
    return _from_heads(res[0]), lse, BlockCtx(kernel, config, tuple(res[2:8]))


def attention_block_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """(dq, dk, dv, None): the block's share of the gradients, from the merged ``out`` and ``lse``.

    Raises:
        ValueError: ctx from another backend or another config.
    """
    if not isinstance(ctx, BlockCtx) or ctx.config != config:
        raise ValueError("ctx must come from the vendor.cuda attention_block_fwd called with the same config")
    group = q.shape[2] // k.shape[2]
    cum_q, cum_k, max_q, max_k, seed, offset = ctx.saved
    qh, kh, vh, outh = _to_heads(q), _to_heads(k, group), _to_heads(v, group), _to_heads(out)
    doh, p, is_causal, scale = _in_layout_of(_to_heads(dout), outh), config.dropout_p, config.mask_type != "no_mask", config.softmax_scale
    if ctx.kernel == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            doh, qh, kh, vh, outh, lse.contiguous().unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, p, is_causal,
                                                                                 scale=scale,
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, outh, lse.contiguous(), cum_q, cum_k, max_q, max_k, p, is_causal, seed, offset, scale=scale,
        )
    return _from_heads(dq), _from_heads(dk, group), _from_heads(dv, group), None


def _supports_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """Only a ctx made by this backend's forward."""
    return True if isinstance(ctx, BlockCtx) else Reject("ctx was not made by the vendor.cuda attention_block_fwd")


SUPPORTS = {"attention_block_fwd": _supports_fwd, "attention_block_bwd": _supports_bwd}
