"""Reference fused attention vs an explicit float64 softmax(S) V, forward and (through autograd) backward."""

import dataclasses
import math

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends._dropout_mask import unpack_keep
from transformer_engine.plugin.backends.reference.attention import fused_attn_bwd, fused_attn_fwd
from transformer_engine.plugin.catalog.attention import AttentionConfig

# Gradients sum s_q (or s_q x group) products of fp32 roundings: allow 4x the fp32 table.
_FP32_GRAD_TOLS = dict(rtol=4 * dtype_tols(torch.float32)["rtol"], atol=4 * dtype_tols(torch.float32)["atol"])


def _allowed(config, s_q, s_kv):
    """bool [s_q, s_kv], True = attended, written element by element from the catalog's rules."""
    left, right = config.window_size
    rows = []
    for i in range(s_q):
        diag = i + s_kv - s_q
        row = []
        for j in range(s_kv):
            ok = not (config.mask_type == "causal" and j > i)
            ok = ok and not (config.mask_type == "causal_bottom_right" and j > diag)
            ok = ok and not (left >= 0 and j < diag - left) and not (right >= 0 and j > diag + right)
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def _oracle(q, k, v, config, extras=None, keep=None):
    """float64 O of bshd q [b, s_q, h, d], k/v [b, s_kv, h_kv, d]; differentiable in q, k, v and extras.

    extras: dict with optional attn_mask, attn_bias, softmax_offset, alibi_slopes (as for the op).
    """
    extras = extras or {}
    b, s_q, h, _ = q.shape
    s_kv, group = k.shape[1], h // k.shape[2]
    heads = [n // group for n in range(h)]
    qh, kh, vh = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)[:, heads], v.permute(0, 2, 1, 3)[:, heads]
    s = torch.einsum("bhid,bhjd->bhij", qh, kh)
    if config.bias_type == "pre_scale_bias":
        s = (s + extras["attn_bias"]) * config.softmax_scale
    elif config.bias_type == "post_scale_bias":
        s = s * config.softmax_scale + extras["attn_bias"]
    elif config.bias_type == "alibi":
        i, j = torch.meshgrid(torch.arange(s_q), torch.arange(s_kv), indexing="ij")
        slopes = extras["alibi_slopes"].double().reshape(-1, h, 1, 1)
        s = s * config.softmax_scale - slopes * (i + s_kv - s_q - j).abs().double()
    else:
        s = s * config.softmax_scale
    allowed = _allowed(config, s_q, s_kv).expand(b, h, s_q, s_kv)
    if extras.get("attn_mask") is not None:
        allowed = allowed & ~extras["attn_mask"]
    w = torch.exp(s) * allowed
    denom = w.sum(-1, keepdim=True)
    if config.softmax_type == "off-by-one":
        denom = denom + 1.0
    elif config.softmax_type == "learnable":
        denom = denom + torch.exp(extras["softmax_offset"].reshape(1, h, 1, 1))
    p = w / denom.clamp_min(1e-300)
    if keep is not None:
        p = p * keep / (1.0 - config.dropout_p)
    return torch.einsum("bhij,bhjd->bihd", p, vh)


def _inputs(b, s_q, s_kv, h, h_kv, d, d_v, dtype=torch.float32):
    return randn(b, s_q, h, d, dtype=dtype), randn(b, s_kv, h_kv, d, dtype=dtype), randn(b, s_kv, h_kv, d_v, dtype=dtype)


def _extras_for(config, b, h, s_q, s_kv):
    extras = {}
    if config.bias_type in ("pre_scale_bias", "post_scale_bias"):
        extras["attn_bias"] = randn(1, h, s_q, s_kv)
    if config.bias_type == "alibi":
        extras["alibi_slopes"] = torch.rand(b, h) + 0.1
    if config.softmax_type == "learnable":
        extras["softmax_offset"] = randn(h)
    return extras


