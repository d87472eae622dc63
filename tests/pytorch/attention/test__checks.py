"""Head counts: TransformerLayer, MultiheadAttention and DotProductAttention refuse bad ones before any work."""

from __future__ import annotations

import re

import pytest
import torch

import transformer_engine.pytorch as te


def _tl(hidden, heads, **kw):
    return te.TransformerLayer(hidden, 64, heads, **kw)


def _mha(hidden, heads, **kw):
    return te.MultiheadAttention(hidden, heads, **kw)


def _dpa(hidden, heads, kv_channels=None, **kw):
    return te.DotProductAttention(heads, kv_channels if kv_channels is not None else 16, **kw)


BUILDERS = {"TransformerLayer": _tl, "MultiheadAttention": _mha, "DotProductAttention": _dpa}


@pytest.mark.parametrize("owner", list(BUILDERS))
@pytest.mark.parametrize("heads", [0, -4])
def test_non_positive_head_count_names_the_argument(owner, heads):
    with pytest.raises(ValueError, match=re.escape(f"{owner}: num_attention_heads={heads} must be a positive integer (>= 1)")):
        BUILDERS[owner](64, heads)


@pytest.mark.parametrize("owner", list(BUILDERS))
def test_non_integer_head_count_is_a_type_error(owner):
    with pytest.raises(TypeError, match=re.escape(f"{owner}: num_attention_heads=4.0 must be a positive integer, got float")):
        BUILDERS[owner](64, 4.0)


@pytest.mark.parametrize("owner", list(BUILDERS))
@pytest.mark.parametrize("groups", [0, -2])
def test_non_positive_gqa_groups(owner, groups):
    with pytest.raises(ValueError, match=re.escape(f"{owner}: num_gqa_groups={groups} must be a positive integer (>= 1)")):
        BUILDERS[owner](64, 4, num_gqa_groups=groups)


@pytest.mark.parametrize("owner", list(BUILDERS))
def test_gqa_groups_must_divide_the_heads(owner):
    message = f"{owner}: num_gqa_groups=3 must divide num_attention_heads=4 (each key/value group serves the same number of query heads)"
    with pytest.raises(ValueError, match=re.escape(message)):
        BUILDERS[owner](64, 4, num_gqa_groups=3)


@pytest.mark.parametrize("owner", ["TransformerLayer", "MultiheadAttention"])
@pytest.mark.parametrize("hidden, heads", [(100, 3), (64, 5)])
def test_hidden_not_divisible_by_heads_without_kv_channels(owner, hidden, heads):
    covered = hidden // heads * heads
    message = (f"{owner}: hidden_size={hidden} is not divisible by num_attention_heads={heads} (the heads would cover only "
               f"{covered} of the {hidden} features); choose a head count that divides hidden_size, or pass kv_channels=<head size>")
    with pytest.raises(ValueError, match=re.escape(message)):
        BUILDERS[owner](hidden, heads)


def test_kv_channels_makes_any_head_count_valid_as_in_te():
    layer = te.TransformerLayer(100, 64, 3, kv_channels=32, hidden_dropout=0.0, attention_dropout=0.0)
    assert layer.kv_channels == 32
    assert layer.self_attention.hidden_size_q == 96
    assert layer(torch.randn(5, 2, 100)).shape == (5, 2, 100)
    mha = te.MultiheadAttention(100, 3, kv_channels=20, attention_dropout=0.0)
    assert mha(torch.randn(5, 2, 100)).shape == (5, 2, 100)


@pytest.mark.parametrize("owner", ["TransformerLayer", "MultiheadAttention"])
def test_negative_kv_channels(owner):
    with pytest.raises(ValueError, match=re.escape(f"{owner}: kv_channels=-8 must be a positive integer (>= 1)")):
        BUILDERS[owner](64, 4, kv_channels=-8)


@pytest.mark.parametrize("owner", ["TransformerLayer", "MultiheadAttention"])
def test_non_positive_hidden_size(owner):
    with pytest.raises(ValueError, match=re.escape(f"{owner}: hidden_size=0 must be a positive integer (>= 1)")):
        BUILDERS[owner](0, 4)


@pytest.mark.parametrize("kv_channels", [0, -16, (16, 0), (16,), 16.0])
def test_dot_product_attention_kv_channels(kv_channels):
    message = f"DotProductAttention: kv_channels={kv_channels!r} must be a positive integer (the head size) or a pair of them (d_qk, d_v)"
    if kv_channels == (16,):
        message = "DotProductAttention: kv_channels=(16,) must be an int or a pair (d_qk, d_v)"
    with pytest.raises(ValueError, match=re.escape(message)):
        te.DotProductAttention(4, kv_channels)


def test_dot_product_attention_kv_channel_pair_is_accepted():
    dpa = te.DotProductAttention(4, (16, 8))
    assert (dpa.hidden_size_per_attention_head_k, dpa.hidden_size_per_attention_head_v) == (16, 8)


@pytest.mark.parametrize("owner", list(BUILDERS))
def test_heads_must_split_over_tensor_parallel_ranks(owner):
    message = (f"{owner}: num_attention_heads=6 and num_gqa_groups=6 must both be multiples of tp_size=4 "
               "(each tensor-parallel rank holds whole heads)")
    with pytest.raises(ValueError, match=re.escape(message)):
        BUILDERS[owner](96, 6, tp_size=4)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_attention_dropout_is_a_probability(p):
    with pytest.raises(ValueError, match=re.escape(f"DotProductAttention: attention_dropout={p!r} must be a probability in [0, 1]")):
        te.DotProductAttention(4, 16, attention_dropout=p)


def test_multihead_attention_eps_checks():
    with pytest.raises(ValueError, match=re.escape("MultiheadAttention: layernorm_epsilon=-1.0 must be a finite number >= 0")):
        te.MultiheadAttention(64, 4, input_layernorm=True, layernorm_epsilon=-1.0)
    te.MultiheadAttention(64, 4, input_layernorm=False, layernorm_epsilon=-1.0)  # unused without the input norm
    with pytest.raises(ValueError, match=re.escape("MultiheadAttention: qk_norm_eps=-1e-06 must be a finite number >= 0")):
        te.MultiheadAttention(64, 4, qk_norm_type="RMSNorm", qk_norm_eps=-1e-6)


def test_checks_run_before_any_parameter_is_allocated(monkeypatch):
    """Nothing is allocated when the head count is refused (the check comes first, not after the weights)."""
    calls = []
    original = torch.nn.Module.__init__
    monkeypatch.setattr(torch.nn.Module, "__init__", lambda self, *a, **k: (calls.append(type(self).__name__), original(self, *a, **k))[1])
    for owner, build in BUILDERS.items():
        with pytest.raises(ValueError):
            build(100, 0)
    assert calls == []
