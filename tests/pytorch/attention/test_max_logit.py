"""DotProductAttention(return_max_logit=True): (output, max_logit), max_logit [h] the largest attended score of each
head, against a float64 oracle written from TE's definition (max over batch, queries and keys of the masked S)."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.attention._reference import allowed_mask, max_logit
from tests.utils import randn

B, H, D = 3, 4, 8


@pytest.mark.parametrize("mask_type,window,groups,bias", [
    ("no_mask", None, 2, False), ("causal", None, 4, False), ("causal", (2, 0), 4, False), ("padding_causal", None, 1, False),
    ("no_mask", None, 4, True),
])
def test_max_logit_is_the_largest_attended_score(mask_type, window, groups, bias):
    """bshd / sbhd, GQA, causal, sliding window, padding, a post-scale bias; the output is the one without the flag."""
    s = 6
    q, k, v = randn(B, s, H, D), randn(B, s, groups, D), randn(B, s, groups, D)
    q[0, 1, 2] *= 20.0  # one large score: the max must pick it up where it is attended
    kwargs, lens, bias_t = {}, None, None
    if mask_type == "padding_causal":
        lens = [s, 4, 2]
        pad = torch.arange(s)[None, :] >= torch.tensor(lens)[:, None]
        kwargs["attention_mask"] = (pad[:, None, None, :], pad[:, None, None, :])
    if bias:
        bias_t = randn(1, H, s, s)
        kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias_t)
    settings = dict(qkv_format="bshd", attn_mask_type=mask_type, window_size=window, num_gqa_groups=groups)
    plain = te.DotProductAttention(H, D, **settings)
    dpa = te.DotProductAttention(H, D, return_max_logit=True, **settings)
    out, logit = dpa(q, k, v, **kwargs)
    assert torch.equal(out, plain(q, k, v, **kwargs))
    allowed = allowed_mask(B, s, s, mask_type, window or (-1, -1), bottom_right=False, lens_q=lens, lens_kv=lens)
    assert logit.shape == (H,) and logit.dtype == torch.float32 and not logit.requires_grad
    torch.testing.assert_close(logit.double(), max_logit(q, k, allowed, 1 / math.sqrt(D), bias_t), rtol=1e-5, atol=1e-5)


def test_packed_sequences():
    """thd: the max runs over every packed sequence, each causal within itself."""
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    q, k, v = randn(8, H, D), randn(8, H, D), randn(8, H, D)
    dpa = te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal", return_max_logit=True)
    _, logit = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    per_sequence = [max_logit(q[a:b][None], k[a:b][None], allowed_mask(1, n, n, "causal", (-1, -1), bottom_right=False), 1 / math.sqrt(D))
                    for a, b, n in ((0, 5, 5), (5, 8, 3))]
    torch.testing.assert_close(logit.double(), torch.maximum(*per_sequence), rtol=1e-5, atol=1e-5)


def test_kv_caching_is_refused():
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", return_max_logit=True)
    params = te.InferenceParams(max_batch_size=1, max_sequence_length=8, num_heads_kv=H, head_dim_k=D, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="return_max_logit=True.* KV caching"):
        dpa(randn(1, 2, H, D), randn(1, 2, H, D), randn(1, 2, H, D), inference_params=params)


def test_traces_without_graph_breaks():
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", return_max_logit=True)
    q = randn(B, 6, H, D)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(dpa)(q, q, q)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [b.reason for b in explained.break_reasons]


def test_traces_whole_under_torch_compile():
    """The catalog declares attention_max_logit traced: fullgraph, no graph break, the eager values."""
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", return_max_logit=True)
    q, k, v = randn(B, 6, H, D), randn(B, 6, H, D), randn(B, 6, H, D)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(dpa)(q, k, v)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    out, logit = torch.compile(dpa, backend="aot_eager", fullgraph=True)(q, k, v)
    want_out, want_logit = dpa(q, k, v)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(logit, want_logit, rtol=0, atol=0)
    torch._dynamo.reset()