def _check_against_oracle(q, k, v, config, extras, fwd_tols, bwd_tols):
    """Forward vs the float64 oracle, and every gradient vs autograd through it."""
    out, ctx = fused_attn_fwd(q, k, v, config, **extras)
    inputs = dict(q=q, k=k, v=v, **extras)
    leaves = {name: t.double().requires_grad_() for name, t in inputs.items() if t.is_floating_point() and name != "alibi_slopes"}
    ref = _oracle(leaves["q"], leaves["k"], leaves["v"], config, {name: leaves.get(name, t) for name, t in extras.items()})
    assert out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    torch.testing.assert_close(out.double(), ref.detach(), **fwd_tols)
    dout = randn(*out.shape, dtype=q.dtype)
    ref.backward(dout.double())
    dq, dk, dv, dbias, doffset = fused_attn_bwd(dout, q, k, v, out, ctx, config, **extras)
    got = dict(q=dq, k=dk, v=dv, attn_bias=dbias, softmax_offset=doffset)
    for name, leaf in leaves.items():
        assert got[name].dtype == inputs[name].dtype and got[name].shape == inputs[name].shape
        torch.testing.assert_close(got[name].double(), leaf.grad, **bwd_tols, msg=lambda m: f"d{name}: {m}")
    if "attn_bias" not in extras:
        assert dbias is None
    if "softmax_offset" not in extras:
        assert doffset is None


_CASES = [
    dict(mask_type="no_mask"),
    dict(mask_type="causal"),
    dict(mask_type="causal_bottom_right"),
    dict(mask_type="no_mask", window_size=(2, 0)),
    dict(mask_type="no_mask", window_size=(-1, 1)),
    dict(mask_type="causal_bottom_right", window_size=(3, -1)),
    dict(softmax_type="off-by-one"),
    dict(softmax_type="learnable", mask_type="causal"),
    dict(bias_type="pre_scale_bias"),
    dict(bias_type="post_scale_bias", mask_type="causal_bottom_right"),
    dict(bias_type="alibi", mask_type="causal_bottom_right"),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(str(x) for x in c.values()))
@pytest.mark.parametrize("s_q,s_kv", [(7, 11), (5, 5), (1, 3)])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (3, 1)])
def test_fp32_matches_float64_formula(case, s_q, s_kv, h, h_kv):
    d = 8
    config = AttentionConfig(softmax_scale=1.0 / math.sqrt(d), **case)
    q, k, v = _inputs(2, s_q, s_kv, h, h_kv, d, 5)
    extras = _extras_for(config, 2, h, s_q, s_kv)
    _check_against_oracle(q, k, v, config, extras, dtype_tols(torch.float32), _FP32_GRAD_TOLS)


@pytest.mark.parametrize("case", [dict(mask_type="causal"), dict(bias_type="post_scale_bias", softmax_type="learnable")])
def test_bf16_rounds_the_float32_result_once(case):
    config = AttentionConfig(softmax_scale=0.3, **case)
    q, k, v = _inputs(3, 9, 13, 4, 2, 16, 16, dtype=torch.bfloat16)
    extras = {name: t.to(torch.bfloat16) for name, t in _extras_for(config, 3, 4, 9, 13).items()}
    tols = dtype_tols(torch.bfloat16)
    _check_against_oracle(q, k, v, config, extras, tols, tols)


def test_broadcast_mask_bias_and_fully_masked_rows_give_zeros():
    b, s_q, s_kv, h = 2, 6, 7, 3
    config = AttentionConfig(softmax_scale=0.4, bias_type="post_scale_bias")
    q, k, v = _inputs(b, s_q, s_kv, h, h, 8, 8)
    attn_mask = torch.rand(b, 1, s_q, s_kv) < 0.3
    attn_mask[0, 0, 2] = True  # a fully masked row: zero output, zero gradients, no NaN
    extras = dict(attn_mask=attn_mask, attn_bias=randn(b, 1, 1, s_kv))
    _check_against_oracle(q, k, v, config, extras, dtype_tols(torch.float32), _FP32_GRAD_TOLS)
    out, ctx = fused_attn_fwd(q, k, v, config, **extras)
    grads = fused_attn_bwd(randn(*out.shape), q, k, v, out, ctx, config, **extras)
    assert torch.all(out[0, 2] == 0) and torch.all(grads[0][0, 2] == 0)
    assert all(torch.isfinite(g).all() for g in grads[:4])


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
def test_rows_with_no_key_give_zeros(softmax_type):
    config = AttentionConfig(softmax_scale=0.5, mask_type="causal_bottom_right", softmax_type=softmax_type)
    q, k, v = _inputs(1, 5, 3, 2, 2, 4, 4)  # bottom-right causal with s_q > s_kv: rows 0, 1 see no key
    out, ctx = fused_attn_fwd(q, k, v, config)
    dq, dk, dv, _, _ = fused_attn_bwd(randn(*out.shape), q, k, v, out, ctx, config)
    ref = _oracle(q.double(), k.double(), v.double(), config)
    torch.testing.assert_close(out.double(), ref, **dtype_tols(torch.float32))
    assert torch.all(out[:, :2] == 0) and torch.all(dq[:, :2] == 0) and torch.isfinite(dk).all()


