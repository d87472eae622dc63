"""MultiheadAttention vs torch.nn.MultiheadAttention (shared weights) and vs a float64 composition of its parts."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.attention._reference import allowed_mask, attention, rotate
from tests.utils import dtype_tols, randn

HIDDEN, HEADS, S, B = 32, 4, 6, 2
HN = HIDDEN // HEADS
OUT_TOLS = dict(rtol=1e-5, atol=2e-5)
GRAD_TOLS = dict(rtol=4 * dtype_tols(torch.float32)["rtol"], atol=1e-4)


def _assert_grads(module_a, module_b, names):
    grads_b = dict((n, p.grad) for n, p in module_b.named_parameters())
    grads_a = dict((n, p.grad) for n, p in module_a.named_parameters())
    for name_a, name_b in names.items():
        torch.testing.assert_close(grads_a[name_a], grads_b[name_b], **GRAD_TOLS)


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_matches_torch_multihead_attention(mask_type):
    mha = te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False,
                                attn_mask_type=mask_type)
    ref = torch.nn.MultiheadAttention(HIDDEN, HEADS, bias=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.proj.weight)
        ref.out_proj.bias.copy_(mha.proj.bias)
    x = randn(S, B, HIDDEN).requires_grad_(requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(requires_grad=True)
    out = mha(x)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1) if mask_type == "causal" else None
    want, _ = ref(x_ref, x_ref, x_ref, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(out, want, **OUT_TOLS)
    cot = randn(S, B, HIDDEN)
    out.backward(cot)
    want.backward(cot)
    torch.testing.assert_close(x.grad, x_ref.grad, **GRAD_TOLS)
    _assert_grads(mha, ref, {"qkv.weight": "in_proj_weight", "qkv.bias": "in_proj_bias",
                             "proj.weight": "out_proj.weight", "proj.bias": "out_proj.bias"})


@pytest.mark.parametrize(
    "kwargs,names",
    [
        (dict(), ["qkv.query_weight", "qkv.query_bias", "qkv.key_weight", "qkv.key_bias", "qkv.value_weight",
                  "qkv.value_bias", "proj.weight", "proj.bias"]),
        (dict(input_layernorm=True, fuse_qkv_params=True), ["layernorm_qkv.layer_norm_weight",
         "layernorm_qkv.layer_norm_bias", "layernorm_qkv.weight", "layernorm_qkv.bias", "proj.weight", "proj.bias"]),
        (dict(attention_type="cross", input_layernorm=True), ["layernorm_query.layer_norm_weight",
         "layernorm_query.layer_norm_bias", "layernorm_query.query_weight", "layernorm_query.query_bias",
         "key_value.key_weight", "key_value.key_bias", "key_value.value_weight", "key_value.value_bias",
         "proj.weight", "proj.bias"]),
        (dict(attention_type="cross", fuse_qkv_params=True), ["query_layer.weight", "query_layer.bias",
         "key_value.weight", "key_value.bias", "proj.weight", "proj.bias"]),
        (dict(qk_norm_type="RMSNorm", softmax_type="learnable"), ["qkv.query_weight", "qkv.query_bias",
         "qkv.key_weight", "qkv.key_bias", "qkv.value_weight", "qkv.value_bias", "q_norm.weight", "k_norm.weight",
         "core_attention.softmax_offset", "proj.weight", "proj.bias"]),
    ],
)
def test_te_parameter_names(kwargs, names):
    mha = te.MultiheadAttention(HIDDEN, HEADS, **kwargs)
    assert sorted(n for n, _ in mha.named_parameters()) == sorted(names)
    assert "core_attention._extra_state" in mha.state_dict()


def test_gqa_weight_shapes_and_forward():
    mha = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True)
    shapes = {n: tuple(p.shape) for n, p in mha.named_parameters()}
    assert shapes["layernorm_qkv.query_weight"] == (HIDDEN, HIDDEN)
    assert shapes["layernorm_qkv.key_weight"] == shapes["layernorm_qkv.value_weight"] == (2 * HN, HIDDEN)
    assert mha(randn(S, B, HIDDEN)).shape == (S, B, HIDDEN)


def _interleave_rows(weight, groups, per_group):
    """[Q; K; V] rows -> per kv group [q_0..q_{per_group-1}, k, v] (TE's interleaved fused layout)."""
    q, k, v = weight.split([groups * per_group * HN, groups * HN, groups * HN])
    q = q.reshape(groups, per_group, HN, *weight.shape[1:])
    k, v = (t.reshape(groups, 1, HN, *weight.shape[1:]) for t in (k, v))
    return torch.cat([q, k, v], dim=1).reshape(weight.shape)


@pytest.mark.parametrize("groups", [4, 2])
def test_interleaved_fused_layout(groups):
    plain = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, attention_dropout=0.0, fuse_qkv_params=True,
                                  qkv_weight_interleaved=False)
    inter = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, attention_dropout=0.0, fuse_qkv_params=True,
                                  qkv_weight_interleaved=True)
    with torch.no_grad():
        inter.qkv.weight.copy_(_interleave_rows(plain.qkv.weight, groups, HEADS // groups))
        inter.qkv.bias.copy_(_interleave_rows(plain.qkv.bias, groups, HEADS // groups))
        inter.proj.weight.copy_(plain.proj.weight)
        inter.proj.bias.copy_(plain.proj.bias)
    x = randn(S, B, HIDDEN)
    torch.testing.assert_close(inter(x), plain(x), **OUT_TOLS)


def _norm(t, kind, module, eps):
    t = t.double()
    if kind == "L2Normalization":
        return t / torch.sqrt(t.square().sum(-1, keepdim=True) + eps)
    if kind == "RMSNorm":
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + eps) * module.weight.double()
    mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
    return (t - mean) / torch.sqrt(var + eps) * module.weight.double() + module.bias.double()


def _manual_self_attention(mha, x, freqs, kind, before_rope, groups):
    """float64: split projections -> q/k norm and rope in the configured order -> causal attention -> proj."""
    p = {n: t.double() for n, t in mha.named_parameters()}
    lin = lambda name: x.double() @ p[f"qkv.{name}_weight"].T + p[f"qkv.{name}_bias"]  # noqa: E731
    q, k, v = lin("query").reshape(S, B, HEADS, HN), lin("key").reshape(S, B, groups, HN), lin("value").reshape(S, B, groups, HN)
    positions = torch.arange(S)[:, None]
    norm = lambda t, m: t if kind is None else _norm(t, kind, m, 1e-6)  # noqa: E731
    if before_rope:
        q, k = norm(q, mha.q_norm), norm(k, mha.k_norm)
    if freqs is not None:
        q, k = rotate(q, positions, freqs.shape[-1], interleaved=False), rotate(k, positions, freqs.shape[-1], interleaved=False)
    if not before_rope:
        q, k = norm(q, mha.q_norm), norm(k, mha.k_norm)
    ctx = attention(*(t.transpose(0, 1) for t in (q, k, v)), allowed_mask(B, S, S, "causal", (-1, -1), bottom_right=False),
                    1 / math.sqrt(HN))
    return ctx.transpose(0, 1).reshape(S, B, HIDDEN) @ p["proj.weight"].T + p["proj.bias"]


@pytest.mark.parametrize("kind", [None, "L2Normalization", "RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("before_rope", [False, True])
@pytest.mark.parametrize("groups", [4, 1])
def test_qk_norm_rope_and_gqa(kind, before_rope, groups):
    mha = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, attention_dropout=0.0, qk_norm_type=kind,
                                qk_norm_before_rope=before_rope)
    for norm in (mha.q_norm, mha.k_norm):
        for param in (norm.parameters() if norm is not None else ()):
            with torch.no_grad():
                param.copy_(randn(*param.shape))
    freqs = te.RotaryPositionEmbedding(HN)(S)
    x = randn(S, B, HIDDEN)
    out = mha(x, rotary_pos_emb=freqs)
    torch.testing.assert_close(out.double(), _manual_self_attention(mha, x, freqs, kind, before_rope, groups), **OUT_TOLS)


def test_cross_attention_matches_manual():
    mha = te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, attention_type="cross", attn_mask_type="no_mask",
                                input_layernorm=True)
    x, enc = randn(S, B, HIDDEN), randn(S + 3, B, HIDDEN)
    p = {n: t.double() for n, t in mha.named_parameters()}
    ln = torch.nn.functional.layer_norm(x.double(), (HIDDEN,), p["layernorm_query.layer_norm_weight"],
                                        p["layernorm_query.layer_norm_bias"], 1e-5)
    q = (ln @ p["layernorm_query.query_weight"].T + p["layernorm_query.query_bias"]).reshape(S, B, HEADS, HN)
    k, v = ((enc.double() @ p[f"key_value.{n}_weight"].T + p[f"key_value.{n}_bias"]).reshape(S + 3, B, HEADS, HN)
            for n in ("key", "value"))
    ctx = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    allowed_mask(B, S, S + 3, "no_mask", (-1, -1), bottom_right=True), 1 / math.sqrt(HN))
    want = ctx.transpose(0, 1).reshape(S, B, HIDDEN) @ p["proj.weight"].T + p["proj.bias"]
    torch.testing.assert_close(mha(x, encoder_output=enc).double(), want, **OUT_TOLS)


def test_return_bias_and_layernorm_output():
    mha = te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, input_layernorm=True, return_bias=True,
                                return_layernorm_output=True, qkv_format="bshd")
    x = randn(B, S, HIDDEN)
    out, bias, ln_out = mha(x)
    assert bias.shape == (HIDDEN,) and ln_out.shape == x.shape
    plain = te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, input_layernorm=True, qkv_format="bshd")
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(out + bias, plain(x), **OUT_TOLS)
    want_ln = torch.nn.functional.layer_norm(x, (HIDDEN,), mha.layernorm_qkv.layer_norm_weight,
                                             mha.layernorm_qkv.layer_norm_bias, 1e-5)
    torch.testing.assert_close(ln_out, want_ln, **OUT_TOLS)


