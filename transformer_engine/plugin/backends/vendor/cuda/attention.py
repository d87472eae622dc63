"""PyTorch's SDPA kernels (FlashAttention-2, memory-efficient) as ``fused_attn_fwd`` / ``fused_attn_bwd``.

See plugin/catalog/attention.py for the op's contract. For each batch entry and query head,
with S = softmax_scale * Q K^T + B:

    forward   P = softmax(S),  O = dropout(P) V            (the kernel also returns lse = log sum exp S)
    backward  dS = P * (dP - D),  D_i = sum_d dO_id O_id,  dP = dropout^T(dO V^T)
              dQ = scale dS K,  dK = scale dS^T Q,  dV = dropout(P)^T dO,  dB = dS

Kernels (the ``torch.ops.aten._scaled_dot_product_*`` ops and their backward ops; the forward's
log-sum-exp and philox seed / offset travel in ``ctx``):

- flash: fp16 / bf16, no mask or bias, d_qk == d_v, d % 8 == 0, d <= 256, compute capability >= 8.0.
  Its causal flag aligns the diagonal bottom-right (FlashAttention-2), so it runs "causal" only when
  s_q == s_kv and "causal_bottom_right" when s_q <= s_kv (no fully masked rows).
- memory-efficient: everything else that SDPA can do. ``attn_mask`` (and a bottom-right causal mask
  with s_q != s_kv) become an additive bias in q's dtype, -finfo.max / 2 where masked, added to a
  post-scale ``attn_bias``; the bias is stored with its last dim padded to a multiple of 16 (the
  kernel's alignment). Rows with every key masked get O = 0 and zero gradients, as the contract says.

GQA / MQA: the kv heads are repeated to h heads and their gradients summed over each group.
Declined (``SUPPORTS``, with the reason): packed "thd", sliding windows, pre-scale bias, ALiBi,
off-by-one and learnable softmax, head dims the kernels cannot align.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.core import Reject

__all__ = ["fused_attn_fwd", "fused_attn_bwd"]

_HALF = (torch.float16, torch.bfloat16)
_BIAS_ALIGN = 16  # the efficient kernel reads the bias in rows padded to 16 elements
_FLASH_MAX_HEAD_DIM = 256
_FLASH_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True, eq=False)
class SdpaCtx:
    """What the backward needs from the forward.

    Attributes:
        kernel: "flash" or "efficient".
        config: the forward's AttentionConfig.
        is_causal: the kernel's causal flag.
        saved: the forward op's extra outputs the backward op takes (lse, rng state, offsets).
        bias: the additive bias given to the efficient kernel (None for none / flash).
        dead_rows: bool [b, h or 1, s_q, 1], rows with every key masked (their output is zeroed).
    """

    kernel: str
    config: AttentionConfig
    is_causal: bool
    saved: Tuple
    bias: Optional[torch.Tensor]
    dead_rows: Optional[torch.Tensor]


@dataclass(frozen=True)
class _Plan:
    """Which kernel runs a call and how its mask is expressed."""

    kernel: str
    is_causal: bool
    causal_in_bias: bool  # bottom-right causal with s_q != s_kv, folded into the bias


def _plan(q, k, v, config: AttentionConfig, attn_mask, attn_bias, capability: Tuple[int, int]) -> _Plan:
    """The kernel for a call the predicate accepted (``capability``: the device's compute capability)."""
    s_q, s_kv = q.shape[1], k.shape[1]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    causal = config.mask_type != "no_mask"
    flash_mask = (not causal) or (config.mask_type == "causal" and s_q == s_kv) or (
        config.mask_type == "causal_bottom_right" and s_q <= s_kv
    )
    flash = (
        q.dtype in _HALF
        and attn_mask is None
        and attn_bias is None
        and flash_mask
        and d_qk == d_v
        and d_qk % 8 == 0
        and d_qk <= _FLASH_MAX_HEAD_DIM
        and tuple(capability) >= _FLASH_MIN_CAPABILITY
    )
    if flash:
        return _Plan("flash", causal, False)
    folded = config.mask_type == "causal_bottom_right" and s_q != s_kv
    return _Plan("efficient", causal and not folded, folded)


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """True, or a Reject naming the argument SDPA cannot take (another backend then runs the call)."""
    if config.qkv_format != "bshd":
        return Reject("qkv_format='thd' (packed sequences): the SDPA kernels take padded bshd batches")
    if config.has_window:
        return Reject(f"window_size={config.window_size}: SDPA has no sliding window")
    if config.bias_type not in ("no_bias", "post_scale_bias"):
        return Reject(f"bias_type={config.bias_type!r}: SDPA adds only a post-scale bias")
    if config.softmax_type != "vanilla":
        return Reject(f"softmax_type={config.softmax_type!r}: SDPA has only the vanilla softmax")
    if q.dtype not in _HALF + (torch.float32,):
        return Reject(f"dtype {q.dtype}: SDPA runs float16, bfloat16 and float32")
    align = 16 // q.element_size()
    if q.shape[-1] % align or v.shape[-1] % align:
        return Reject(f"head dims {q.shape[-1]} / {v.shape[-1]}: the efficient kernel needs multiples of {align} for {q.dtype}")
    if q.device.type != "cuda":
        return Reject(f"inputs are on {q.device.type}, not on a CUDA device")
    return True


def _supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """Only a ctx made by this backend's forward."""
    return True if isinstance(ctx, SdpaCtx) else Reject("ctx was not made by the vendor.cuda fused_attn_fwd")


SUPPORTS = {"fused_attn_fwd": _supports_fwd, "fused_attn_bwd": _supports_bwd}


def _to_heads(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """bshd [b, s, h, d] -> [b, h * group, s, d] (a view unless kv heads are repeated for GQA)."""
    if group > 1:
        x = x.repeat_interleave(group, dim=2)
    return x.transpose(1, 2)


def _from_heads(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[b, h * group, s, d] -> bshd [b, s, h, d], summing each group of repeated kv heads."""
    x = x.transpose(1, 2)
    return x.unflatten(2, (-1, group)).sum(dim=3) if group > 1 else x


def _kernel_bias(q, k, attn_mask, attn_bias, causal_in_bias: bool):
    """(additive bias [b, h, s_q, s_kv] in q's dtype or None, dead rows [b|1, h|1, s_q, 1] or None)."""
    b, s_q, h = q.shape[:3]
    s_kv = k.shape[1]
    masked = None if attn_mask is None else attn_mask.to(torch.bool)
    if causal_in_bias:
        i = torch.arange(s_q, device=q.device)[:, None]
        band = torch.arange(s_kv, device=q.device)[None, :] > i + s_kv - s_q
        masked = band if masked is None else masked | band
    if masked is None and attn_bias is None:
        return None, None
    storage = torch.zeros(b, h, s_q, -(-s_kv // _BIAS_ALIGN) * _BIAS_ALIGN, dtype=q.dtype, device=q.device)
    bias = storage[..., :s_kv]
    if attn_bias is not None:
        bias += attn_bias.to(q.dtype)
    if masked is None:
        return bias, None
    masked = masked.reshape((1,) * (4 - masked.dim()) + tuple(masked.shape))
    bias.masked_fill_(masked, torch.finfo(q.dtype).min / 2)
    dead = masked.all(dim=-1, keepdim=True)
    return bias, (dead if bool(dead.any()) else None)


def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """O = dropout(softmax(S)) V on an SDPA kernel (see the module docstring for which one).

    Args:
        q, k, v: bshd CUDA tensors (k, v with h_kv heads, h % h_kv == 0).
        config: :class:`AttentionConfig` (no window, vanilla softmax, no or post-scale bias).
        attn_mask: bool, broadcastable to [b, h, s_q, s_kv], True = masked out.
        attn_bias: post-scale bias broadcastable to [b, h, s_q, s_kv].
        softmax_offset, alibi_slopes, cu_seqlens_q, cu_seqlens_kv: unused (declined when needed).

    Returns:
        (out bshd in q's dtype with v's head dim, :class:`SdpaCtx`).

    Raises:
        NotImplementedError: arguments this backend declines (the dispatcher never sends those).
    """
    verdict = _supports_fwd(q, k, v, config, attn_mask, attn_bias)
    if not verdict:
        raise NotImplementedError(f"vendor.cuda fused_attn_fwd: {verdict.reason}")
    plan = _plan(q, k, v, config, attn_mask, attn_bias, torch.cuda.get_device_capability(q.device))
    return _forward(q, k, v, config, attn_mask, attn_bias, plan)


def _forward(q, k, v, config: AttentionConfig, attn_mask, attn_bias, plan: _Plan):
    """Run the planned kernel: (out bshd, SdpaCtx)."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = _to_heads(q), _to_heads(k, group), _to_heads(v, group)
    scale, p = config.softmax_scale, config.dropout_p
    if plan.kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, p, plan.is_causal, False, scale=scale)
        out_h, saved, bias, dead = res[0], tuple(res[1:8]), None, None
    else:
        bias, dead = _kernel_bias(q, k, attn_mask, attn_bias, plan.causal_in_bias)
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, bias, True, p, plan.is_causal, scale=scale)
        out_h, saved = res[0], tuple(res[1:4])
    out = _from_heads(out_h)
    if dead is not None:
        out = out.masked_fill(dead.transpose(1, 2), 0.0)
    return out, SdpaCtx(plan.kernel, config, plan.is_causal, saved, bias, dead)


def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """Gradients of :func:`fused_attn_fwd` on the kernel that ran it.

    Args:
        dout: dO, bshd like ``out``.
        q, k, v, out, config and the optional tensors: as given to / returned by the forward.
        ctx: the forward's :class:`SdpaCtx`.

    Returns:
        (dq, dk, dv, dbias reduced to attn_bias's shape or None, None).

    Raises:
        ValueError: ctx from another backend or another config.
    """
    if not isinstance(ctx, SdpaCtx) or ctx.config != config:
        raise ValueError("ctx must come from the vendor.cuda fused_attn_fwd called with the same config")
    group = q.shape[2] // k.shape[2]
    if ctx.dead_rows is not None:
        dout = dout.masked_fill(ctx.dead_rows.transpose(1, 2), 0.0)
    qh, kh, vh = _to_heads(q), _to_heads(k, group), _to_heads(v, group)
    doh, outh = _to_heads(dout.contiguous()), _to_heads(out)  # the forward output's layout
    scale, p = config.softmax_scale, config.dropout_p
    dbias = None
    if ctx.kernel == "flash":
        lse, cum_q, cum_k, max_q, max_k, seed, offset = ctx.saved
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, outh, lse, cum_q, cum_k, max_q, max_k, p, ctx.is_causal, seed, offset, scale=scale
        )
    else:
        lse, seed, offset = ctx.saved
        want_dbias = attn_bias is not None
        dq, dk, dv, dbias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, ctx.bias, outh, lse, seed, offset, p, [True, True, True, want_dbias], ctx.is_causal, scale=scale
        )
        dbias = _reduce_to(dbias, attn_bias) if want_dbias else None
    return _from_heads(dq), _from_heads(dk, group), _from_heads(dv, group), dbias, None


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """grad [b, h, s_q, s_kv] summed over the dims where ``like`` broadcasts, in ``like``'s shape and dtype."""
    shape = (1,) * (4 - like.dim()) + tuple(like.shape)
    dims = tuple(d for d in range(4) if shape[d] == 1 and grad.shape[d] != 1)
    grad = grad.sum(dim=dims, keepdim=True) if dims else grad
    return grad.reshape(like.shape).to(like.dtype)
