"""transformer_engine.pytorch.ops: each op against a torch composition (outputs and gradients), TE's
parameter names and shapes, argument errors, and an MLP of ops against te.LayerNormMLP / te.Linear."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
import transformer_engine.pytorch.ops as te_ops
from tests.utils import dtype_tols, sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

CPU = "cpu"


def _grads(fn, *tensors, dy):
    """(y, grads of tensors) for y = fn(*tensors) and upstream gradient dy."""
    y = fn(*tensors)
    y.backward(dy)
    return y.detach(), [t.grad for t in tensors]


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad=True)


def _check(op, ref, x, dtype, oracle_dtype=torch.float64, tols=None):
    """op(x) and its grads against ref evaluated in ``oracle_dtype`` on copies of x and the op's parameters
    (tolerances: ``dtype_tols(dtype)`` unless ``tols``)."""
    params = list(op.parameters())
    y = op(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x.detach().to(oracle_dtype).requires_grad_(requires_grad=True)
    pr = [p.detach().to(oracle_dtype).requires_grad_(requires_grad=True) for p in params]
    yr = ref(xr, *pr)
    yr.backward(dy.to(oracle_dtype))
    tols = tols or dtype_tols(dtype)
    torch.testing.assert_close(y, yr.to(y.dtype), **tols)
    torch.testing.assert_close(x.grad, xr.grad.to(x.dtype), **tols)
    for p, r in zip(params, pr):
        torch.testing.assert_close(p.grad, r.grad.to(p.dtype), **tols)


# ------------------------------------------------------------------------------------------------- single ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)])
def test_basic_linear_and_bias(shape, dtype):
    # a bf16 GEMM output near a cancellation is a few bf16 ulps of its terms (~1e-2 * |x||w|) off the exact sum
    gemm_tols = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else None
    _check(te_ops.BasicLinear(24, 13, device=CPU, dtype=dtype), lambda x, w: x @ w.T, _leaf(*shape, dtype=dtype), dtype,
           tols=gemm_tols)
    bias = te_ops.Bias(24, device=CPU, dtype=dtype)
    with torch.no_grad():
        bias.bias.normal_()
    _check(bias, lambda x, b: x + b, _leaf(*shape, dtype=dtype), dtype)
    lin = te_ops.Linear(24, 13, device=CPU, dtype=dtype)
    with torch.no_grad():
        lin.bias.normal_()
    _check(lin, lambda x, w, b: x @ w.T + b, _leaf(*shape, dtype=dtype), dtype, tols=gemm_tols)


def _layer_norm(x, w, b, eps=1e-5):
    return F.layer_norm(x, w.shape, w, b, eps)


def _rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norms(dtype, zero_centered_gamma):
    shift = 1.0 if zero_centered_gamma else 0.0
    ln = te_ops.LayerNorm(40, eps=1e-3, device=CPU, dtype=dtype, zero_centered_gamma=zero_centered_gamma)
    rms = te_ops.RMSNorm(40, eps=1e-3, device=CPU, dtype=dtype, zero_centered_gamma=zero_centered_gamma)
    for p in (*ln.parameters(), *rms.parameters()):
        with torch.no_grad():
            p.normal_()
    _check(ln, lambda x, w, b: _layer_norm(x, w + shift, b, eps=1e-3), _leaf(6, 3, 40, dtype=dtype), dtype)
    _check(rms, lambda x, w: _rms_norm(x, w + shift, eps=1e-3), _leaf(6, 3, 40, dtype=dtype), dtype)


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _gated(act):
    def fn(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return fn


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x).square()


def _clamped(x, limit=7.0, alpha=1.702):
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + 1)


ACTIVATIONS = {
    "GELU": _gelu, "GLU": _gated(torch.sigmoid), "GEGLU": _gated(_gelu), "QGELU": _qgelu, "QGEGLU": _gated(_qgelu),
    "ReLU": F.relu, "ReGLU": _gated(F.relu), "SReLU": _srelu, "SReGLU": _gated(_srelu), "SiLU": F.silu,
    "SwiGLU": _gated(F.silu), "ClampedSwiGLU": _clamped,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations(name, dtype):
    _check(getattr(te_ops, name)(), lambda x: ACTIVATIONS[name](x),
           (3 * torch.randn(5, 3, 34)).to(dtype).requires_grad_(requires_grad=True), dtype)


def test_glu_interleave_size():
    s, x = 4, _leaf(6, 32)
    order = torch.arange(32).reshape(32 // (2 * s), 2, s).transpose(0, 1).reshape(-1)  # positions of [a, b] in x
    gathered = lambda t: t[..., order]  # noqa: E731
    for op, ref in ((te_ops.SwiGLU(glu_interleave_size=s), ACTIVATIONS["SwiGLU"]),
                    (te_ops.ClampedSwiGLU(limit=2.0, glu_interleave_size=s), lambda t: _clamped(t, limit=2.0))):
        x.grad = None
        _check(op, lambda t: ref(gathered(t)), x, torch.float32)


def test_cache_quantized_input_is_an_fp8_rounding_of_x():
    x = _leaf(16, 64)
    y, (dx,) = _grads(te_ops.SwiGLU(cache_quantized_input=True), x, dy=torch.ones(16, 32))
    y_ref, (dx_ref,) = _grads(te_ops.SwiGLU(), x.detach().clone().requires_grad_(requires_grad=True), dy=torch.ones(16, 32))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    assert sqnr(dx_ref, dx) > 20 and not torch.equal(dx, dx_ref)


def test_identity_reshape_and_extra_tensors():
    x = _leaf(2, 3, 4)
    _check(te_ops.Identity(), lambda t: t, x, torch.float32)
    x.grad = None
    _check(te_ops.Reshape((-1, 4)), lambda t: t.reshape(-1, 4), x, torch.float32)
    seq = te_ops.Sequential(te_ops.MakeExtraOutput(), te_ops.Reshape((6, 4)), te_ops.AddExtraInput())
    x.grad, e = None, _leaf(6, 4)
    y, side = seq(x, e)
    (y.sum() + 2 * side.sum()).backward()
    torch.testing.assert_close(y, x.detach().reshape(6, 4) + e.detach())
    assert torch.equal(side, x.detach()) and torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(e.grad, torch.ones(6, 4))


# ------------------------------------------------------------------------------------------------- MLP vs modules
def _recipe(name):
    return {"bf16": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
            "current": Float8CurrentScaling()}[name]


def _ops_mlp_like(mlp, norm, act):
    """A Sequential sharing te.LayerNormMLP ``mlp``'s parameters, built as Megatron's TEFusedMLP builds it."""
    norm_op = getattr(te_ops, norm)(mlp.layer_norm_weight.shape[0], eps=mlp.eps, device="meta", dtype=mlp.layer_norm_weight.dtype)
    norm_op.weight = mlp.layer_norm_weight
    if norm == "LayerNorm":
        norm_op.bias = mlp.layer_norm_bias
    ops = [norm_op]
    for weight, bias, op_act in ((mlp.fc1_weight, mlp.fc1_bias, act), (mlp.fc2_weight, mlp.fc2_bias, None)):
        linear = te_ops.BasicLinear(weight.size(1), weight.size(0), device="meta", dtype=weight.dtype)
        linear.weight = weight
        bias_op = te_ops.Bias(bias.numel(), device="meta", dtype=bias.dtype)
        bias_op.bias = bias
        ops += [linear, bias_op] + ([op_act()] if op_act else [])
    return te_ops.Sequential(*ops)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
@pytest.mark.parametrize("norm,act,te_act", [("LayerNorm", te_ops.GELU, "gelu"), ("RMSNorm", te_ops.SwiGLU, "swiglu")])
def test_sequential_mlp_equals_layernorm_mlp(recipe_name, norm, act, te_act):
    recipe, dtype = _recipe(recipe_name), torch.bfloat16
    mlp = te.LayerNormMLP(64, 128, normalization=norm, activation=te_act, params_dtype=dtype, device=CPU)
    for p in mlp.parameters():
        with torch.no_grad():
            p.add_(0.1 * torch.randn_like(p))
    seq = _ops_mlp_like(mlp, norm, act)
    assert all(a is b for a, b in zip(seq.parameters(), mlp.parameters()))
    x = torch.randn(4, 8, 64, dtype=dtype)
    results = []
    for model in (mlp, seq):
        xi = x.clone().requires_grad_(requires_grad=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(xi)
        y.backward(torch.ones_like(y) / y.numel() * 1e3)
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (y_a, dx_a, dp_a), (y_b, dx_b, dp_b) = results
    # the module adds the biases inside its GEMMs and fuses norm + cast: the same math, other roundings
    # (bf16: ~50 dB apart; FP8: one E4M3 step of a few elements moves)
    floor = 35 if recipe is None else 25
    for a, b in zip((y_a, dx_a, *dp_a), (y_b, dx_b, *dp_b)):
        assert sqnr(a.float(), b.float()) > floor


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_ops_linear_equals_te_linear(recipe_name):
    recipe = _recipe(recipe_name)
    ref = te.Linear(32, 48, params_dtype=torch.bfloat16, device=CPU)
    op = te_ops.Linear(32, 48, device=CPU, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.bias.normal_()
        op.weight.copy_(ref.weight)
        op.bias.copy_(ref.bias)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    outs = []
    for model in (ref, op):
        for _ in range(2):  # delayed scaling: the second step uses the first step's amax
            xi = x.clone().requires_grad_(requires_grad=True)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(xi)
            y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, model.weight.grad, model.bias.grad))
    floor = 35 if recipe is None else 25  # FP8: a rounding of y moves the amax, so a few casts move one step
    for a, b in zip(*outs):  # te.Linear adds b inside the GEMM (one rounding), the ops after it (two)
        assert sqnr(a.float(), b.float()) > floor


# ------------------------------------------------------------------------------------------------- parameters
def test_parameter_names_shapes_and_init():
    lin = te_ops.Linear(16, 8, device=CPU)
    assert [(n, tuple(p.shape)) for n, p in lin.named_parameters()] == [("weight", (8, 16)), ("bias", (8,))]
    assert lin.weight is lin.basic_ops[0].weight and lin.bias is lin.basic_ops[1].bias and not lin.bias.any()
    assert lin.weight.abs().max() <= 1 / math.sqrt(16)  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    new = torch.nn.Parameter(torch.zeros(8, 16))
    lin.weight = new
    assert lin.basic_ops[0].weight is new
    assert set(te_ops.Linear(16, 8, bias=False, device=CPU).state_dict()) == {"basic_ops.0.weight", "basic_ops.0._extra_state"}
    ln, rms = te_ops.LayerNorm((2, 3), device=CPU), te_ops.RMSNorm(5, zero_centered_gamma=True, device=CPU)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"] and ln.weight.shape == (2, 3) and bool((ln.weight == 1).all())
    assert [n for n, _ in rms.named_parameters()] == ["weight"] and not rms.weight.any()
    assert te_ops.BasicLinear(4, 2, device=CPU).weight.dtype == torch.get_default_dtype()
    assert isinstance(te_ops.GELU(), te_ops.FusibleOperation) and isinstance(lin, te_ops.FusibleOperation) and lin.is_fused_op


def test_meta_device_defers_init_to_first_forward():
    seq = te_ops.Sequential(te_ops.RMSNorm(8, device="meta"), te_ops.Linear(8, 4, device="meta"))
    assert all(p.is_meta for p in seq.parameters())
    y = seq(torch.randn(3, 8))
    assert y.shape == (3, 4) and not any(p.is_meta for p in seq.parameters())


def test_state_dict_round_trip_with_delayed_scaling():
    recipe = DelayedScaling(amax_history_len=4)
    make = lambda: te_ops.Sequential(te_ops.BasicLinear(16, 16, device=CPU), te_ops.GELU())  # noqa: E731
    a, b = make(), make()
    with te.autocast(recipe=recipe):
        a(torch.randn(8, 16)).sum().backward()
    b.load_state_dict(a.state_dict())
    assert torch.equal(b[0].weight, a[0].weight)
    torch.testing.assert_close(b[0].fp8_meta["scaling_fwd"].amax_history, a[0].fp8_meta["scaling_fwd"].amax_history)


def test_accumulate_into_main_grad():
    op = te_ops.BasicLinear(16, 8, device=CPU, accumulate_into_main_grad=True)
    op.weight.main_grad = torch.ones(8, 16)
    x = torch.randn(4, 16)
    op(x).sum().backward()
    torch.testing.assert_close(op.weight.main_grad, 1 + torch.ones(4, 8).T @ x)
    assert op.weight.grad is None
    op.weight.main_grad = None
    with pytest.raises(RuntimeError, match="main_grad"):
        op(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_constant_scale_and_l2_normalization(dtype):
    """Against float64 compositions of the formulas (TE's test oracles) on the same (``dtype``-rounded) inputs:
    y = c x; y = x rsqrt(sum x^2 + eps); the op rounds once to ``dtype``, its backward computes in float32."""
    torch.manual_seed(3)
    x = torch.randn(6, 5, 24, dtype=dtype).double()
    dy = torch.randn_like(x).to(dtype).double()
    for op, ref in ((te_ops.ConstantScale(-1.5), lambda t: -1.5 * t),
                    (te_ops.L2Normalization(eps=1e-3), lambda t: t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-3))):
        x_ref, x_test = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
        y_ref = ref(x_ref)
        y_ref.backward(dy)
        y = op(x_test)
        y.backward(dy.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), y_ref, **dtype_tols(dtype))
        torch.testing.assert_close(x_test.grad.double(), x_ref.grad, **dtype_tols(dtype))


@pytest.mark.parametrize("p", [0.0625, 0.5, 0.75])
def test_dropout(p):
    """Training: y = x m / (1 - p) with the same m in backward (x is shifted away from 0, so m = (y != 0)), and the
    fraction dropped within 4 standard deviations of p over 16k draws; evaluation: the identity; a quantized input is
    dequantized first."""
    torch.manual_seed(11)
    op = te_ops.Dropout(p)
    x = (torch.rand(128, 128) + 1.0).requires_grad_()
    dy = torch.randn(128, 128)
    y = op(x)
    y.backward(dy)
    keep = (y != 0).float() / (1 - p)
    torch.testing.assert_close(y, x.detach() * keep)
    torch.testing.assert_close(x.grad, dy * keep)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 4 * math.sqrt(p * (1 - p) / y.numel())
    op.eval()
    assert torch.equal(op(x), x)
    quantized = te.tensor.Float8CurrentScalingQuantizer(te.tensor.DType.kFloat8E4M3)(x.detach())
    assert torch.equal(op(quantized), quantized.dequantize())


def test_new_ops_trace_without_graph_breaks(fresh_dynamo):
    seq = te_ops.Sequential(te_ops.L2Normalization(), te_ops.ConstantScale(2.0), te_ops.Linear(32, 32, device=CPU), te_ops.Dropout(0.25))
    x = torch.randn(8, 32, requires_grad=True)
    explained = torch._dynamo.explain(seq)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [b.reason for b in explained.break_reasons]
    seq.eval()
    torch.testing.assert_close(torch.compile(seq, fullgraph=True, backend="aot_eager")(x), seq(x))


def _grid_input(recipe_name, shape, forward):
    """Values the recipe's cast of this direction reproduces exactly (TE's test builds them by a quantize-dequantize):
    the FP8 grid at scale 1 (delayed: a fresh state's scale; current: the largest magnitude is the format's max),
    and for the power-of-two block scales a quantize-dequantize by the public quantizer of that kind."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5 if forward else 6)) * 4
    fp8 = torch.float8_e4m3fn if forward else torch.float8_e5m2
    if recipe_name in ("delayed", "current"):
        x = x.to(fp8).to(torch.float32)
        x[0, 0] = torch.finfo(fp8).max
    elif recipe_name == "block":
        x = te.tensor.Float8BlockQuantizer(te.tensor.DType.kFloat8E4M3, rowwise=True, columnwise=True)(x).dequantize()
    elif recipe_name == "mxfp8":
        x = te.tensor.MXFP8Quantizer(te.tensor.DType.kFloat8E4M3)(x).dequantize()
    return x.to(torch.bfloat16)


