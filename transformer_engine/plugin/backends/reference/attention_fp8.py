"""Reference (pure PyTorch) FP8 attention: the math of plugin/catalog/attention_fp8.py, whole rows at a time.

Every product is float32 on the dequantized FP8 values (exact: an FP8 value times a float32 scale), so only the
catalog's casts round: P8 (with the row maximum of all keys: no tiles), O8, dS8 and the gradients. GQA repeats each kv
head over its query group in forward and sums the group's dK, dV in backward.
"""

from __future__ import annotations

import torch

from transformer_engine.plugin.catalog.attention_fp8 import fp8_attention_error

from .._fp8 import amax_finite, check_fp8_tensor, saturating_cast, scalar_f32

__all__ = ["fused_attn_fp8_fwd", "fused_attn_fp8_bwd"]


def _check(q, k, v, config) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_fp8_tensor(t, name)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one FP8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    error = fp8_attention_error(q, k, v, config)
    if error:
        raise ValueError(error)


def _heads_first(x: torch.Tensor, descale: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[b, s, h, d] FP8 -> float32 [b, h * group, s, d] dequantized (each head repeated ``group`` times)."""
    x = (x.float() * descale).transpose(1, 2)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _scores(qf: torch.Tensor, kf: torch.Tensor, config) -> torch.Tensor:
    """S [b, h, s_q, s_kv] float32 from dequantized heads-first q and k (:func:`_heads_first`), masked entries -inf."""
    s = config.softmax_scale * torch.matmul(qf, kf.transpose(-1, -2))
    if config.mask_type == "causal":
        s_q, s_kv = s.shape[-2:]
        s = s.masked_fill(torch.ones(s_q, s_kv, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """[b, h_kv * group, s, d] -> [b, h_kv, s, d], summed over each kv head's query group."""
    return x if group == 1 else x.unflatten(1, (-1, group)).sum(dim=2)


def _to_bshd_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 [b, h, s, d] -> FP8 [b, s, h, d] contiguous, fp8(x * scale)."""
    return saturating_cast(x * scale, fp8_dtype).transpose(1, 2).contiguous()


def fused_attn_fp8_fwd(q, k, v, qkv_scale_inv, s_scale, o_scale, config):
    """See plugin/catalog/attention_fp8.py."""
    _check(q, k, v, config)
    descale, s_scale_f, o_scale_f = (scalar_f32(t, n) for t, n in ((qkv_scale_inv, "qkv_scale_inv"), (s_scale, "s_scale"),
                                                                      (o_scale, "o_scale")))
    group = q.shape[2] // k.shape[2]
    s = _scores(_heads_first(q, descale), _heads_first(k, descale, group), config)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m).nan_to_num(0.0)  # a fully masked row (m = -inf) gives 0
    l = p.sum(dim=-1, keepdim=True)
    p8 = saturating_cast(p * s_scale_f, q.dtype).float() / s_scale_f
    o = torch.matmul(p8, _heads_first(v, descale, group)) / l.clamp(min=torch.finfo(torch.float32).tiny)
    o = torch.where(l > 0, o, torch.zeros_like(o))
    stats = (m + torch.log(l)).squeeze(-1)
    return _to_bshd_fp8(o, o_scale_f, q.dtype), stats, amax_finite(p), amax_finite(o)


def fused_attn_fp8_bwd(dout, q, k, v, out, stats, qkv_scale_inv, out_scale_inv, dout_scale_inv, s_scale, dp_scale, dqkv_scale,
                       config):
    """See plugin/catalog/attention_fp8.py."""
    _check(q, k, v, config)
    check_fp8_tensor(dout, "dout")
    check_fp8_tensor(out, "out")
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    names = ("qkv_scale_inv", "out_scale_inv", "dout_scale_inv", "s_scale", "dp_scale", "dqkv_scale")
    descale, o_descale, do_descale, s_scale_f, dp_scale_f, dqkv_scale_f = (
        scalar_f32(t, n) for t, n in zip((qkv_scale_inv, out_scale_inv, dout_scale_inv, s_scale, dp_scale, dqkv_scale), names))
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = _heads_first(q, descale), _heads_first(k, descale, group), _heads_first(v, descale, group)
    p = torch.exp(_scores(qf, kf, config) - stats.float().unsqueeze(-1)).nan_to_num(0.0)
    p8 = saturating_cast(p * s_scale_f, q.dtype).float() / s_scale_f
    do, o = _heads_first(dout, do_descale), _heads_first(out, o_descale)
    dv = torch.matmul(p8.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
    ds8 = saturating_cast(ds * dp_scale_f, dout.dtype).float() / dp_scale_f
    dq = config.softmax_scale * torch.matmul(ds8, kf)
    dk = config.softmax_scale * torch.matmul(ds8.transpose(-1, -2), qf)
    dk, dv = _group_sum(dk, group), _group_sum(dv, group)
    amax_dqkv = torch.stack([amax_finite(t) for t in (dq, dk, dv)]).amax()
    grads = (_to_bshd_fp8(t, dqkv_scale_f, dout.dtype) for t in (dq, dk, dv))
    return (*grads, amax_dqkv, amax_finite(ds))
