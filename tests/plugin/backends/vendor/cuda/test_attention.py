"""vendor.cuda fused attention (PyTorch's cuDNN, flash and memory-efficient SDPA kernels).

On CPU: what the SUPPORTS predicate declines and why, which kernel each call gets and why the faster
ones were passed over, the cuDNN schema check, the mask-to-bias conversion, and the kernels'
argument plumbing on "meta" tensors (PyTorch's shape functions of the SDPA ops). On a GPU: forward
and backward of every kernel that can run a case against the reference backend (causal masks with
s_q != s_kv in both alignments included), which kernel the plan picks there, and the dropout
identity sum(dV * V) = sum(dO * O).
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


def test_wrong_layout_is_the_catalogs_error_before_anything_else():
    """A layout error is an error of the call (the catalog's check, as in every backend), not a decline."""
    q, _, _ = _qkv(b=2)
    _, k, v = _qkv(b=1)
    with pytest.raises(ValueError, match="q and k need the same batch"):
        sdpa.fused_attn_fwd(q, k, v, CONFIG)


def test_backward_accepts_only_its_own_ctx():
    q, k, v = _qkv(dtype=torch.float32)
    _, ref_ctx = reference.fused_attn_fwd(q, k, v, CONFIG)
    assert not sdpa._supports_bwd(q, q, k, v, q, ref_ctx, CONFIG)


def test_kernel_bias_masks_and_dead_rows():
    q, k, _ = _qkv(s_q=3, s_kv=4, dtype=torch.bfloat16)
    mask = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    mask[1, 0, 2] = True  # a query row that sees no key
    user_bias = randn(1, 4, 3, 4)
    bias, dead = sdpa._kernel_bias(q, k, mask, user_bias, "no_mask", fold_causal=False)
    assert bias.shape == (2, 4, 3, 4) and bias.stride(2) % 16 == 0, "rows padded to the kernel's alignment"
    torch.testing.assert_close(bias[0].float(), user_bias[0].to(torch.bfloat16).float())
    assert torch.all(bias[1, :, 2] <= torch.finfo(torch.bfloat16).min / 4)
    assert dead.shape == (2, 1, 3, 1) and dead.sum() == 1 and dead[1, 0, 2, 0]
    band, dead = sdpa._kernel_bias(*_qkv(s_q=4, s_kv=2)[:2], None, None, "causal_bottom_right", fold_causal=True)
    assert torch.equal(band[0, 0] < 0, torch.tensor([[True, True], [True, True], [False, True], [False, False]]))
    assert dead.reshape(-1).tolist() == [True, True, False, False]
    band, dead = sdpa._kernel_bias(*_qkv(s_q=2, s_kv=3)[:2], None, None, "causal", fold_causal=True)
    assert torch.equal(band[1, 3] < 0, torch.tensor([[False, True, True], [False, False, True]])) and dead is None
    first_key = torch.tensor([[True, False, False], [False, False, False]])  # hides query 0's only causal key
    bias, dead = sdpa._kernel_bias(*_qkv(s_q=2, s_kv=3)[:2], first_key, None, "causal", fold_causal=False)
    assert torch.equal(bias[0, 0] < 0, first_key), "the causal flag stays with the kernel"
    assert dead.reshape(-1).tolist() == [True, False], "but its rows count for the dead rows"
    _, dead = sdpa._kernel_bias(*_qkv(s_q=2, s_kv=3)[:2], torch.zeros(2, 3, dtype=torch.bool), None, "no_mask", fold_causal=False)
    assert dead.reshape(-1).tolist() == [False, False], "a mask's dead rows come back without asking the device"


H200 = sdpa._Device((9, 0), 91000)


def _call(dtype=torch.bfloat16, s_q=64, s_kv=64, d=64, d_v=None, mask_type="causal", mask=False, bias=False):
    return sdpa._Call(dtype, s_q, s_kv, d, d if d_v is None else d_v, mask_type, mask, bias)


def _kernels(*names):
    return tuple(kernel for kernel in sdpa._KERNELS if kernel.name in names)


@pytest.mark.parametrize(
    "call,device,kernels,expected",
    [
        (_call(), H200, None, ("cudnn", True, False)),
        (_call(mask_type="no_mask", mask=True), H200, None, ("cudnn", False, False)),
        (_call(mask=True), H200, None, ("cudnn", False, True)),  # cuDNN's causal flag + a bias: wrong grads
        (_call(s_q=96, s_kv=40), H200, None, ("cudnn", True, False)),  # cuDNN's flag is top-left
        (_call(s_q=40, s_kv=96, mask_type="causal_bottom_right"), H200, None, ("flash", True, False)),  # no bias to build
        (_call(s_q=40, s_kv=96, mask_type="causal_bottom_right", mask=True), H200, None, ("cudnn", False, True)),
        (_call(dtype=torch.float32, s_q=40, s_kv=96, mask_type="causal_bottom_right"), H200, None, ("efficient", False, True)),
        (_call(d=256), sdpa._Device((9, 0), 90501), None, ("cudnn", True, False)),
        (_call(d=256), sdpa._Device((9, 0), 90400), None, ("flash", True, False)),
        (_call(), sdpa._Device((9, 0), 0), None, ("flash", True, False)),
        (_call(), sdpa._Device((7, 5), 91000), None, ("efficient", True, False)),
        (_call(dtype=torch.float32), H200, None, ("efficient", True, False)),
        (_call(bias=True), H200, None, ("efficient", True, False)),
        (_call(s_q=40, s_kv=96, mask_type="causal_bottom_right"), H200, ("flash", "efficient"), ("flash", True, False)),
        (_call(s_q=96, s_kv=40, mask_type="causal_bottom_right"), H200, ("flash", "efficient"), ("efficient", False, True)),
        (_call(s_q=96, s_kv=40), H200, ("flash", "efficient"), ("efficient", True, False)),
    ],
)
def test_plans(call, device, kernels, expected):
    plan = sdpa._plan(call, device, _kernels(*kernels) if kernels else sdpa._KERNELS)
    assert (plan.kernel, plan.is_causal, plan.causal_in_bias) == expected


def test_plans_say_why_faster_kernels_were_passed_over():
    plan = sdpa._plan(_call(bias=True), H200)
    assert [name for name, _ in plan.passed_over] == ["cudnn", "flash"]
    assert "no bias gradient" in plan.passed_over[0][1] and "attn_bias" in plan.passed_over[1][1]
    plan = sdpa._plan(_call(s_q=96, s_kv=40), H200, _kernels("flash", "efficient"))
    assert "'causal_bottom_right'" in plan.passed_over[0][1]
    assert "cuDNN 0" in sdpa._plan(_call(), sdpa._Device((9, 0), 0)).passed_over[0][1]
    with pytest.raises(ValueError, match="no SDPA kernel"):
        sdpa._plan(_call(bias=True), H200, _kernels("cudnn", "flash"))


def test_unknown_cudnn_schema_is_declined(monkeypatch):
    sdpa._cudnn_schema_gap.cache_clear()
    sdpa._plan.cache_clear()
    monkeypatch.setitem(sdpa._CUDNN_SCHEMAS, "_scaled_dot_product_cudnn_attention", ("query", "key", "value"))
    try:
        plan = sdpa._plan(_call(), H200)
        assert plan.kernel == "flash" and "schema this backend does not know" in plan.passed_over[0][1]
    finally:
        sdpa._cudnn_schema_gap.cache_clear()
        sdpa._plan.cache_clear()


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5), reason="cuDNN ops before torch 2.5 differ")
def test_cudnn_schema_of_this_torch_is_known():
    assert sdpa._cudnn_schema_gap() is None


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_plumbing_on_meta_tensors(kernel, h_kv):
    """Each kernel's forward and backward ops accept what we pass and give gradients of the right shapes."""
    q, k, v = (t.to("meta") for t in _qkv(h_kv=h_kv))
    bias = torch.empty(1, 4, 5, 5, dtype=torch.float16, device="meta") if kernel == "efficient" else None
    config = dataclasses.replace(CONFIG, bias_type="post_scale_bias" if bias is not None else "no_bias", dropout_p=0.1)
    out, ctx = sdpa._forward(q, k, v, config, None, bias, sdpa._Plan(kernel, is_causal=True, causal_in_bias=False))
    assert out.shape == q.shape and ctx.kernel == kernel
    dq, dk, dv, dbias, doffset = sdpa.fused_attn_bwd(torch.empty_like(out), q, k, v, out, ctx, config, attn_bias=bias)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and doffset is None
    assert (dbias is None) == (bias is None) and (bias is None or dbias.shape == bias.shape)