QUANTIZE_RECIPES = {"delayed": DelayedScaling(fp8_format=Format.HYBRID), "current": Float8CurrentScaling(fp8_format=Format.HYBRID),
                    "block": Float8BlockScaling(fp8_format=Format.E4M3), "mxfp8": MXFP8BlockScaling(fp8_format=Format.E4M3)}


@pytest.mark.parametrize("cast_forward, cast_backward", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("recipe_name", list(QUANTIZE_RECIPES))
def test_quantize(recipe_name, cast_forward, cast_backward):
    """TE's test: y is a QuantizedTensor exactly when forward quantizes, x.grad when backward does; on inputs the casts
    reproduce, y decodes to x and dx to dy exactly; outside an FP8 autocast the operation is the identity."""
    x = _grid_input(recipe_name, (32, 64), forward=True).requires_grad_()
    dy = _grid_input(recipe_name, (32, 64), forward=recipe_name in ("block", "mxfp8"))  # E4M3 gradients there
    op = te_ops.Quantize(forward=cast_forward, backward=cast_backward)
    with te.autocast(recipe=QUANTIZE_RECIPES[recipe_name]):
        y = op(x)
    y.backward(dy)
    assert isinstance(y, te.tensor.QuantizedTensor) == cast_forward
    assert isinstance(x.grad, te.tensor.QuantizedTensor) == cast_backward
    decode = lambda t: t.dequantize() if isinstance(t, te.tensor.QuantizedTensor) else t  # noqa: E731
    assert torch.equal(decode(y), x.detach()) and torch.equal(decode(x.grad), dy)
    assert op(x) is x and op.num_quantizers("forward") == int(cast_forward)


def test_quantize_delayed_scaling_records_and_updates_its_slots():
    """The input slot's amax is recorded in forward and the scale updated at the autocast's exit (448 / amax, HYBRID,
    margin 0); the grad-output slot likewise at the end of backward (57344 / amax)."""
    op = te_ops.Quantize(forward=True, backward=True)
    x = (torch.randn(16, 32) * 3).requires_grad_()
    with te.autocast(recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)):
        y = op(x)
    dy = torch.randn(16, 32) * 5
    y.backward(dy)
    torch.testing.assert_close(op.fp8_meta["scaling_fwd"].scale[0], 448.0 / x.detach().abs().max())
    torch.testing.assert_close(op.fp8_meta["scaling_bwd"].scale[0], 57344.0 / dy.abs().max())


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_quantize_traces_without_graph_breaks(recipe_name, fresh_dynamo):
    """Traced, the operation hands on its quantize-dequantized values as a plain tensor (Dynamo cannot build a tensor
    subclass in a graph): one graph, the values eager's quantized tensor decodes to."""
    recipe = QUANTIZE_RECIPES[recipe_name]
    op = te_ops.Quantize(forward=True, backward=True)
    seq = te_ops.Sequential(op, te_ops.Linear(64, 32, device=CPU))

    def step(x):
        with te.autocast(recipe=recipe):
            return seq(x)

    x = _grid_input(recipe_name, (32, 64), forward=True).requires_grad_()
    step(x).float().sum().backward()  # the scaling state exists before tracing
    x.grad = None
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [b.reason for b in explained.break_reasons]

    def quantized(x):
        with te.autocast(recipe=recipe):
            return op(x)

    torch.testing.assert_close(torch.compile(quantized, fullgraph=True, backend="aot_eager")(x), quantized(x).dequantize(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make,error,match", [
    (lambda: te_ops.BasicLinear(4, 4, userbuffers_options={"comm_name": "fc1"}), NotImplementedError, "userbuffers_options"),
    (lambda: te_ops.BasicLinear(4, 4, dtype=torch.float64), ValueError, "float64"),
    (lambda: te_ops.BasicLinear(4, 4, tensor_parallel_mode="diagonal"), ValueError, "tensor_parallel_mode"),
    (lambda: te_ops.ClampedSwiGLU(glu_linear_offset=0.5), ValueError, "glu_linear_offset"),
    (lambda: te_ops.SwiGLU(glu_interleave_size=0), ValueError, "glu_interleave_size"),
    (lambda: te_ops.AddExtraInput(in_place=True), NotImplementedError, "in_place"),
    (lambda: te_ops.LayerNorm(0), ValueError, "normalized_shape"),
    (lambda: te_ops.RMSNorm(4, eps=-1.0), ValueError, "eps"),
    (lambda: te_ops.L2Normalization(eps=-1.0), ValueError, "eps"),
    (lambda: te_ops.Dropout(1.5), ValueError, "must be in \\[0, 1\\]"),
    (lambda: te_ops.Linear(4, 4, bias=False, device=CPU).register_parameter("bias", torch.nn.Parameter(torch.zeros(4))),
     ValueError, "bias=False"),
])
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_forward_errors():
    with pytest.raises(ValueError, match="last input dim to be 4"):
        te_ops.BasicLinear(4, 2, device=CPU)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="normalizes the last dims"):
        te_ops.LayerNorm(4, device=CPU)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="halves"):
        te_ops.SwiGLU()(torch.randn(2, 3))
    with pytest.raises(ValueError, match="extra inputs"):
        te_ops.Sequential(te_ops.Identity())(torch.randn(2), torch.randn(2))
    with pytest.raises(ValueError, match="extra inputs"):
        te_ops.AddExtraInput()(torch.randn(2))
    with pytest.raises(ValueError, match="divisible by 8"), te.autocast(recipe=Float8CurrentScaling()):
        te_ops.BasicLinear(16, 16, device=CPU)(torch.randn(3, 16))


