"""vendor.cuda fused attention (PyTorch SDPA kernels).

On CPU: what the SUPPORTS predicate declines and why, the mask-to-bias conversion, and the kernels'
argument plumbing on "meta" tensors (PyTorch's shape functions of the SDPA ops). On a GPU: forward
and backward against the reference backend, and the dropout identity sum(dV * V) = sum(dO * O).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin.backends.reference import attention as reference
from transformer_engine.plugin.backends.vendor.cuda import attention as sdpa
from transformer_engine.plugin.catalog.attention import AttentionConfig

CONFIG = AttentionConfig(softmax_scale=0.125)


def _qkv(b=2, s_q=5, s_kv=5, h=4, h_kv=4, d=16, d_v=16, dtype=torch.float16, device="cpu"):
    return randn(b, s_q, h, d, dtype=dtype, device=device), randn(b, s_kv, h_kv, d, dtype=dtype, device=device), randn(
        b, s_kv, h_kv, d_v, dtype=dtype, device=device
    )


@pytest.mark.parametrize(
    "config,kwargs,reason",
    [
        (dataclasses.replace(CONFIG, qkv_format="thd"), {}, "qkv_format='thd'"),
        (dataclasses.replace(CONFIG, window_size=(4, 0)), {}, "window_size"),
        (dataclasses.replace(CONFIG, bias_type="pre_scale_bias"), {}, "pre_scale_bias"),
        (dataclasses.replace(CONFIG, bias_type="alibi"), {}, "alibi"),
        (dataclasses.replace(CONFIG, softmax_type="off-by-one"), {}, "off-by-one"),
        (dataclasses.replace(CONFIG, softmax_type="learnable"), {}, "learnable"),
        (CONFIG, dict(d=12), "head dims 12"),
        (CONFIG, dict(dtype=torch.float64), "float64"),
        (CONFIG, {}, "not on a CUDA device"),
    ],
)
def test_declines_with_the_reason(config, kwargs, reason):
    q, k, v = _qkv(**kwargs)
    verdict = sdpa._supports_fwd(q, k, v, config)
    assert not verdict and reason in verdict.reason


def test_backward_accepts_only_its_own_ctx():
    q, k, v = _qkv(dtype=torch.float32)
    _, ref_ctx = reference.fused_attn_fwd(q, k, v, CONFIG)
    assert not sdpa._supports_bwd(q, q, k, v, q, ref_ctx, CONFIG)


def test_kernel_bias_masks_and_dead_rows():
    q, k, _ = _qkv(s_q=3, s_kv=4, dtype=torch.bfloat16)
    mask = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    mask[1, 0, 2] = True  # a query row that sees no key
    user_bias = randn(1, 4, 3, 4)
    bias, dead = sdpa._kernel_bias(q, k, mask, user_bias, causal_in_bias=False)
    assert bias.shape == (2, 4, 3, 4) and bias.stride(2) % 16 == 0, "rows padded to the kernel's alignment"
    torch.testing.assert_close(bias[0].float(), user_bias[0].to(torch.bfloat16).float())
    assert torch.all(bias[1, :, 2] <= torch.finfo(torch.bfloat16).min / 4)
    assert dead.shape == (2, 1, 3, 1) and dead.sum() == 1 and dead[1, 0, 2, 0]
    band, dead = sdpa._kernel_bias(*_qkv(s_q=4, s_kv=2)[:2], None, None, causal_in_bias=True)
    assert torch.equal(band[0, 0] < 0, torch.tensor([[True, True], [True, True], [False, True], [False, False]]))
    assert dead.reshape(-1).tolist() == [True, True, False, False]


def test_plans():
    q, k, v = _qkv()
    assert sdpa._plan(q, k, v, CONFIG, None, None, (9, 0)).kernel == "flash"
    assert sdpa._plan(q, k, v, CONFIG, None, None, (7, 5)).kernel == "efficient"
    assert sdpa._plan(q, k, v, CONFIG, torch.zeros(5, 5, dtype=torch.bool), None, (9, 0)).kernel == "efficient"
    q2, k2, v2 = _qkv(s_q=6, s_kv=4)
    plan = sdpa._plan(q2, k2, v2, dataclasses.replace(CONFIG, mask_type="causal_bottom_right"), None, None, (9, 0))
    assert (plan.kernel, plan.is_causal, plan.causal_in_bias) == ("efficient", False, True)
    plan = sdpa._plan(q2, k2, v2, dataclasses.replace(CONFIG, mask_type="causal"), None, None, (9, 0))
    assert (plan.kernel, plan.is_causal) == ("efficient", True), "flash's causal flag is bottom-right"


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_plumbing_on_meta_tensors(kernel, h_kv):
    """Both kernels' forward and backward ops accept what we pass and give gradients of the right shapes."""
    q, k, v = (t.to("meta") for t in _qkv(h_kv=h_kv))
    bias = torch.empty(1, 4, 5, 5, dtype=torch.float16, device="meta") if kernel == "efficient" else None
    config = dataclasses.replace(CONFIG, bias_type="post_scale_bias" if bias is not None else "no_bias", dropout_p=0.1)
    out, ctx = sdpa._forward(q, k, v, config, None, bias, sdpa._Plan(kernel, True, False))
    assert out.shape == q.shape and ctx.kernel == kernel
    dq, dk, dv, dbias, doffset = sdpa.fused_attn_bwd(torch.empty_like(out), q, k, v, out, ctx, config, attn_bias=bias)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and doffset is None
    assert (dbias is None) == (bias is None) and (bias is None or dbias.shape == bias.shape)


