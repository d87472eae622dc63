"""DotProductAttention vs an explicit float64 softmax(Q K^T) V, written from TE's documented mask rules.

Query i may see key j when it is not padding, j is not a padding key, and
i + off - left <= j <= i + off + right (causal: right = 0), with off = 0 for top-left alignment and
off = s_kv - s_q (the sequence's real lengths for padding types) for bottom-right alignment.
Rows that see no key give zeros.
"""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.attention._reference import allowed_mask as _allowed
from tests.pytorch.attention._reference import attention as _oracle
from tests.utils import dtype_tols, randn
from transformer_engine.pytorch.attention import _masks

# fp32 inputs against a float64 oracle: outputs sum s_kv fp32 products, gradients chain two such sums
OUT_TOLS = dict(rtol=1e-5, atol=1e-5)
GRAD_TOLS = dict(rtol=4 * dtype_tols(torch.float32)["rtol"], atol=4e-5)

B, H, D = 3, 4, 8


def _qkv(s_q, s_kv, groups=H, d_v=D, requires_grad=True):
    q = randn(B, s_q, H, D)
    k, v = randn(B, s_kv, groups, D), randn(B, s_kv, groups, d_v)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _check(out, ref, inputs, extra_grads=()):
    """Forward and every input gradient (through out.sum of a fixed random cotangent)."""
    cot = randn(*ref.shape, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref.reshape(out.shape), **OUT_TOLS)
    leaves = list(inputs) + list(extra_grads)
    got = torch.autograd.grad(out, leaves, cot.reshape(out.shape).to(out.dtype), allow_unused=True)
    want = torch.autograd.grad(ref, leaves, cot, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), **GRAD_TOLS)


def _padding(s_q, s_kv):
    lens_q, lens_kv = [s_q, max(s_q - 2, 1), 1], [s_kv, max(s_kv - 3, 1), 2]
    mask_q = torch.arange(s_q)[None, :] >= torch.tensor(lens_q)[:, None]
    mask_kv = torch.arange(s_kv)[None, :] >= torch.tensor(lens_kv)[:, None]
    return lens_q, lens_kv, (mask_q[:, None, None, :], mask_kv[:, None, None, :])


MASK_TYPES = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding,causal",
              "causal,padding", "padding_causal_bottom_right", "arbitrary"]


@pytest.mark.parametrize("s_q,s_kv", [(5, 5), (4, 7), (7, 4)])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_mask_types(mask_type, s_q, s_kv):
    q, k, v = _qkv(s_q, s_kv)
    canonical = _masks.canonical_mask_type(mask_type)
    lens_q = lens_kv = arbitrary = attention_mask = None
    if "padding" in canonical:
        lens_q, lens_kv, attention_mask = _padding(s_q, s_kv)
    if canonical == "arbitrary":
        attention_mask = arbitrary = torch.rand(B, 1, s_q, s_kv) < 0.3
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type, attention_type="cross")
    out = dpa(q, k, v, attention_mask=attention_mask)
    bottom_right = _masks.resolve_bottom_right(canonical, None)
    allowed = _allowed(B, s_q, s_kv, canonical, (-1, -1), bottom_right, lens_q, lens_kv, arbitrary)
    _check(out, _oracle(q, k, v, allowed, 1 / math.sqrt(D)), (q, k, v))


@pytest.mark.parametrize(
    "mask_type,window,bottom_right",
    [
        ("causal", (2, 0), None),
        ("causal_bottom_right", (1, 0), None),
        ("no_mask", (2, 1), True),
        ("no_mask", (0, 2), False),
        ("padding", (1, 1), True),
        ("padding_causal", (2, 0), None),
        ("padding_causal_bottom_right", (1, 0), None),
        ("arbitrary", (2, 2), False),
    ],
)
@pytest.mark.parametrize("s_q,s_kv", [(6, 6), (4, 7)])
def test_sliding_window(mask_type, window, bottom_right, s_q, s_kv):
    q, k, v = _qkv(s_q, s_kv)
    lens_q = lens_kv = arbitrary = attention_mask = None
    if "padding" in mask_type:
        lens_q, lens_kv, attention_mask = _padding(s_q, s_kv)
    if mask_type == "arbitrary":
        attention_mask = arbitrary = torch.rand(1, 1, s_q, s_kv) < 0.2
    dpa = te.DotProductAttention(H, D, qkv_format="sbhd", attn_mask_type=mask_type, window_size=window,
                                 bottom_right_diagonal=bottom_right, attention_type="cross")
    out = dpa(*(t.transpose(0, 1) for t in (q, k, v)), attention_mask=attention_mask).transpose(0, 1)
    br = _masks.resolve_bottom_right(mask_type, bottom_right)
    allowed = _allowed(B, s_q, s_kv, mask_type, window, br, lens_q, lens_kv,
                       None if arbitrary is None else arbitrary.expand(B, 1, s_q, s_kv))
    _check(out, _oracle(q, k, v, allowed, 1 / math.sqrt(D)), (q, k, v))


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_gqa_mqa_and_softmax_scale(groups):
    q, k, v = _qkv(5, 6, groups=groups)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format="bshd", attn_mask_type="causal_bottom_right",
                                 softmax_scale=0.37)
    allowed = _allowed(B, 5, 6, "causal_bottom_right", (-1, -1), bottom_right=True)
    _check(dpa(q, k, v), _oracle(q, k, v, allowed, 0.37), (q, k, v))


