"""Reference attention blocks (``attention_block_fwd`` / ``_bwd``): one block is the fused attention, blocks over
split keys merge to the whole attention, and its gradients are the blocks' summed shares.

float32 on the CPU: the block and the whole attention compute the same sums in other orders (the merge's
rescaling, the split of the key sums), a few ulp of O(1) values, so atol = rtol = 1e-5. ``merge_blocks`` and
``check_split_keys`` serve the vendor backend's GPU tests too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin.backends.reference import attention_block as block
from transformer_engine.plugin.backends.reference.attention import fused_attn_bwd, fused_attn_fwd
from transformer_engine.plugin.catalog.attention import AttentionConfig

CONFIG = AttentionConfig(softmax_scale=0.25)
TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b=2, s_q=6, s_kv=10, h=4, h_kv=2, d=8, dtype=torch.float32, device="cpu"):
    return (randn(b, s_q, h, d, dtype=dtype, device=device), randn(b, s_kv, h_kv, d, dtype=dtype, device=device),
            randn(b, s_kv, h_kv, d, dtype=dtype, device=device))


def merge_blocks(fwd, q, k, v, config, cut: int, bias=None):
    """(out, lse, ctxs) of ``fwd`` over keys [0, cut) and [cut, s_kv) merged: lse = logaddexp, O = sum exp(lse_i - lse) O_i."""
    parts = [(slice(0, cut), None if bias is None else bias[..., :cut]),
             (slice(cut, k.shape[1]), None if bias is None else bias[..., cut:])]
    results = [fwd(q, k[:, keys], v[:, keys], config, attn_bias=part_bias) for keys, part_bias in parts]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l, _ in results)
    return out.to(q.dtype), lse, [ctx for _, _, ctx in results], parts


def check_split_keys(fwd, bwd, q, k, v, config, cut: int, tol, bias=None):
    """Blocks over split keys, merged, equal the reference fused attention; their backward shares sum to its gradients."""
    dout = torch.randn_like(q[..., : v.shape[-1]])
    out, lse, ctxs, parts = merge_blocks(fwd, q, k, v, config, cut, bias)
    whole_config = dataclasses.replace(config, bias_type="no_bias" if bias is None else "post_scale_bias")
    want, whole_ctx = fused_attn_fwd(q.float(), k.float(), v.float(), whole_config, attn_bias=bias)
    torch.testing.assert_close(out.float(), want, **tol)
    dq, dk, dv, dbias, _ = fused_attn_bwd(dout.float(), q.float(), k.float(), v.float(), want, whole_ctx, whole_config, attn_bias=bias)
    shares = [bwd(dout, q, k[:, keys], v[:, keys], out, lse, ctx, config, attn_bias=part_bias) for (keys, part_bias),
              ctx in zip(parts, ctxs)]
    torch.testing.assert_close((shares[0][0].float() + shares[1][0].float()), dq, **tol)
    torch.testing.assert_close(torch.cat([s[1] for s in shares], dim=1).float(), dk, **tol)
    torch.testing.assert_close(torch.cat([s[2] for s in shares], dim=1).float(), dv, **tol)
    if bias is not None:
        torch.testing.assert_close(torch.cat([s[3] for s in shares], dim=-1), dbias.float(), **tol)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_block_is_the_fused_attention(mask_type, with_bias):
    q, k, v = _qkv()
    config = dataclasses.replace(CONFIG, mask_type=mask_type, bias_type="post_scale_bias" if with_bias else "no_bias")
    bias = randn(1, 4, 6, 10) if with_bias else None
    hidden = torch.zeros(6, 10, dtype=torch.bool)
    hidden[1, 2:5] = True
    out, lse, ctx = block.attention_block_fwd(q, k, v, config, attn_mask=hidden, attn_bias=bias)
    want, want_ctx = fused_attn_fwd(q, k, v, config, attn_mask=hidden, attn_bias=bias)
    torch.testing.assert_close(out, want, **TOL)
    scores = 0.25 * q.transpose(1, 2) @ k.repeat_interleave(2, dim=2).permute(0, 2, 3, 1) + (0 if bias is None else bias)
    masked = torch.ones(6, 10).triu(1).bool() if mask_type == "causal" else torch.ones(6, 10).triu(5).bool()
    scores = scores.masked_fill(hidden | (masked if mask_type != "no_mask" else torch.zeros_like(hidden)), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **TOL)
    dout = torch.randn_like(out)
    got = block.attention_block_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=hidden, attn_bias=bias)
    expected = fused_attn_bwd(dout, q, k, v, want, want_ctx, config, attn_mask=hidden, attn_bias=bias)
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected):
        if e is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, e, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_over_split_keys_merge_to_the_whole(with_bias):
    q, k, v = _qkv()
    config = dataclasses.replace(CONFIG, bias_type="post_scale_bias") if with_bias else CONFIG
    check_split_keys(block.attention_block_fwd, block.attention_block_bwd, q, k, v, config, cut=3, tol=TOL,
                     bias=randn(2, 1, 6, 10) if with_bias else None)


def test_a_row_without_keys_has_lse_minus_inf_and_no_gradient():
    q, k, v = _qkv(s_q=2, s_kv=3)
    hidden = torch.tensor([[True, True, True], [False, True, False]])
    out, lse, ctx = block.attention_block_fwd(q, k, v, CONFIG, attn_mask=hidden)
    assert torch.isneginf(lse[:, :, 0]).all() and torch.isfinite(lse[:, :, 1]).all()
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    dq, dk, dv, _ = block.attention_block_bwd(torch.ones_like(out), q, k, v, out, lse, ctx, CONFIG, attn_mask=hidden)
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0])) and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_dropout_backward_regenerates_the_forward_mask():
    """dV = (P M / (1 - p))^T dO, so sum(dV * V) = sum(dO * O) with the forward's mask M, and no other."""
    q, k, v = _qkv()
    config = dataclasses.replace(CONFIG, dropout_p=0.5)
    torch.manual_seed(3)
    out, lse, ctx = block.attention_block_fwd(q, k, v, config)
    dout = torch.randn_like(out)
    _, _, dv, _ = block.attention_block_bwd(dout, q, k, v, out, lse, ctx, config)
    torch.testing.assert_close((dv * v).sum(), (dout * out).sum(), **TOL)


@pytest.mark.parametrize("change, message", [
    (dict(qkv_format="thd"), "qkv_format='bshd'"),
    (dict(softmax_type="off-by-one"), "softmax_type='vanilla'"),
    (dict(bias_type="pre_scale_bias"), "post_scale_bias"),
])
def test_refuses_what_blocks_do_not_take(change, message):
    with pytest.raises(ValueError, match=message):
        block.attention_block_fwd(*_qkv(), dataclasses.replace(CONFIG, **change))


def test_backward_takes_only_its_forwards_ctx():
    q, k, v = _qkv()
    out, lse, ctx = block.attention_block_fwd(q, k, v, CONFIG)
    with pytest.raises(ValueError, match="same config"):
        block.attention_block_bwd(out, q, k, v, out, lse, ctx, dataclasses.replace(CONFIG, mask_type="causal"))
    with pytest.raises(ValueError, match="ctx must come from"):
        block.attention_block_bwd(out, q, k, v, out, lse, object(), CONFIG)
