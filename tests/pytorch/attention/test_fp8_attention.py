"""FP8 attention (``fp8_dpa``): the catalog ops against float64 attention on the dequantized FP8 operands, and
``te.DotProductAttention`` under ``DelayedScaling(fp8_dpa=True)`` against its high-precision self, its scaling state in
TE's slots, and the settings it refuses.

Tolerances: E4M3 rounds to 3 mantissa bits (at most 2^-4 relative per element, about 3.6% RMS), E5M2 to 2 (2^-3, about
7% RMS). The forward rounds P and O once each (the oracle gets the same FP8 q, k, v): a relative norm error of 6% bounds
it; the module also rounds q, k, v, hence 8%. Gradients go through E5M2 dO, dP and dQ / dK / dV: 15% (dV, which skips
dP: 10%).
"""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn, rel_err
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import attention_fp8 as reference_fp8
from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.catalog.attention_fp8 import fp8_attention_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cast(x: torch.Tensor, dtype: torch.dtype):
    """(fp8(x * scale), scale_inv) with the scale that maps max|x| to the dtype's largest value."""
    scale = torch.finfo(dtype).max / x.abs().amax().float()
    return (x.float() * scale).to(dtype), 1.0 / scale


def _attention64(q, k, v, causal: bool, softmax_scale: float) -> torch.Tensor:
    """float64 attention of [b, s, h, d] tensors (GQA by repeating kv heads), [b, s, h, d] out."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = softmax_scale * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def _operands(b=2, s=24, h=4, h_kv=2, d=16):
    q, k, v = randn(b, s, h, d), randn(b, s, h_kv, d), randn(b, s, h_kv, d)
    scale = 448.0 / torch.stack([t.abs().amax() for t in (q, k, v)]).amax()
    q8, k8, v8 = ((t * scale).to(E4M3) for t in (q, k, v))
    return q8, k8, v8, 1.0 / scale


@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_forward_equals_float64_attention_of_the_fp8_operands(mask_type):
    q8, k8, v8, descale = _operands()
    config = AttentionConfig(softmax_scale=0.25, mask_type=mask_type)
    want = _attention64(q8.double() * descale, k8.double() * descale, v8.double() * descale, mask_type == "causal", 0.25)
    o_scale = 448.0 / want.abs().amax().float()
    o8, stats, amax_s, amax_o = ops.fused_attn_fp8_fwd(q8, k8, v8, qkv_scale_inv=descale, s_scale=torch.tensor(448.0),
                                                        o_scale=o_scale, config=config)
    assert o8.dtype == E4M3 and o8.shape == q8.shape and o8.is_contiguous() and stats.shape == (2, 4, 24)
    assert rel_err(want, o8.double() / o_scale) < 0.06
    assert torch.equal(amax_s, torch.tensor(1.0))  # exp(S - row max) is 1 at every row's maximum
    torch.testing.assert_close(amax_o.double(), want.abs().amax(), rtol=2**-4, atol=0)
    keys = (k8.double() * descale).transpose(1, 2).repeat_interleave(2, dim=1)  # GQA: 4 query heads on 2 kv heads
    s = 0.25 * (q8.double() * descale).transpose(1, 2) @ keys.transpose(-1, -2)
    if mask_type == "causal":
        s = s.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(stats.double(), torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_backward_equals_float64_gradients_of_the_fp8_operands(mask_type):
    q8, k8, v8, descale = _operands()
    config = AttentionConfig(softmax_scale=0.25, mask_type=mask_type)
    q, k, v = (t.double().mul(descale.double()).requires_grad_() for t in (q8, k8, v8))
    o64 = _attention64(q, k, v, mask_type == "causal", 0.25)
    do8, do_descale = _cast(randn(*o64.shape), E5M2)
    o64.backward(do8.double() * do_descale)
    o_scale = 448.0 / o64.detach().abs().amax().float()
    o8, stats, _, _ = ops.fused_attn_fp8_fwd(q8, k8, v8, qkv_scale_inv=descale, s_scale=torch.tensor(448.0), o_scale=o_scale, config=config)
    dp_scale = dqkv_scale = torch.tensor(1.0)
    for _ in range(2):  # the second call casts with the first one's amaxes, as delayed scaling would
        dq8, dk8, dv8, amax_dqkv, amax_dp = ops.fused_attn_fp8_bwd(
            do8, q8, k8, v8, o8, stats, qkv_scale_inv=descale, out_scale_inv=1.0 / o_scale, dout_scale_inv=do_descale,
            s_scale=torch.tensor(448.0), dp_scale=dp_scale, dqkv_scale=dqkv_scale, config=config)
        used = dqkv_scale
        dp_scale, dqkv_scale = 57344.0 / amax_dp, 57344.0 / amax_dqkv
    assert (dq8.dtype, dq8.shape, dk8.shape, dv8.shape) == (E5M2, q8.shape, k8.shape, v8.shape)
    assert rel_err(q.grad, dq8.double() / used) < 0.15 and rel_err(k.grad, dk8.double() / used) < 0.15
    assert rel_err(v.grad, dv8.double() / used) < 0.10
    torch.testing.assert_close(amax_dqkv.double(), torch.stack([t.grad.abs().amax() for t in (q, k, v)]).amax(), rtol=0.25, atol=0)


@pytest.mark.parametrize("change, match", [
    (dict(mask_type="causal_bottom_right"), "mask_type='causal_bottom_right'"),
    (dict(dropout_p=0.1), "dropout_p=0.1"),
    (dict(window_size=(4, 0)), "window_size=(4, 0)"),
    (dict(qkv_format="thd"), "4-D bshd"),
])
def test_settings_outside_the_ops_are_named(change, match):
    q8, k8, v8, _ = _operands()
    assert match in fp8_attention_error(q8, k8, v8, AttentionConfig(softmax_scale=0.25, **change))
    assert "square causal" in fp8_attention_error(q8, k8[:, :20], v8[:, :20], AttentionConfig(softmax_scale=0.25, mask_type="causal"))
    with pytest.raises(TypeError, match="one FP8 dtype"):
        reference_fp8.fused_attn_fp8_fwd(q8, k8.to(E5M2), v8, torch.tensor(1.0), torch.tensor(448.0), torch.tensor(1.0),
                                         AttentionConfig(softmax_scale=0.25))


def _dpa_and_inputs(qkv_format="bshd", attention_dropout=0.0, mask="causal", dtype=torch.bfloat16):
    dpa = te.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=qkv_format, attn_mask_type=mask,
                                 attention_dropout=attention_dropout)
    shape = (2, 32) if qkv_format == "bshd" else (32, 2)
    q = randn(*shape, 4, 16, dtype=dtype).requires_grad_()
    k, v = (randn(*shape, 2, 16, dtype=dtype).requires_grad_() for _ in range(2))
    return dpa, q, k, v


@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_module_under_fp8_dpa_tracks_high_precision_and_fills_te_slots(qkv_format, mask):
    dpa, q, k, v = _dpa_and_inputs(qkv_format, mask=mask)
    want = dpa(q, k, v)
    dy = randn(*want.shape, dtype=want.dtype)
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    for _ in range(3):
        with te.autocast(recipe=recipe):
            out = dpa(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dy)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert rel_err(want, out) < 0.08
    assert all(rel_err(w, g) < 0.15 for w, g in zip(want_grads, grads))
    fwd, bwd = dpa.fp8_meta["scaling_fwd"], dpa.fp8_meta["scaling_bwd"]
    assert fwd.amax_history.shape == (4, 9) and bwd.amax_history.shape == (4, 6)  # TE's 3 GEMMs
    newest_fwd, newest_bwd = fwd.amax_history[-1], bwd.amax_history[-1]
    assert newest_fwd[2] == torch.stack([t.detach().abs().amax().float() for t in (q, k, v)]).amax()  # QKV: one slot
    assert newest_fwd[8] == 1.0 and newest_fwd[3] > 0  # S, O
    assert newest_bwd[3] == dy.abs().amax().float() and newest_bwd[0] > 0 and newest_bwd[5] > 0  # dO, dQKV, dP
    used = {2, 3, 8}, {0, 3, 5}
    assert all(fwd.amax_history[:, i].eq(0).all() for i in range(9) if i not in used[0])
    assert all(bwd.amax_history[:, i].eq(0).all() for i in range(6) if i not in used[1])
    torch.testing.assert_close(fwd.scale[[2, 3, 8]], 448.0 / fwd.amax_history.amax(dim=0)[[2, 3, 8]])


def test_module_in_eval_mode_ignores_its_dropout():
    dpa, q, k, v = _dpa_and_inputs(attention_dropout=0.1)
    dpa.eval()
    with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
        out = dpa(q, k, v)
    assert rel_err(dpa(q, k, v), out) < 0.08


@pytest.mark.parametrize("call, match", [
    (lambda dpa, q, k, v: dpa.train()(q, k, v), "dropout_p=0.1"),
    (lambda dpa, q, k, v: dpa(q, k, v, attn_mask_type="padding", window_size=(-1, -1),
                                 attention_mask=torch.zeros(2, 1, 1, 32, dtype=torch.bool)),
     "padding or arbitrary masks"),
    (lambda dpa, q, k, v: dpa(q, k, v, checkpoint_core_attention=True), "checkpoint_core_attention"),
    (lambda dpa, q, k, v: dpa(q, k, v, window_size=(4, 0)), "window_size"),
])
def test_module_refuses_what_fp8_attention_does_not_implement(call, match):
    dpa, q, k, v = _dpa_and_inputs(attention_dropout=0.1)
    with pytest.raises(NotImplementedError, match=match):
        with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
            call(dpa, q, k, v)


def test_transformer_layer_trains_with_fp8_attention():
    """A TransformerLayer under DelayedScaling(fp8_dpa=True) (FP8 GEMMs and FP8 attention) follows the one with FP8 GEMMs
    and high-precision attention: the attention's extra roundings stay within the FP8 tolerance of the output."""
    layer = te.TransformerLayer(64, 256, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal")
    x = randn(32, 2, 64, dtype=torch.bfloat16)
    outs = {}
    for fp8_dpa in (False, True):
        recipe = DelayedScaling(fp8_dpa=fp8_dpa)
        for _ in range(2):
            with te.autocast(recipe=recipe):
                y = layer(x)
            y.sum().backward()
        outs[fp8_dpa] = y.detach()
        layer.zero_grad(set_to_none=True)
    assert torch.isfinite(outs[True]).all() and rel_err(outs[False], outs[True]) < 0.08
    assert layer.self_attention.core_attention.fp8_meta["scaling_fwd"] is not None


def _cudnn_fp8_attention():
    """vendor.cuda's FP8 attention module, or skip the test where cuDNN's FP8 graphs cannot run."""
    pytest.importorskip("cudnn", reason="needs the optional nvidia-cudnn-frontend package")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a GPU of compute capability 9.0 or newer")
    from transformer_engine.plugin.backends.vendor.cuda import attention_fp8

    return attention_fp8


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_cudnn_fp8_attention_equals_the_reference_backend(mask_type):
    """vendor.cuda's cuDNN graphs against the reference backend on the same FP8 operands (head size 128, what cuDNN runs
    on sm_90): cuDNN's online softmax quantizes P against running row maxima, so the two agree to FP8 accuracy; both
    report amax_s = 1 (what the probabilities' cast covers)."""
    vendor_fp8 = _cudnn_fp8_attention()
    torch.manual_seed(0)
    b, s, h, h_kv, d = 2, 256, 8, 4, 128
    q, k, v = (randn(b, s, heads, d, device="cuda") for heads in (h, h_kv, h_kv))
    scale = 448.0 / torch.stack([t.abs().amax() for t in (q, k, v)]).amax()
    q8, k8, v8 = ((t * scale).to(E4M3) for t in (q, k, v))
    config = AttentionConfig(softmax_scale=d**-0.5, mask_type=mask_type)
    s_scale, o_scale = torch.tensor(448.0, device="cuda"), torch.tensor(100.0, device="cuda")
    assert vendor_fp8.SUPPORTS["fused_attn_fp8_fwd"](q8, k8, v8, 1 / scale, s_scale, o_scale, config) is True
    got = vendor_fp8.fused_attn_fp8_fwd(q8, k8, v8, 1 / scale, s_scale, o_scale, config)
    want = reference_fp8.fused_attn_fp8_fwd(q8, k8, v8, 1 / scale, s_scale, o_scale, config)
    assert rel_err(want[0].double(), got[0].double()) < 0.05
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)  # stats
    assert got[2] == want[2] == 1.0
    do8, do_descale = _cast(randn(b, s, h, d, device="cuda", scale=0.01), E5M2)
    scales = (torch.tensor(2.0**14, device="cuda"), torch.tensor(2.0**10, device="cuda"))
    args = (do8, q8, k8, v8, want[0], want[1], 1 / scale, 1 / o_scale, do_descale, s_scale, *scales, config)
    got_grads, want_grads = vendor_fp8.fused_attn_fp8_bwd(*args), reference_fp8.fused_attn_fp8_bwd(*args)
    for g, w in zip(got_grads[:3], want_grads[:3]):
        assert g.shape == w.shape and rel_err(w.double(), g.double()) < 0.15


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_module_on_cudnn_tracks_high_precision(mask):
    """te.DotProductAttention under fp8_dpa on a GPU, head size 128 (cuDNN's FP8 graphs): after a few steps of delayed
    scaling (the scales come from the recorded amaxes) the output and gradients stay within FP8 accuracy of bf16."""
    _cudnn_fp8_attention()
    dpa = te.DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type=mask)
    q, k, v = (randn(2, 512, 8, 128, dtype=torch.bfloat16, device="cuda").requires_grad_() for _ in range(3))
    want = dpa(q, k, v)
    dy = randn(*want.shape, dtype=want.dtype, device="cuda")
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    for _ in range(3):
        with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
            out = dpa(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dy)
    assert rel_err(want, out) < 0.08 and all(rel_err(w, g) < 0.15 for w, g in zip(want_grads, grads))