def _pack(seqs):
    return torch.cat(seqs, dim=0), torch.tensor([0] + list(torch.tensor([len(s) for s in seqs]).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize(
    "case",
    [
        dict(mask_type="causal_bottom_right", bias_type="alibi"),
        dict(mask_type="causal", softmax_type="learnable"),
        dict(bias_type="post_scale_bias", window_size=(2, 1)),
        dict(bias_type="pre_scale_bias", dropout_p=0.0),
    ],
)
def test_thd_equals_bshd_per_sequence(case):
    lens_q, lens_kv, h, h_kv, d = [3, 1, 6], [5, 2, 6], 4, 2, 8
    config = AttentionConfig(softmax_scale=0.35, qkv_format="thd", **case)
    bshd = dataclasses.replace(config, qkv_format="bshd")
    qs = [randn(n, h, d) for n in lens_q]
    ks, vs = [randn(n, h_kv, d) for n in lens_kv], [randn(n, h_kv, d) for n in lens_kv]
    (q, cu_q), (k, cu_kv), (v, _) = _pack(qs), _pack(ks), _pack(vs)
    q = torch.cat([q, randn(2, h, d)])  # padding rows after the last sequence
    extras = _extras_for(config, 3, h, max(lens_q), max(lens_kv))
    if "attn_bias" in extras:
        extras["attn_bias"] = randn(3, h, max(lens_q), max(lens_kv))
    out, ctx = fused_attn_fwd(q, k, v, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **extras)
    dout = randn(*out.shape)
    grads = fused_attn_bwd(dout, q, k, v, out, ctx, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **extras)
    assert torch.all(out[cu_q[-1]:] == 0) and torch.all(grads[0][cu_q[-1]:] == 0)
    doffset_sum = 0
    for i in range(3):
        rq, rkv = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_kv[i]), int(cu_kv[i + 1]))
        seq_extras = dict(extras)
        if "attn_bias" in extras:
            seq_extras["attn_bias"] = extras["attn_bias"][i : i + 1, :, : lens_q[i], : lens_kv[i]]
        if "alibi_slopes" in extras:
            seq_extras["alibi_slopes"] = extras["alibi_slopes"][i]
        one = fused_attn_fwd(q[None, rq], k[None, rkv], v[None, rkv], bshd, **seq_extras)
        g = fused_attn_bwd(dout[None, rq], q[None, rq], k[None, rkv], v[None, rkv], one[0], one[1], bshd, **seq_extras)
        torch.testing.assert_close(out[rq], one[0][0], **dtype_tols(torch.float32))
        for got, want, rows in ((grads[0], g[0], rq), (grads[1], g[1], rkv), (grads[2], g[2], rkv)):
            torch.testing.assert_close(got[rows], want[0], **dtype_tols(torch.float32))
        if g[3] is not None:
            torch.testing.assert_close(grads[3][i : i + 1, :, : lens_q[i], : lens_kv[i]], g[3], **dtype_tols(torch.float32))
        doffset_sum = doffset_sum + (g[4] if g[4] is not None else 0)
    if "softmax_offset" in extras:
        torch.testing.assert_close(grads[4], doffset_sum, **_FP32_GRAD_TOLS)
    if "attn_bias" in extras:  # padding entries of the [b, h, max_sq, max_skv] bias get no gradient
        covered = torch.zeros(grads[3].shape, dtype=torch.bool)
        for i in range(3):
            covered[i, :, : lens_q[i], : lens_kv[i]] = True
        assert torch.all(grads[3][~covered] == 0)