def test_kv_channels_tuple():
    q, k, v = _qkv(4, 5, d_v=12)
    dpa = te.DotProductAttention(H, (D, 12), qkv_format="bshd", attn_mask_type="no_mask")
    out = dpa(q, k, v)
    assert out.shape == (B, 4, H * 12)
    _check(out, _oracle(q, k, v, _allowed(B, 4, 5, "no_mask", (-1, -1), bottom_right=True), 1 / math.sqrt(D)), (q, k, v))


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_softmax_types(softmax_type):
    q, k, v = _qkv(5, 5)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", softmax_type=softmax_type)
    alpha = None
    if softmax_type == "off-by-one":
        alpha = torch.zeros(H)
    if softmax_type == "learnable":
        assert dpa.softmax_offset.shape == (H,) and dpa.softmax_offset.requires_grad
        with torch.no_grad():
            dpa.softmax_offset.copy_(randn(H))
        alpha = dpa.softmax_offset
    out = dpa(q, k, v)
    ref = _oracle(q, k, v, _allowed(B, 5, 5, "causal", (-1, -1), bottom_right=False), 1 / math.sqrt(D), alpha=alpha)
    _check(out, ref, (q, k, v), extra_grads=(dpa.softmax_offset,) if softmax_type == "learnable" else ())


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
@pytest.mark.parametrize("shape", [(1, H), (B, 1), (B, H)])
def test_bias(bias_type, shape):
    q, k, v = _qkv(5, 7)
    bias = randn(*shape, 5, 7).requires_grad_(requires_grad=True)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    out = dpa(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
    scale = 1 / math.sqrt(D)
    effective = bias * scale if bias_type == "pre_scale_bias" else bias
    ref = _oracle(q, k, v, _allowed(B, 5, 7, "no_mask", (-1, -1), bottom_right=True), scale, bias=effective)
    _check(out, ref, (q, k, v), extra_grads=(bias,))


def _alibi(slopes, s_q, s_kv, off):
    i, j = torch.arange(s_q)[:, None], torch.arange(s_kv)[None, :]
    off = torch.as_tensor(off).reshape(-1, 1, 1, 1)
    return -slopes.double().reshape(-1, H, 1, 1) * (i + off - j).abs()


@pytest.mark.parametrize(
    "mask_type,bottom_right",
    [("no_mask", None), ("no_mask", False), ("causal", None), ("causal_bottom_right", None),
     ("padding", True), ("padding", False), ("padding_causal_bottom_right", None)],
)
@pytest.mark.parametrize("slopes_shape", [None, (H,), (B, H)])
def test_alibi(mask_type, bottom_right, slopes_shape):
    s_q, s_kv = 4, 6
    q, k, v = _qkv(s_q, s_kv)
    slopes = None if slopes_shape is None else torch.rand(*slopes_shape)
    lens_q = lens_kv = attention_mask = None
    if "padding" in mask_type:
        lens_q, lens_kv, attention_mask = _padding(s_q, s_kv)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type, attention_type="cross",
                                 bottom_right_diagonal=bottom_right)
    out = dpa(q, k, v, attention_mask=attention_mask, core_attention_bias_type="alibi", alibi_slopes=slopes)
    br = _masks.resolve_bottom_right(mask_type, bottom_right)
    if not br:
        off = 0
    elif lens_q is not None:
        off = torch.tensor(lens_kv) - torch.tensor(lens_q)
    else:
        off = s_kv - s_q
    used = _masks.default_alibi_slopes(H) if slopes is None else slopes
    allowed = _allowed(B, s_q, s_kv, mask_type, (-1, -1), br, lens_q, lens_kv)
    _check(out, _oracle(q, k, v, allowed, 1 / math.sqrt(D), bias=_alibi(used, s_q, s_kv, off)), (q, k, v))


