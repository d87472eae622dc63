"""te.Linear against torch.nn.Linear (fp32 / bf16 / fp16), in FP8 by SQNR, and its options and errors."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import forward_backward
from tests.utils import dtype_tols, randn, sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

# TE's test_linear_accuracy tolerances (reference/te_pytorch_api.md section 5).
OUT_ATOL = {torch.float32: 5e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
GRAD_RTOL = {torch.float32: 1.3e-6, torch.float16: 1e-2, torch.bfloat16: 2e-2}
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()]


def _pair(in_f, out_f, dtype, bias=True, **kwargs):
    layer = te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, **kwargs)
    ref = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    ref.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "_extra_state"})
    return layer, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias, return_bias", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 1, 16)])
def test_linear_accuracy(dtype, bias, return_bias, shape):
    layer, ref = _pair(shape[-1], 23, dtype, bias, return_bias=return_bias)
    x, dy = randn(*shape, dtype=dtype), randn(*shape[:-1], 23, dtype=dtype)
    out, dx, grads = forward_backward(layer, x, dy)
    if return_bias:
        _, b = layer(x)
        assert b.dtype == dtype and torch.equal(b, layer.bias)
    ref_out, ref_dx, ref_grads = forward_backward(ref, x, dy)
    if return_bias:  # the bias is returned separately, not added
        ref_out = ref_out - ref.bias.detach()
        ref_grads["bias"] = None
    tols = dict(rtol=dtype_tols(dtype)["rtol"], atol=OUT_ATOL[dtype])
    torch.testing.assert_close(out, ref_out, **tols)
    gtols = dict(rtol=GRAD_RTOL[dtype], atol=OUT_ATOL[dtype])
    torch.testing.assert_close(dx, ref_dx, **gtols)
    for name, grad in grads.items():
        if ref_grads[name] is None:
            assert grad is None
        else:
            torch.testing.assert_close(grad, ref_grads[name], **gtols)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8_sqnr(recipe, dtype):
    """FP8 vs high precision: output >= 25 dB, input and weight grads >= 20 dB (E5M2 gradients); measured 28 / 24."""
    layer, ref = _pair(64, 48, dtype)
    x, dy = randn(4, 8, 64, dtype=dtype), randn(4, 8, 48, dtype=dtype)
    with te.autocast(recipe=recipe):  # a first step calibrates the delayed scales
        layer(x).backward(dy)
    layer.zero_grad()
    with te.autocast(recipe=recipe):
        out, dx, grads = forward_backward(layer, x, dy)
    ref_out, ref_dx, ref_grads = forward_backward(ref, x, dy)
    assert out.dtype == dtype and dx.dtype == dtype and grads["weight"].dtype == dtype
    assert sqnr(ref_out, out) >= 25.0
    assert sqnr(ref_dx, dx) >= 20.0
    assert sqnr(ref_grads["weight"], grads["weight"]) >= 20.0
    assert sqnr(ref_grads["bias"], grads["bias"]) >= 30.0  # from high-precision dy


def _saved_during_forward(layer, x, recipe, **kwargs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        with te.autocast(recipe=recipe):
            layer(x, **kwargs)
    return saved


def test_fp8_saves_the_input_in_fp8_and_no_copy_of_the_weight(recast_weight_transpose):
    layer = te.Linear(32, 16)
    x = torch.randn(48, 32, requires_grad=True)
    saved = _saved_during_forward(layer, x, Float8CurrentScaling())
    assert [shape for dtype, shape in saved if dtype == torch.float8_e4m3fn] == [(32, 48)]  # x^T, what wgrad reads
    assert (torch.float32, (16, 32)) in saved  # W itself: backward casts W^T again (no FP8 copy held)
    assert all(shape in ((), (16, 32)) for dtype, shape in saved if dtype == torch.float32)  # scale_inv, W
    cached = _saved_during_forward(layer, x, Float8CurrentScaling(), is_first_microbatch=True)
    assert [shape for dtype, shape in cached if dtype == torch.float8_e4m3fn] == [(32, 48), (32, 16)]  # x^T, cached W^T


def test_a_small_weight_keeps_its_fp8_transpose_from_forward():
    # at most KEEP_WEIGHT_T_MAX_NUMEL elements: forward writes W and W^T in one pass and saves W^T, not W
    layer = te.Linear(32, 16)
    saved = _saved_during_forward(layer, torch.randn(48, 32, requires_grad=True), Float8CurrentScaling())
    assert [shape for dtype, shape in saved if dtype == torch.float8_e4m3fn] == [(32, 48), (32, 16)]  # x^T, W^T
    assert (torch.float32, (16, 32)) not in saved


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("make", [lambda: te.Linear(64, 48), lambda: te.LayerNormLinear(64, 80), lambda: te.LayerNormMLP(64, 96)],
                         ids=["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("recast", [True, False], ids=["recast", "kept"])
def test_weight_transpose_cast_in_backward_equals_the_cached_one(recipe, make, recast, request):
    """W^T cast again in backward or kept from forward (no cache) has the values of the W^T cast in forward (cache):
    same grads, bit for bit."""
    if recast:
        request.getfixturevalue("recast_weight_transpose")
    torch.manual_seed(0)
    fresh = make()
    cached = copy.deepcopy(fresh)
    x, dy = randn(128, 64), randn(128, 64 if isinstance(fresh, te.LayerNormMLP) else fresh.out_features)
    results = []
    for layer, kwargs in ((fresh, {}), (cached, {"is_first_microbatch": True})):
        for step in range(2):  # the second step casts with scales the first one updated
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                y = layer(xi, **kwargs)
            y.backward(dy)
        results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [lambda: te.Linear(64, 48), lambda: te.LayerNormLinear(64, 80), lambda: te.LayerNormMLP(64, 96)])
def test_no_fp8_weight_copy_lives_from_forward_to_backward(make, recast_weight_transpose):
    """Without a weight cache no FP8 copy of a weight stays alive after forward (backward casts W^T again);
    with ``is_first_microbatch=True`` the cache keeps W and W^T."""
    import gc

    layer = make()
    weights = [tuple(p.shape) for p in layer.parameters() if p.dim() == 2]

    def live_fp8():
        gc.collect()
        return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn]

    earlier = {id(t) for t in live_fp8()}  # what other tests of the process keep alive (a client's prepared model)

    def live_fp8_weights():
        shapes = [tuple(t.shape) for t in live_fp8() if id(t) not in earlier]
        return sorted(s for s in shapes if s in weights or s[::-1] in weights)

    for cache, expected in ((None, []), (True, sorted(weights + [w[::-1] for w in weights]))):
        with te.autocast(recipe=DelayedScaling()):
            y = layer(randn(32, 64).requires_grad_(requires_grad=True), is_first_microbatch=cache)
        assert live_fp8_weights() == expected
        y.sum().backward()


def test_torch_autocast_interplay():
    layer, ref = _pair(32, 16, torch.float32)
    x, dy = randn(2, 8, 32), randn(2, 8, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, dx, grads = forward_backward(layer, x, dy)
        ref_out, ref_dx, ref_grads = forward_backward(ref, x, dy)
    assert out.dtype == torch.bfloat16 and dx.dtype == torch.float32 and grads["weight"].dtype == torch.float32
    tols = dtype_tols(torch.bfloat16) | dict(atol=5e-2)
    torch.testing.assert_close(out, ref_out, **tols)
    torch.testing.assert_close(grads["weight"], ref_grads["weight"], **tols)


def test_noncontiguous_input_gives_identical_results():
    layer = te.Linear(32, 16)
    base = randn(32, 8, 2)
    x_t = base.permute(1, 2, 0)  # [8, 2, 32], non-contiguous
    dy = randn(8, 2, 16)
    out_t, dx_t, g_t = forward_backward(layer, x_t, dy)
    layer.zero_grad()
    out_c, dx_c, g_c = forward_backward(layer, x_t.contiguous(), dy)
    assert not x_t.is_contiguous()
    assert torch.equal(out_t, out_c) and torch.equal(dx_t, dx_c) and torch.equal(g_t["weight"], g_c["weight"])


def test_parameters_split_matches_one_weight():
    split = te.Linear(16, 24, parameters_split={"query": 8, "key": 8, "value": 8})
    assert [n for n, _ in split.named_parameters()] == ["query_weight", "query_bias", "key_weight", "key_bias", "value_weight",
                                                        "value_bias"]
    whole = te.Linear(16, 24)
    with torch.no_grad():
        whole.weight.copy_(torch.cat([split.query_weight, split.key_weight, split.value_weight]))
        whole.bias.copy_(torch.cat([split.query_bias, split.key_bias, split.value_bias]))
    x, dy = randn(4, 16), randn(4, 24)
    out_s, _, g_s = forward_backward(split, x, dy)
    out_w, _, g_w = forward_backward(whole, x, dy)
    assert torch.equal(out_s, out_w)
    assert torch.equal(torch.cat([g_s["query_weight"], g_s["key_weight"], g_s["value_weight"]]), g_w["weight"])
    equal = te.Linear(16, 24, parameters_split=("a", "b"))
    assert equal.a_weight.shape == (12, 16)
    with pytest.raises(ValueError, match="sum to out_features"):
        te.Linear(16, 24, parameters_split={"a": 8})


@pytest.mark.parametrize("placeholder", [False, True])
def test_fuse_wgrad_accumulation_into_main_grad(placeholder):
    layer = te.Linear(16, 8, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(8, 16)
    if placeholder:
        layer.weight.grad_added_to_main_grad = False
        layer.weight.zero_out_wgrad = True
    x, dy = randn(4, 16), randn(4, 8)
    for _ in range(2):
        layer(x).backward(dy)
    torch.testing.assert_close(layer.weight.main_grad, 2 * dy.t() @ x, rtol=1e-5, atol=1e-5)
    if placeholder:
        assert layer.weight.grad_added_to_main_grad and torch.equal(layer.weight.grad, torch.zeros(8, 16))
    else:
        assert layer.weight.grad is None


def test_is_first_microbatch_caches_the_fp8_weight():
    layer = te.Linear(32, 16)
    x = randn(16, 32)
    recipe = Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.add_(1.0)
        cached = layer(x, is_first_microbatch=False)
        fresh = layer(x, is_first_microbatch=None)
    assert torch.equal(first, cached) and not torch.equal(first, fresh)


def test_meta_device_and_reset_parameters():
    layer = te.Linear(256, 256, device="meta")
    assert layer.weight.device.type == "meta"
    layer.reset_parameters()
    assert layer.weight.device.type == "cpu" and torch.all(layer.bias == 0)
    assert abs(layer.weight.std().item() - 0.023) < 0.002 and abs(layer.weight.mean().item()) < 0.002
    layer(randn(2, 256))


def test_construction_styles_and_init_method():
    seen = []
    layer = te.Linear(16, 8, bias=False, init_method=lambda w: seen.append(w.shape) or w.fill_(0.5), dtype=torch.bfloat16)
    assert layer.bias is None and layer.weight.dtype == torch.bfloat16 and seen == [torch.Size([8, 16])]
    assert torch.all(layer.weight == 0.5)
    assert te.Linear(16, 8).weight.dtype == torch.get_default_dtype()
    with pytest.raises(NotImplementedError, match="save_original_input=True.* sequence parallelism in column mode"):
        te.Linear(16, 8, save_original_input=True, sequence_parallel=True, parallel_mode="column")


@pytest.mark.parametrize("mode, shape", [("column", (8, 32)), ("row", (16, 16)), (None, (16, 32))])
def test_tensor_parallel_arguments(mode, shape):
    layer = te.Linear(32, 16, tp_size=2, parallel_mode=mode, tp_group=None, sequence_parallel=True)
    assert tuple(layer.weight.shape) == shape and layer.tp_size == 2
    if mode is not None:
        assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == (0 if mode == "column" else 1)
    with pytest.raises(ValueError, match="parallel_mode"):
        te.Linear(32, 16, parallel_mode="diagonal")


def test_bad_inputs():
    layer = te.Linear(32, 16)
    with pytest.raises(TypeError, match=r"torch\.float16.*torch\.float32"):
        layer(randn(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"in_features=32.*\(4, 31\)"):
        layer(randn(4, 31))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([1.0] * 32)
    with te.autocast(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match=r"divisible by 8.*divisible by 16.*input has shape \(3, 5, 32\)"):
            layer(randn(3, 5, 32))
        with pytest.raises(ValueError, match=r"weight has shape \(12, 32\)"):
            te.Linear(32, 12)(randn(8, 32))


def test_nan_and_inf_in_fp8_input_do_not_poison_the_scale():
    layer = te.Linear(16, 16)
    x = randn(8, 16)
    x[0, 0], x[1, 3] = float("nan"), float("inf")
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        out = layer(x)
    state = layer.fp8_meta["scaling_fwd"]
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    assert state.amax_history[-1, 0] == finite.abs().max()  # recorded amax ignores NaN / inf
    assert torch.all(torch.isfinite(state.scale)) and state.scale[0] == 448.0 / finite.abs().max()
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()  # NaN propagates, inf saturates


def _fake_fp8(t, fp8_dtype):
    """Current-scaling cast written with torch alone: scale = fp8_max / amax, saturating cast, dequantized in fp32."""
    fp8_max = torch.finfo(fp8_dtype).max
    scale = fp8_max / t.abs().max().float()
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype).float() / scale


def test_current_scaling_matches_the_emulated_math():
    """Tier 1: the module's three FP8 GEMMs equal fp32 GEMMs of independently quantized operands."""
    layer = te.Linear(64, 32)
    x, dy = randn(16, 64), randn(16, 32, scale=1e-3)
    with te.autocast(recipe=Float8CurrentScaling()):
        out, dx, grads = forward_backward(layer, x, dy)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x_q, w_q, dy_q = _fake_fp8(x, e4m3), _fake_fp8(layer.weight.detach(), e4m3), _fake_fp8(dy, e5m2)
    torch.testing.assert_close(out, x_q @ w_q.t() + layer.bias.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dy_q @ w_q, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grads["weight"], dy_q.t() @ x_q, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grads["bias"], dy.sum(0), rtol=1e-5, atol=1e-8)