def test_dropout_mask_statistics_and_consistency():
    p = 0.3
    config = AttentionConfig(softmax_scale=0.3, dropout_p=p, mask_type="causal")
    q, k, v = _inputs(2, 31, 37, 4, 2, 8, 6)
    out, ctx = fused_attn_fwd(q, k, v, config)
    (mask,) = ctx.keep_masks
    keep = unpack_keep(mask, (2, 4, 31, 37))  # the packed mask of dropout_fwd
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _oracle(*leaves, config, keep=keep)
    torch.testing.assert_close(out.double(), ref.detach(), **dtype_tols(torch.float32))
    dout = randn(*out.shape)
    ref.backward(dout.double())
    grads = fused_attn_bwd(dout, q, k, v, out, ctx, config)
    for got, leaf in zip(grads[:3], leaves):
        torch.testing.assert_close(got.double(), leaf.grad, **_FP32_GRAD_TOLS)


def test_dropout_uses_the_default_generator():
    config = AttentionConfig(softmax_scale=0.3, dropout_p=0.5)
    q, k, v = _inputs(1, 5, 7, 2, 2, 4, 4)
    torch.manual_seed(123)
    first, _ = fused_attn_fwd(q, k, v, config)
    second, _ = fused_attn_fwd(q, k, v, config)
    torch.manual_seed(123)
    again, _ = fused_attn_fwd(q, k, v, config)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dispatch_through_ops_runs_reference():
    config = AttentionConfig(softmax_scale=0.25, mask_type="causal", softmax_type="off-by-one")
    q, k, v = _inputs(2, 5, 5, 2, 1, 16, 8)
    zero_offset = torch.zeros(1, 2, 1, 1)  # TE passes a zero buffer for off-by-one: accepted, ignored
    (out, ctx), impl = ops.fused_attn_fwd.traced(q, k, v, config, softmax_offset=zero_offset)
    assert impl.impl_id == "reference.torch"
    torch.testing.assert_close(out, fused_attn_fwd(q, k, v, config)[0], rtol=0, atol=0)
    dout = randn(*out.shape)
    got = ops.fused_attn_bwd(dout, q, k, v, out, ctx, config, softmax_offset=zero_offset)
    want = fused_attn_bwd(dout, q, k, v, out, ctx, config)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[3] is None and got[4] is None