def test_fp8_attention_state_is_checkpointed_in_te_format():
    """``_extra_state`` is empty until an FP8 attention call, then holds TE's payload (3 GEMMs), which a fresh module
    loads: the same scales and histories, and the same FP8 output on the next step."""
    dpa, q, k, v = _dpa_and_inputs()
    assert dpa.state_dict()["_extra_state"].numel() == 0
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    for _ in range(2):
        with te.autocast(recipe=recipe):
            out = dpa(q, k, v)
        out.sum().backward()
    fresh = te.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    fresh.load_state_dict(dpa.state_dict())
    for mode in ("scaling_fwd", "scaling_bwd"):
        for name in ("scale", "amax_history"):
            assert torch.equal(getattr(fresh.fp8_meta[mode], name), getattr(dpa.fp8_meta[mode], name))
    with te.autocast(recipe=recipe):
        assert torch.equal(fresh(q, k, v), dpa(q, k, v))
    linear = te.Linear(16, 16)
    with te.autocast(recipe=DelayedScaling()):
        linear(randn(8, 16))
    with pytest.raises(ValueError, match="holds 1 GEMMs but DotProductAttention has 3"):
        fresh.load_state_dict({"_extra_state": linear.state_dict()["_extra_state"]})


def test_compiled_fp8_attention_equals_eager():
    """torch.compile (aot_eager, on the CPU) of a step under fp8_dpa gives eager's outputs, gradients and scaling state
    bit for bit over several steps. Not yet in one graph: the FP8 attention ops are eager ops, so the step breaks
    around them (docs/compatibility.md)."""
    eager_dpa, q, k, v = _dpa_and_inputs()
    compiled_dpa = copy.deepcopy(eager_dpa)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)

    def step_of(dpa):
        def step(q, k, v):
            with te.autocast(recipe=recipe):
                return dpa(q, k, v)
        return step

    eager, compiled = step_of(eager_dpa), torch.compile(step_of(compiled_dpa), backend="aot_eager")
    dy = randn(2, 32, 64, dtype=torch.bfloat16)
    for _ in range(3):
        want, got = eager(q, k, v), compiled(q, k, v)
        assert torch.equal(want, got)
        for w, g in zip(torch.autograd.grad(want, (q, k, v), dy), torch.autograd.grad(got, (q, k, v), dy)):
            assert torch.equal(w, g)
    for mode in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(eager_dpa.fp8_meta[mode].amax_history, compiled_dpa.fp8_meta[mode].amax_history)
        assert torch.equal(eager_dpa.fp8_meta[mode].scale, compiled_dpa.fp8_meta[mode].scale)