# ------------------------------------------------------------------------------------------- GPU
@dataclasses.dataclass(frozen=True)
class Case:
    """One GPU problem (b = 2, h = 4) and the kernel the plan should pick for it."""

    name: str
    dtype: torch.dtype
    s_q: int
    s_kv: int
    h_kv: int
    d: int
    d_v: int
    mask_type: str
    with_mask: bool
    with_bias: bool
    picked: str


CASES = [
    Case("square_causal", torch.bfloat16, 64, 64, 4, 64, 64, "causal", with_mask=False, with_bias=False, picked="cudnn"),
    Case("top_left_short_q_gqa", torch.float16, 48, 80, 2, 64, 64, "causal", with_mask=False, with_bias=False, picked="cudnn"),
    Case("top_left_long_q", torch.bfloat16, 80, 48, 4, 64, 64, "causal", with_mask=False, with_bias=False, picked="cudnn"),
    Case("bottom_right_short_q_gqa", torch.float16, 48, 80, 2, 64, 64, "causal_bottom_right", with_mask=False, with_bias=False,
         picked="flash"),  # no bias to build
    Case("bottom_right_dead_rows", torch.bfloat16, 50, 20, 4, 64, 64, "causal_bottom_right", with_mask=False, with_bias=False,
         picked="cudnn"),
    Case("mask", torch.bfloat16, 40, 40, 4, 64, 64, "no_mask", with_mask=True, with_bias=False, picked="cudnn"),
    Case("mask_causal", torch.float16, 40, 40, 4, 64, 64, "causal", with_mask=True, with_bias=False, picked="cudnn"),
    Case("mask_top_left_gqa", torch.bfloat16, 37, 29, 2, 64, 64, "causal", with_mask=True, with_bias=False, picked="cudnn"),
    Case("head_dim_128_odd_lengths", torch.bfloat16, 37, 29, 4, 128, 128, "no_mask", with_mask=False, with_bias=False, picked="cudnn"),
    Case("d_v_smaller", torch.bfloat16, 24, 24, 4, 64, 32, "causal", with_mask=False, with_bias=False, picked="cudnn"),
    Case("fp32", torch.float32, 33, 47, 4, 32, 32, "no_mask", with_mask=False, with_bias=False, picked="efficient"),
    Case("bias_mqa", torch.float16, 37, 29, 1, 64, 64, "causal", with_mask=False, with_bias=True, picked="efficient"),
]