def test_default_alibi_slopes_formula():
    torch.testing.assert_close(_masks.default_alibi_slopes(8), torch.tensor([2.0 ** (-k) for k in range(1, 9)]))
    twelve = [2.0 ** (-k) for k in range(1, 9)] + [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]
    torch.testing.assert_close(_masks.default_alibi_slopes(12), torch.tensor(twelve))


def _pack(x, lens):
    return torch.cat([x[n, :length] for n, length in enumerate(lens)])


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize(
    "mask_type,window",
    [("padding", None), ("padding_causal", None), ("padding_causal_bottom_right", None),
     ("padding_causal", (1, 0)), ("padding", (1, 2))],
)
def test_formats_agree(mask_type, window):
    """sbhd, bshd and thd give the same results for the same (padded) sequences."""
    s_q, s_kv = 6, 7
    q, k, v = _qkv(s_q, s_kv)
    lens_q, lens_kv, attention_mask = _padding(s_q, s_kv)
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, window_size=window, attention_type="cross")
    bshd = dpa(q, k, v, attention_mask=attention_mask, qkv_format="bshd")
    sbhd = dpa(*(t.transpose(0, 1) for t in (q, k, v)), attention_mask=attention_mask, qkv_format="sbhd")
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    thd = dpa(_pack(q, lens_q), _pack(k, lens_kv), _pack(v, lens_kv), qkv_format="thd",
              cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    torch.testing.assert_close(sbhd.transpose(0, 1), bshd, rtol=0, atol=0)
    torch.testing.assert_close(thd, _pack(bshd, lens_q), **OUT_TOLS)
    padded_cu = dpa(q.reshape(-1, H, D), k.reshape(-1, H, D), v.reshape(-1, H, D), qkv_format="bshd".replace("bshd", "thd"),
                    cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=torch.arange(B + 1, dtype=torch.int32) * s_q,
                    cu_seqlens_kv_padded=torch.arange(B + 1, dtype=torch.int32) * s_kv)
    torch.testing.assert_close(padded_cu.reshape(B, s_q, -1), bshd, **OUT_TOLS)


def test_bshd_padding_from_cu_seqlens():
    s = 6
    q, k, v = _qkv(s, s, requires_grad=False)
    lens_q, lens_kv, _ = _padding(s, s)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding_causal", attention_type="cross")
    from_mask = dpa(q, k, v, attention_mask=_padding(s, s)[2])
    from_cu = dpa(q, k, v, cu_seqlens_q=_cu(lens_q), cu_seqlens_kv=_cu(lens_kv))
    torch.testing.assert_close(from_cu, from_mask, rtol=0, atol=0)


def _tracker(seed):
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    return tracker


def test_attention_dropout_uses_the_tracker():
    q, k, v = _qkv(5, 5, requires_grad=False)
    trackers = [_tracker(11), _tracker(11), _tracker(12)]
    outs = []
    for tracker in trackers:
        dpa = te.DotProductAttention(H, D, attention_dropout=0.5, qkv_format="bshd", get_rng_state_tracker=lambda t=tracker: t)
        before = torch.get_rng_state()
        outs.append(dpa(q, k, v))
        assert torch.equal(torch.get_rng_state(), before), "dropout must draw from the tracker's stream"
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[2])
    eval_out = te.DotProductAttention(H, D, attention_dropout=0.5, qkv_format="bshd").eval()(q, k, v)
    assert not torch.allclose(outs[0], eval_out)


