"""KV caching: token-by-token generation through InferenceParams equals the full causal forward."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.pytorch.attention.inference import NonPagedKVCacheManager

HIDDEN, HEADS, GROUPS, B, S = 32, 4, 2, 2, 9
HN = HIDDEN // HEADS
TOLS = dict(rtol=1e-5, atol=2e-5)


def _params(fmt="bshd", paged=False, batch=B):
    kwargs = dict(is_paged=True, page_size=4, total_num_pages=batch * 3) if paged else {}
    return te.InferenceParams(batch, 12, num_heads_kv=GROUPS, head_dim_k=HN, dtype=torch.float32, qkv_format=fmt,
                              max_ctx_len=12 if fmt == "thd" else None, **kwargs)


def _mha(fmt):
    return te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, input_layernorm=True,
                                 qkv_format=fmt, layer_number=3).eval()


def _step(params, model, chunk, freqs, lens, fmt):
    """Feed chunk [b, n, hidden] (bshd order) holding lens[i] new tokens of sequence i; returns bshd outputs."""
    params.pre_step(OrderedDict((i, n) for i, n in enumerate(lens)))
    if fmt == "sbhd":
        return model(chunk.transpose(0, 1), inference_params=params, rotary_pos_emb=freqs).transpose(0, 1)
    if fmt == "thd":
        packed = torch.cat([chunk[i, :n] for i, n in enumerate(lens)])
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        out = model(packed, inference_params=params, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return torch.stack([out[int(cu[i])] for i in range(len(lens))])[:, None]
    return model(chunk, inference_params=params, rotary_pos_emb=freqs)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("paged", [False, True])
def test_generation_equals_full_forward(fmt, paged):
    model = _mha("bshd")
    freqs = te.RotaryPositionEmbedding(HN)(12)
    x = randn(B, S, HIDDEN)
    with torch.no_grad():
        full = model(x, rotary_pos_emb=freqs)
        incremental = _mha(fmt)
        incremental.load_state_dict(model.state_dict())
        params = _params(fmt, paged)
        prompt = 4
        out = _step(params, incremental, x[:, :prompt], freqs, [prompt] * B, fmt)
        if fmt != "thd":
            torch.testing.assert_close(out, full[:, :prompt], **TOLS)
        for t in range(prompt, S):
            out = _step(params, incremental, x[:, t : t + 1], freqs, [1] * B, fmt)
            torch.testing.assert_close(out[:, 0], full[:, t], **TOLS)


def test_prompts_of_different_lengths():
    """Prompts of 3 and 5 tokens padded to 5, then one token each: the new tokens sit at positions 3 and 5."""
    model = _mha("bshd")
    freqs = te.RotaryPositionEmbedding(HN)(12)
    x = randn(B, S, HIDDEN)
    with torch.no_grad():
        full = model(x, rotary_pos_emb=freqs)
        params = _params()
        prompt = torch.zeros(B, 5, HIDDEN)
        prompt[0, :3], prompt[1] = x[0, :3], x[1, :5]
        out = _step(params, model, prompt, freqs, [3, 5], "bshd")
        torch.testing.assert_close(out[0, :3], full[0, :3], **TOLS)
        torch.testing.assert_close(out[1], full[1, :5], **TOLS)
        assert torch.all(out[0, 3:] == 0), "padded query positions give zeros"
        nxt = torch.stack([x[0, 3], x[1, 5]])[:, None]
        out = _step(params, model, nxt, freqs, [1, 1], "bshd")
        torch.testing.assert_close(out[:, 0], torch.stack([full[0, 3], full[1, 5]]), **TOLS)


@pytest.mark.parametrize("paged", [False, True])
def test_finished_sequences_leave_the_batch(paged):
    model = _mha("bshd")
    freqs = te.RotaryPositionEmbedding(HN)(12)
    x = randn(3, S, HIDDEN)
    with torch.no_grad():
        full = model(x, rotary_pos_emb=freqs)
        params = _params(paged=paged, batch=3)
        _step(params, model, x[:, :4], freqs, [4, 4, 4], "bshd")
        params.pre_step(OrderedDict([(0, 1), (2, 1)]))  # sequence 1 is done
        out = model(x[[0, 2], 4:5], inference_params=params, rotary_pos_emb=freqs)
        torch.testing.assert_close(out[:, 0], full[[0, 2], 4], **TOLS)
        assert list(params.sequences.items()) == [(0, 5), (2, 5)]


def test_transformer_layer_generation():
    layer = te.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_number=1, attn_input_format="bshd").eval()
    x = randn(B, S, HIDDEN)
    with torch.no_grad():
        full = layer(x)
        params = _params()
        params.pre_step(OrderedDict((i, 5) for i in range(B)))
        torch.testing.assert_close(layer(x[:, :5], inference_params=params), full[:, :5], **TOLS)
        for t in range(5, S):
            params.pre_step(OrderedDict((i, 1) for i in range(B)))
            torch.testing.assert_close(layer(x[:, t : t + 1], inference_params=params)[:, 0], full[:, t], **TOLS)


def test_bookkeeping():
    params = _params(batch=3)
    params.pre_step(OrderedDict([(7, 3), (8, 5)]))
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 8] and params.cu_seqlens_kv.tolist() == [0, 3, 8, 8]
    params.pre_step(OrderedDict([(7, 1), (8, 1), (9, 2)]))
    assert params.get_seqlens_pre_step().tolist() == [3, 5, 0]
    assert params.cu_seqlens_kv.tolist() == [0, 4, 10, 12]
    params.reset()
    assert not params.sequences


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_heads_kv=None), "num_heads_kv"),
        (dict(qkv_format="thd"), "max_ctx_len"),
        (dict(is_paged=True, page_size=5, total_num_pages=4), "page_size"),
        (dict(is_paged=True, page_size=4, total_num_pages=5), "total_num_pages"),
    ],
)
def test_errors(kwargs, match):
    base = dict(num_heads_kv=GROUPS, head_dim_k=HN, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        te.InferenceParams(2, 12, **{**base, **kwargs})


def test_custom_cache_manager_class_is_used():
    class Counting(NonPagedKVCacheManager):
        steps = 0

        def step(self, *args):
            Counting.steps += 1
            return super().step(*args)

    params = te.InferenceParams(1, 8, num_heads_kv=GROUPS, head_dim_k=HN, dtype=torch.float32, custom_cache_manager=Counting)
    model = _mha("bshd")
    params.pre_step(OrderedDict([(0, 2)]))
    with torch.no_grad():
        model(randn(1, 2, HIDDEN), inference_params=params)
    assert Counting.steps == 1