# ------------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
def test_no_graph_breaks(recipe_name, fresh_dynamo):
    recipe = _recipe(recipe_name)
    seq = te_ops.Sequential(te_ops.LayerNorm(64, device=CPU), te_ops.Linear(64, 128, device=CPU), te_ops.GELU(),
                            te_ops.Linear(128, 64, device=CPU))

    def step(x):
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            return seq(x)

    x = torch.randn(16, 2, 64, requires_grad=True)
    step(x).float().sum().backward()  # delayed scaling: the state exists before tracing
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(x).float().sum().backward()


def test_basic_linear_exposes_its_quantizers_and_scaling_state_as_te_does():
    """TE's ``get_quantizer(mode, index)`` and ``_fp8_metas`` (its recipe tests read the delayed-scaling state
    through them): None before a quantized forward, then the scale of each slot and its amax history."""
    op = te_ops.BasicLinear(32, 32, device=CPU)
    assert op.get_quantizer("forward", 0) is None and op._fp8_metas == {"forward": None, "backward": None}
    x = torch.full((32, 32), 0.25, requires_grad=True)
    with torch.no_grad():
        op.weight.fill_(0.5)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = op(x)
    y.backward(torch.full_like(y, 0.75))
    history = op._fp8_metas["forward"]["scaling_fwd"].amax_history
    assert history[-1, :2].tolist() == [0.25, 0.5]  # the amaxes of x and W, rolled into the last row by the update
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 - the scales are float32 quotients
    assert op.get_quantizer("forward", 1).scale.item() == f32(448.0 / 0.5)
    assert op._fp8_metas["backward"]["scaling_bwd"].amax_history[-1, 0].item() == 0.75
    assert op.get_quantizer("backward", 0).scale.item() == f32(57344.0 / 0.75)
    with pytest.raises(ValueError, match="'forward' or 'backward'"):
        op.get_quantizer("fwd", 0)