def _block_fp8(t: torch.Tensor, block) -> torch.Tensor:
    """t quantized in ``block`` tiles (power-of-two scales, E4M3) and dequantized, by the reference ops."""
    from transformer_engine.plugin.backends.reference import quantization as ref

    q, scale_inv = ref.quantize_blockwise(t, torch.float8_e4m3fn, block[0], block[1], power_2_scale=True, amax_epsilon=0.0)
    return ref.dequantize_blockwise(q, scale_inv, block[0], block[1], torch.float32)


def test_block_scaling_matches_the_emulated_math():
    """Each GEMM reads its operands quantized along its own K: x, dy in 1 x 128 row blocks for fprop /
    dgrad and in 128 x 1 column blocks for wgrad; W in 128 x 128 tiles (its transpose for dgrad)."""
    layer = te.Linear(160, 144)  # ragged tiles on every side
    x, dy = randn(272, 160), randn(272, 144, scale=1e-3)
    with te.autocast(recipe=Float8BlockScaling()):
        out, dx, grads = forward_backward(layer, x, dy)
    row, square = (1, 128), (128, 128)
    w_q = _block_fp8(layer.weight.detach(), square)
    x_rows, x_cols = _block_fp8(x, row), _block_fp8(x.t(), row).t()
    dy_rows, dy_cols = _block_fp8(dy, row), _block_fp8(dy.t(), row).t()
    torch.testing.assert_close(out, x_rows @ w_q.t() + layer.bias.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dy_rows @ w_q, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grads["weight"], dy_cols.t() @ x_cols, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(x_rows, x_cols)  # the two quantizations of x differ: the test tells them apart