# ------------------------------------------------------------------------------------------- GPU
CASES = [
    # (name, dtype, s_q, s_kv, h_kv, d_v, mask_type, with_mask, with_bias)
    ("flash", torch.bfloat16, 64, 64, 4, 64, "causal", False, False),
    ("flash_gqa_bottom_right", torch.float16, 48, 80, 2, 64, "causal_bottom_right", False, False),
    ("efficient_fp32", torch.float32, 33, 47, 4, 32, "no_mask", False, False),
    ("efficient_mask", torch.bfloat16, 40, 40, 4, 64, "no_mask", True, False),
    ("efficient_bias", torch.float16, 37, 29, 1, 64, "causal", False, True),
    ("efficient_folded_causal", torch.bfloat16, 50, 20, 4, 64, "causal_bottom_right", False, False),
    ("efficient_dv", torch.bfloat16, 24, 24, 4, 32, "causal", False, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_on_gpu(case):
    _, dtype, s_q, s_kv, h_kv, d_v, mask_type, with_mask, with_bias = case
    q, k, v = _qkv(2, s_q, s_kv, 4, h_kv, 64 if dtype != torch.float32 else 32, d_v, dtype, "cuda")
    mask = (torch.rand(2, 1, s_q, s_kv, device="cuda") < 0.2) if with_mask else None
    bias = randn(1, 4, s_q, s_kv, device="cuda") if with_bias else None
    config = AttentionConfig(0.1, mask_type=mask_type, bias_type="post_scale_bias" if with_bias else "no_bias")
    assert sdpa._supports_fwd(q, k, v, config, mask, bias)
    out, ctx = sdpa.fused_attn_fwd(q, k, v, config, mask, bias)
    ref, ref_ctx = reference.fused_attn_fwd(q, k, v, config, mask, bias)
    tols = dict(rtol=2 * dtype_tols(dtype)["rtol"], atol=2e-2 if dtype != torch.float32 else 1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tols)
    dout = randn(*out.shape, dtype=dtype, device="cuda")
    grads = sdpa.fused_attn_bwd(dout, q, k, v, out, ctx, config, mask, bias)
    ref_grads = reference.fused_attn_bwd(dout, q, k, v, ref, ref_ctx, config, mask, bias)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g.float(), r.float(), rtol=tols["rtol"], atol=4 * tols["atol"], msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("with_mask", [False, True])
def test_dropout_is_consistent_on_gpu(with_mask):
    """Same seed, same output; and the backward uses the forward's mask: sum(dV * V) == sum(dO * O)."""
    q, k, v = _qkv(2, 64, 64, 4, 2, 64, 64, torch.bfloat16, "cuda")
    mask = (torch.rand(2, 1, 64, 64, device="cuda") < 0.1) if with_mask else None
    config = AttentionConfig(0.125, dropout_p=0.3)
    torch.manual_seed(1)
    out, ctx = sdpa.fused_attn_fwd(q, k, v, config, mask)
    torch.manual_seed(1)
    again, _ = sdpa.fused_attn_fwd(q, k, v, config, mask)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    dout = randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    _, _, dv, _, _ = sdpa.fused_attn_bwd(dout, q, k, v, out, ctx, config, mask)
    lhs, rhs = (dv.float() * v.float()).sum(), (dout.float() * out.float()).sum()
    torch.testing.assert_close(lhs, rhs, rtol=2e-2, atol=1e-1)