def _gpu_inputs(case: Case):
    q, k, v = _qkv(2, case.s_q, case.s_kv, 4, case.h_kv, case.d, case.d_v, case.dtype, "cuda")
    mask = (torch.rand(2, 1, case.s_q, case.s_kv, device="cuda") < 0.2) if case.with_mask else None
    bias = randn(1, 4, case.s_q, case.s_kv, device="cuda") if case.with_bias else None
    config = AttentionConfig(0.1, mask_type=case.mask_type, bias_type="post_scale_bias" if case.with_bias else "no_bias")
    return q, k, v, mask, bias, config


def _forced_forward(kernel: str, q, k, v, config, mask, bias):
    """fused_attn_fwd on one kernel; skips the test when that kernel cannot run the call."""
    try:
        plan = sdpa._plan(sdpa._Call.of(q, k, v, config, mask, bias), sdpa._Device.of(q.device), _kernels(kernel))
    except ValueError as exc:
        pytest.skip(str(exc))
    return sdpa._forward(q, k, v, config, mask, bias, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["planned", "cudnn", "flash", "efficient"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference_on_gpu(case, kernel):
    q, k, v, mask, bias, config = _gpu_inputs(case)
    assert sdpa._supports_fwd(q, k, v, config, mask, bias)
    if kernel == "planned":
        out, ctx = sdpa.fused_attn_fwd(q, k, v, config, mask, bias)
        assert ctx.kernel == case.picked
    else:
        out, ctx = _forced_forward(kernel, q, k, v, config, mask, bias)
    ref, ref_ctx = reference.fused_attn_fwd(q, k, v, config, mask, bias)
    tols = dict(rtol=2 * dtype_tols(case.dtype)["rtol"], atol=2e-2 if case.dtype != torch.float32 else 1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tols)
    dout = randn(*out.shape, dtype=case.dtype, device="cuda")
    grads = sdpa.fused_attn_bwd(dout, q, k, v, out, ctx, config, mask, bias)
    ref_grads = reference.fused_attn_bwd(dout, q, k, v, ref, ref_ctx, config, mask, bias)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g.float(), r.float(), rtol=tols["rtol"], atol=4 * tols["atol"], msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_dropout_is_consistent_on_gpu(kernel, with_mask):
    """Same seed, same output; and the backward uses the forward's mask: sum(dV * V) == sum(dO * O)."""
    q, k, v = _qkv(2, 64, 64, 4, 2, 64, 64, torch.bfloat16, "cuda")
    mask = (torch.rand(2, 1, 64, 64, device="cuda") < 0.1) if with_mask else None
    config = AttentionConfig(0.125, dropout_p=0.3)
    torch.manual_seed(1)
    out, ctx = _forced_forward(kernel, q, k, v, config, mask, None)
    torch.manual_seed(1)
    again, _ = _forced_forward(kernel, q, k, v, config, mask, None)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    no_dropout, _ = _forced_forward(kernel, q, k, v, dataclasses.replace(config, dropout_p=0.0), mask, None)
    assert not torch.allclose(out, no_dropout), "dropout changed nothing"
    dout = randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    _, _, dv, _, _ = sdpa.fused_attn_bwd(dout, q, k, v, out, ctx, config, mask)
    lhs, rhs = (dv.float() * v.float()).sum(), (dout.float() * out.float()).sum()
    torch.testing.assert_close(lhs, rhs, rtol=2e-2, atol=1e-1)


@pytest.mark.gpu
def test_masked_attention_never_waits_for_the_gpu():
    """A boolean mask (padding / arbitrary) costs no host-device synchronization, forward or backward:
    whether it leaves a row without keys is not asked (which also made CUDA-graph captures fail)."""
    q, k, v = _qkv(2, 64, 64, 4, 4, 64, 64, torch.bfloat16, "cuda")
    mask = torch.rand(2, 1, 64, 64, device="cuda") < 0.2
    config = AttentionConfig(0.125)
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, ctx = sdpa.fused_attn_fwd(q, k, v, config, mask, None)
        sdpa.fused_attn_bwd(dout, q, k, v, out, ctx, config, mask, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