def test_cross_attention_needs_encoder_output():
    mha = te.MultiheadAttention(HIDDEN, HEADS, attention_type="cross")
    with pytest.raises(ValueError, match="encoder_output"):
        mha(randn(S, B, HIDDEN))


def test_fused_non_interleaved_qkv_under_tensor_parallelism_holds_each_ranks_heads():
    # [Q; K; V] fused: a rank's heads are [Q_r; K_r; V_r], not one block (the 2-rank runs check the values)
    mha = te.MultiheadAttention(HIDDEN, HEADS, fuse_qkv_params=True, qkv_weight_interleaved=False, set_parallel_mode=True,
                                tp_size=2, num_gqa_groups=2)
    kv = HIDDEN // HEADS * 2
    assert mha.qkv.weight.partition_sections == mha.qkv.bias.partition_sections == (HIDDEN, kv, kv)
    assert mha.qkv.weight.shape == ((HIDDEN + 2 * kv) // 2, HIDDEN) and mha.qkv.weight.device.type != "meta"
    plain = te.MultiheadAttention(HIDDEN, HEADS, fuse_qkv_params=True, qkv_weight_interleaved=True, set_parallel_mode=True, tp_size=2)
    assert not hasattr(plain.qkv.weight, "partition_sections")


@pytest.mark.parametrize("groups,sizes,dim",
                         [((4, 3), (1, 1, 1), -2), ((2, 4), (2, 1, 1), -2), ((4, 2), (2, 1, 1), -3), ((3, 2), (1, 1), -2)])
def test_split_heads_matches_autograd_split(groups, sizes, dim):
    """The q/k/v views equal view + split + reshape of the 5-D view, and so do the gradients (also when a part gets
    none: it contributes zeros); autograd joins them by one split backward of a 2-D split (one concatenation of 2-D
    pieces), no Python node."""
    from transformer_engine.pytorch.attention.multi_head_attention import _split_heads

    head_dim = 8
    mixed = randn(5, 2, groups[0] * groups[1] * head_dim, dtype=torch.float64).requires_grad_()
    ours = _split_heads(mixed, groups, sizes, head_dim, dim)
    expected = tuple(p.reshape(5, 2, -1, head_dim) for p in mixed.view(5, 2, *groups, head_dim).split(sizes, dim=dim))
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))
    node, stack = None, [ours[0].grad_fn]
    while stack and node is None:
        fn = stack.pop()
        node = fn if type(fn).__name__ == "SplitWithSizesBackward0" else None
        stack += [f for f, _ in fn.next_functions if f is not None]
    assert node is not None and len(node._saved_self_sym_sizes) == 2 and node._saved_dim == 1
    weights = [randn(*p.shape, dtype=torch.float64) for p in expected]
    used = range(len(ours) - 1)  # the last part takes no part in the loss
    (grad,) = torch.autograd.grad(sum((ours[i] * weights[i]).sum() for i in used), mixed)
    (want,) = torch.autograd.grad(sum((expected[i] * weights[i]).sum() for i in used), mixed)
    assert torch.equal(grad, want)