def test_invalid_inputs_raise_before_work():
    q, k, v = _inputs(1, 4, 4, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0))
    q, k, v = _inputs(1, 4, 4, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="attn_bias is required"):
        fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0, bias_type="post_scale_bias"))
    with pytest.raises(TypeError, match="bool"):
        fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0), attn_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="broadcast"):
        fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0), attn_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="softmax_offset was given"):
        fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0), softmax_offset=torch.zeros(2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_attn_fwd(q[0], k[0], v[0], AttentionConfig(softmax_scale=1.0, qkv_format="thd"))
    out, ctx = fused_attn_fwd(q, k, v, AttentionConfig(softmax_scale=1.0))
    with pytest.raises(ValueError, match="same config"):
        fused_attn_bwd(out, q, k, v, out, ctx, AttentionConfig(softmax_scale=0.5))


# -- the catalog's shared layout check, and the backward's ctx rule ---------------------------------
@pytest.mark.parametrize("shapes, config, cu, words", [
    (((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), dict(qkv_format="thd"), None, "needs 3-D q, k, v"),
    (((1, 4, 2, 8), (1, 5, 2, 8), (1, 4, 2, 8)), {}, None, "k and v need the same tokens and heads"),
    (((1, 4, 2, 8), (1, 4, 2, 4), (1, 4, 2, 4)), {}, None, "q and k the same head dim"),
    (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), {}, None, "the query heads (3) must be a multiple of the kv heads (2)"),
    (((2, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), {}, None, "q and k need the same batch"),
    (((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), {}, (2, 2), "are for qkv_format='thd'"),
    (((4, 2, 8), (4, 2, 8), (4, 2, 8)), dict(qkv_format="thd"), None, "needs cu_seqlens_q and cu_seqlens_kv"),
    (((4, 2, 8), (4, 2, 8), (4, 2, 8)), dict(qkv_format="thd"), (2, 3), "needs cu_seqlens_q and cu_seqlens_kv"),
])
def test_layout_errors_are_the_catalogs_shared_messages(shapes, config, cu, words):
    from transformer_engine.plugin.catalog.attention import attention_layout_error

    q, k, v = (randn(*shape) for shape in shapes)
    config = AttentionConfig(softmax_scale=1.0, **config)
    cu_q = cu_kv = None
    if cu is not None:
        cu_q, cu_kv = (torch.tensor([0, 4] + [4] * (n - 2), dtype=torch.int32) for n in cu)
    error = attention_layout_error(q, k, v, config, cu_q, cu_kv)
    assert error is not None and words in error
    with pytest.raises(ValueError) as raised:
        fused_attn_fwd(q, k, v, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert str(raised.value) == error


def test_thd_offsets_of_any_integer_dtype_are_accepted():
    """The shared check reads shapes only: int64 offsets run here (the flagos kernels decline them, so this runs them)."""
    q, k, v = (randn(7, 2, 8) for _ in range(3))
    config = AttentionConfig(softmax_scale=0.5, qkv_format="thd")
    cu = torch.tensor([0, 3, 7])
    out64, _ = fused_attn_fwd(q, k, v, config, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out32, _ = fused_attn_fwd(q, k, v, config, cu_seqlens_q=cu.int(), cu_seqlens_kv=cu.int())
    torch.testing.assert_close(out64, out32, rtol=0, atol=0)


def test_backward_declines_a_ctx_another_backend_made():
    from transformer_engine.plugin.backends.reference.attention import SUPPORTS

    config = AttentionConfig(softmax_scale=0.5)
    q, k, v = _inputs(1, 4, 4, 2, 2, 8, 8)
    out, ctx = fused_attn_fwd(q, k, v, config)
    supports = SUPPORTS["fused_attn_bwd"]
    assert supports(out, q, k, v, out, ctx, config) is True
    verdict = supports(out, q, k, v, out, object(), config)
    assert not verdict and "reference fused_attn_fwd" in verdict.reason


@pytest.mark.parametrize("strict", [False, True])
def test_backward_dispatch_reaches_the_backend_that_made_the_ctx(strict):
    """A manager with the reference and a fake flagos backend: the fake's forward context, under a policy that puts the
    reference first (strict or not), goes to the fake's backward: the reference declines it, which is no error."""
    from transformer_engine.plugin.backends._registration import impls_from_modules
    from transformer_engine.plugin.backends.reference import attention as reference
    from transformer_engine.plugin.core import (BackendImplKind, Capabilities, OpImpl, OpManager, OpRegistry, Reject,
                                                with_preference, with_strict_mode)

    class FakeCtx:
        def __init__(self, inner):
            self.inner = inner

    calls = []

    def fake_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                 cu_seqlens_kv=None):
        calls.append("fwd")
        out, ctx = reference.fused_attn_fwd(q, k, v, config)
        return out, FakeCtx(ctx)

    def fake_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_kv=None):
        calls.append("bwd")
        return reference.fused_attn_bwd(dout, q, k, v, out, ctx.inner, config)

    def fake_supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None,
                          alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
        return True if isinstance(ctx, FakeCtx) else Reject("not my ctx")

    registry = OpRegistry()
    registry.register_many(impls_from_modules([reference], "reference.torch", BackendImplKind.REFERENCE, Capabilities()))
    registry.register_many([OpImpl("fused_attn_fwd", "flagos.fake", BackendImplKind.DEFAULT, fake_fwd),
                            OpImpl("fused_attn_bwd", "flagos.fake", BackendImplKind.DEFAULT, fake_bwd, supports=fake_supports_bwd)])
    manager = OpManager(registry, load_builtins=False, discover=False)
    config = AttentionConfig(softmax_scale=0.5, mask_type="causal")
    q, k, v = _inputs(1, 5, 5, 2, 1, 8, 8)
    out, ctx = manager.call("fused_attn_fwd", q, k, v, config)  # the default order: flagos first
    dout = randn(*out.shape)
    with with_preference("reference"), with_strict_mode(strict):
        got = manager.call("fused_attn_bwd", dout, q, k, v, out, ctx, config)
    assert calls == ["fwd", "bwd"]
    want = fused_attn_bwd(dout, q, k, v, out, ctx.inner, config)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, ref_ctx = fused_attn_fwd(q, k, v, config)
    with with_preference("flagos"), with_strict_mode(strict):  # and the converse: the fake passes a reference ctx on
        manager.call("fused_attn_bwd", dout, q, k, v, out, ref_ctx, config)
    assert calls == ["fwd", "bwd"]
