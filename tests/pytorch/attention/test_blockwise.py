"""Blockwise attention (keys split into blocks, merged by their log-sum-exp) against plain attention in float64.

float32 blocks (the reference backend on the CPU) against float64 math: the merge and the split sums differ from
one softmax in the last bits of O(1) values, so atol = rtol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch.attention.blockwise import blockwise_attention
from transformer_engine.pytorch.attention.context_parallel import CPAttention

TOL = dict(atol=1e-5, rtol=1e-5)


def _plain(q, k, v, scale: float, shift: int):
    """float64 softmax attention, key j hidden from query i where j > i + shift (bottom-right causal); GQA by repeat."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    scores = scale * qh @ kh.transpose(-1, -2)
    i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    return (scores.masked_fill(j > i + shift, float("-inf")).softmax(-1) @ vh).transpose(1, 2)


@pytest.mark.parametrize("length, before", [(4, 8), (5, 0)])
def test_blocks_equal_one_bottom_right_causal_attention(length, before):
    """A query chunk of ``length`` rows over ``before`` earlier keys and its own diagonal block, and over its
    diagonal alone."""
    torch.manual_seed(0)
    settings = CPAttention(causal=True, window_size=(-1, 0), softmax_scale=0.3)
    q = torch.randn(2, length, 4, 8, requires_grad=True)
    k, v = (torch.randn(2, before + length, 2, 8, requires_grad=True) for _ in range(2))
    blocks = ([(slice(0, before), "no_mask")] if before else []) + [(slice(before, before + length), "causal")]
    out = blockwise_attention(q, k, v, blocks, settings)
    want = _plain(q, k, v, 0.3, before)
    torch.testing.assert_close(out.double(), want, **TOL)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        torch.testing.assert_close(g.double(), w.double(), **TOL, msg=lambda m: f"{name}: {m}")