def test_checkpoint_core_attention_matches():
    """Recomputed attention (with dropout through a tracker) gives identical outputs and gradients."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(3)
        q, k, v = _qkv(6, 6)
        tracker = _tracker(5)
        dpa = te.DotProductAttention(H, D, attention_dropout=0.3, qkv_format="bshd", softmax_type="learnable",
                                     get_rng_state_tracker=lambda t=tracker: t)
        out = dpa(q, k, v, checkpoint_core_attention=checkpointed)
        out.backward(torch.ones_like(out))
        results.append((out, q.grad, k.grad, v.grad, dpa.softmax_offset.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_qkv_layer():
    q, k, v = _qkv(5, 5, requires_grad=False)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd")
    packed = torch.stack([q, k, v], dim=2)  # [b, s, 3, h, d]
    torch.testing.assert_close(dpa(qkv_layer=packed), dpa(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,forward,match",
    [
        (dict(attn_mask_type="sliding"), {}, "attn_mask_type"),
        (dict(attn_mask_type="causal", window_size=(-2, 0)), {}, "window_size"),
        (dict(attn_mask_type="padding"), {}, "attention_mask"),
        (dict(attn_mask_type="no_mask"), dict(core_attention_bias_type="post_scale_bias"), "core_attention_bias"),
        (dict(attn_mask_type="no_mask"), dict(core_attention_bias_type="alibi", core_attention_bias=torch.zeros(1)), "alibi"),
        (dict(attn_mask_type="no_mask", qkv_format="thd"), {}, "cu_seqlens"),
        (dict(attn_mask_type="no_mask", num_gqa_groups=2), {}, "key/value heads"),
    ],
)
def test_errors_name_the_argument(kwargs, forward, match):
    q, k, v = _qkv(4, 4, requires_grad=False)
    if kwargs.get("qkv_format") == "thd":
        q, k, v = (t.reshape(-1, H, D) for t in (q, k, v))
    with pytest.raises(ValueError, match=match):
        dpa = te.DotProductAttention(H, D, **{"qkv_format": "bshd", **kwargs})
        dpa(q, k, v, **forward)


def test_window_corrections_warn():
    with pytest.warns(UserWarning, match="window_size"):
        assert _masks.check_set_window_size("causal", (3, 2)) == (3, 0)
    with pytest.warns(UserWarning, match="window_size"):
        assert _masks.check_set_window_size("no_mask", (-1, 0)) == (-1, -1)
    assert _masks.check_set_window_size("padding_causal", None) == (-1, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(dtype):
    q, k, v = _qkv(6, 6, requires_grad=False)
    dpa = te.DotProductAttention(H, D, qkv_format="bshd")
    ref = dpa(q, k, v)
    out = dpa(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2 * dtype_tols(dtype)["rtol"], atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding_causal", "arbitrary"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [4, 2])
def test_gpu_matches_oracle(mask_type, dtype, groups):
    """Whichever backend the dispatcher picks on the GPU (Triton, SDPA, reference) agrees with the oracle."""
    s_q, s_kv, d = 64, 96, 64
    q = randn(B, s_q, H, d, dtype=dtype, device="cuda").requires_grad_(requires_grad=True)
    k = randn(B, s_kv, groups, d, dtype=dtype, device="cuda").requires_grad_(requires_grad=True)
    v = randn(B, s_kv, groups, d, dtype=dtype, device="cuda").requires_grad_(requires_grad=True)
    lens_q = lens_kv = arbitrary = attention_mask = None
    if "padding" in mask_type:
        lens_q, lens_kv = [s_q, 40, 17], [s_kv, 70, 5]
        attention_mask = tuple((torch.arange(s)[None, :] >= torch.tensor(n)[:, None])[:, None, None].cuda()
                               for s, n in ((s_q, lens_q), (s_kv, lens_kv)))
    if mask_type == "arbitrary":
        attention_mask = arbitrary = torch.rand(B, 1, s_q, s_kv, device="cuda") < 0.2
    dpa = te.DotProductAttention(H, d, num_gqa_groups=groups, qkv_format="bshd", attn_mask_type=mask_type,
                                 attention_type="cross")
    out = dpa(q, k, v, attention_mask=attention_mask)
    allowed = _allowed(B, s_q, s_kv, mask_type, (-1, -1), _masks.resolve_bottom_right(mask_type, None), lens_q, lens_kv,
                       None if arbitrary is None else arbitrary.cpu())
    ref = _oracle(q.cpu(), k.cpu(), v.cpu(), allowed, 1 / math.sqrt(d))
    tols = dict(rtol=2 * dtype_tols(dtype)["rtol"], atol=2e-2)
    torch.testing.assert_close(out.double().cpu(), ref.reshape(out.shape), **tols)
    cot = randn(*out.shape, dtype=dtype, device="cuda")
    got = torch.autograd.grad(out, (q, k, v), cot)
    qc, kc, vc = (t.detach().cpu().double().requires_grad_(requires_grad=True) for t in (q, k, v))
    want = torch.autograd.grad(_oracle(qc, kc, vc, allowed, 1 / math.sqrt(d)).reshape(out.shape), (qc, kc, vc), cot.cpu().double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=tols["rtol"], atol=8e-2)


@pytest.mark.gpu
def test_gpu_dropout_checkpoint_replay():
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(3)
        q, k, v = (randn(B, 64, H, 64, dtype=torch.bfloat16, device="cuda").requires_grad_(requires_grad=True) for _ in range(3))
        tracker = _tracker(5)
        dpa = te.DotProductAttention(H, 64, attention_dropout=0.2, qkv_format="bshd", get_rng_state_tracker=lambda t=tracker: t)
        out = dpa(q, k, v, checkpoint_core_attention=checkpointed)
        out.backward(torch.ones_like(out))
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
