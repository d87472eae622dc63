"""quantized_model_init / fp8_model_init: FP8 weight parameters and the modules' forward and backward on them, eager
and compiled (training, checkpoints and memory: test_model_init_training.py; MXFP8 / NVFP4 weights:
test_model_init_block_scaled.py; shared modules and helpers: _model_init.py)."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.quantization._model_init import (
    MODULES, MX_MODULES, RECIPES, RECIPE_IDS, _build, _holding_the_initial_weights, _mx_build, _mx_run, _pow2_current, _reference, _run,
)
from tests.utils import sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.tensor import DType, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer, Float8Tensor, QuantizedTensor


# ------------------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", MODULES)
def test_weights_are_fp8_parameters(name, recipe):
    module = _build(name, recipe)
    for weight_name in MODULES[name][2]:
        weight = getattr(module, weight_name)
        block = isinstance(recipe, Float8BlockScaling)
        assert isinstance(weight, Float8BlockwiseQTensor if block else Float8Tensor) and isinstance(weight, QuantizedTensor)
        assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
        data, transpose = (weight._rowwise_data, weight._columnwise_data) if block else (weight._data, weight._transpose)
        assert weight.dtype == torch.bfloat16 and data.dtype == torch.uint8 and weight._fp8_dtype == DType.kFloat8E4M3  # TE's storage
        assert transpose is None  # one FP8 copy: W^T is transposed from it in backward
        assert dict(module.named_parameters())[weight_name] is weight
    others = [p for n, p in module.named_parameters() if n not in MODULES[name][2]]
    assert all(type(p) is torch.nn.Parameter for p in others)  # biases and norm weights stay high precision


def test_weights_are_quantized_with_the_recipes_weight_semantics():
    torch.manual_seed(0)
    hp = torch.randn(48, 32, dtype=torch.bfloat16) * 0.02
    init = lambda w: w.copy_(hp)  # noqa: E731
    with te.quantized_model_init(recipe=DelayedScaling()):
        delayed = te.Linear(32, 48, init_method=init, params_dtype=torch.bfloat16)
    # delayed: the weight slot's scale (1 before any update), its amax recorded into the history slot
    assert delayed.weight._scale_inv.item() == 1.0
    assert torch.equal(delayed.weight._data, hp.float().to(torch.float8_e4m3fn).view(torch.uint8))
    state = delayed.fp8_meta["scaling_fwd"]
    assert state.amax_history[0, 1] == hp.abs().max().float() and state.amax_history[0, 0] == 0
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        current = te.Linear(32, 48, init_method=init, params_dtype=torch.bfloat16)
    expected = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, columnwise=False)(hp)
    assert torch.equal(current.weight._data.view(torch.uint8), expected._data.view(torch.uint8))
    assert torch.equal(current.weight._scale_inv, expected._scale_inv)


def test_deferred_init_on_meta_quantizes_at_reset_parameters():
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        layer = te.Linear(32, 16, device="meta")
    assert layer.weight.device.type == "meta" and not isinstance(layer.weight, QuantizedTensor)
    layer.reset_parameters()
    assert isinstance(layer.weight, Float8Tensor) and layer.weight.device.type == "cpu"
    before = layer.weight
    layer.reset_parameters()  # again: re-quantized in place, the parameter object stays
    assert layer.weight is before


# ------------------------------------------------------------------------------------------ forward / backward


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", MODULES)
def test_equals_high_precision_module_holding_the_dequantized_weights(name, recipe):
    """bf16 parameters: bit for bit. The reference casts its weight again each step and gets the stored FP8
    bytes and scale back: delayed, with the same state scale; current, because amax(W) is a bf16 value, so
    fp8_max * scale_inv rounds back to it and the scale is recomputed exactly."""
    torch.manual_seed(1)
    module = _build(name, recipe)
    ref = _reference(module, name)
    x = torch.randn(24, 32, dtype=torch.bfloat16)
    y, dx = _run(module, name, x, recipe)
    y_ref, dx_ref = _run(ref, name, x, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for (param_name, p), p_ref in zip(module.named_parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.bfloat16, param_name  # gradients in high precision
        assert torch.equal(p.grad, p_ref.grad), param_name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES + [MXFP8BlockScaling()], ids=RECIPE_IDS + ["mxfp8"])
def test_on_the_gpu_equals_the_module_holding_the_dequantized_weights(recipe):
    """The check above through the GPU backends (flagos casts, cuBLASLt GEMMs: K = 512 keeps the block-scaled GEMMs
    on cuBLASLt; MXFP8 emulated where the GPU has no MXFP8 GEMM), bit for bit: both modules cast x alike and hand
    the GEMMs the same weight bytes and scales."""
    if not isinstance(recipe, MXFP8BlockScaling):
        available, reason = (te.is_fp8_block_scaling_available if isinstance(recipe, Float8BlockScaling) else te.is_fp8_available)(
            return_reason=True)
        if not available:
            pytest.skip(reason)
    torch.manual_seed(1)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        module = te.Linear(512, 512, params_dtype=torch.bfloat16, device="cuda")
    ref = te.Linear(512, 512, params_dtype=torch.bfloat16, device="cuda")
    if isinstance(recipe, MXFP8BlockScaling):  # two quantizations of W: the twin holds W (see the MXFP8 tests below)
        _holding_the_initial_weights(module, ref)
    else:
        ref.load_state_dict(module.state_dict())
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    (y, dx), (y_ref, dx_ref) = _run(module, "Linear", x, recipe), _run(ref, "Linear", x, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for p, p_ref in zip(module.parameters(), ref.parameters()):
        assert torch.equal(p.grad, p_ref.grad)


@pytest.mark.parametrize("name", MODULES)
def test_float32_parameters(name):
    """Delayed: bit for bit. Current: the FP8 bytes are the same, but the reference's scale, fp8_max /
    amax(q * scale_inv) in float32, may be 1 ulp off the stored one (amax(W) is an arbitrary float32), so
    outputs agree to a few float32 ulps per GEMM; a second GEMM (LayerNormMLP) may then round an
    activation to the neighbouring FP8 value (relative step 2^-3), hence the looser tolerance there.
    Power-of-two scales make every scale and scale_inv exact: bit for bit again (a recomputed scale that is
    2x the stored one gives 2x the FP8 values, the same products)."""
    torch.manual_seed(2)
    x = torch.randn(24, 32)
    for recipe, exact in ((DelayedScaling(), True), (_pow2_current(), True), (Float8CurrentScaling(), False)):
        module = _build(name, recipe, torch.float32)
        ref = _reference(module, name, torch.float32)
        y, _ = _run(module, name, x, recipe)
        y_ref, _ = _run(ref, name, x, recipe)
        if exact:
            assert torch.equal(y, y_ref), recipe
        else:
            tol = 1e-3 if name == "LayerNormMLP" else 2e-6
            torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * y_ref.abs().max().item())


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_forward_uses_the_stored_fp8_data_without_a_cast(recipe, monkeypatch):
    module = _build("Linear", recipe)
    from transformer_engine.plugin import ops

    casts = []
    for op in ("quantize", "cast_transpose", "quantize_transposed", "quantize_blockwise", "cast_transpose_blockwise",
               "cast_transpose_blockwise_dbias"):
        original = getattr(ops, op)
        monkeypatch.setattr(ops, op, lambda *a, _o=original, _n=op, **k: (casts.append((_n, tuple(a[0].shape))), _o(*a, **k))[1])
    _run(module, "Linear", torch.randn(16, 32, dtype=torch.bfloat16), recipe)
    assert casts and all(shape != (48, 32) and shape != (32, 48) for _, shape in casts), casts  # x and dy only


def test_outside_autocast_runs_on_the_dequantized_weights():
    module = _build("LayerNormMLP", DelayedScaling())
    ref = _reference(module, "LayerNormMLP")
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    assert torch.equal(module(x), ref(x))
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        assert torch.equal(module(x), ref(x))


@pytest.mark.parametrize("is_first_microbatch", [None, True, False])
def test_micro_batches_and_no_grad(is_first_microbatch):
    module = _build("Linear", DelayedScaling())
    ref = _reference(module, "Linear")
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        y = module(x, is_first_microbatch=is_first_microbatch)
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        assert torch.equal(y, ref(x, is_first_microbatch=is_first_microbatch))


def test_split_weights_fall_back_to_a_cast_of_the_dequantized_concatenation():
    """parameters_split: each split is its own FP8 parameter; forward casts their concatenation per step."""
    with te.quantized_model_init(recipe=DelayedScaling()):
        module = te.Linear(32, 48, parameters_split=("a", "b", "c"), params_dtype=torch.bfloat16)
    assert all(isinstance(getattr(module, f"{n}_weight"), Float8Tensor) for n in "abc")
    ref = te.Linear(32, 48, parameters_split=("a", "b", "c"), params_dtype=torch.bfloat16)
    ref.load_state_dict(module.state_dict())
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    y, dx = _run(module, "Linear", x, DelayedScaling())
    y_ref, dx_ref = _run(ref, "Linear", x, DelayedScaling())
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert torch.equal(module.a_weight.grad, ref.a_weight.grad)


def test_transformer_layer_runs_with_fp8_parameters():
    with te.quantized_model_init(recipe=DelayedScaling()):
        layer = te.TransformerLayer(64, 128, 4, params_dtype=torch.bfloat16)
    assert isinstance(layer.layernorm_mlp.fc1_weight, Float8Tensor)
    with te.autocast(recipe=DelayedScaling()):
        y = layer(torch.randn(8, 2, 64, dtype=torch.bfloat16))
    y.float().sum().backward()
    assert layer.layernorm_mlp.fc1_weight.grad is not None


# ------------------------------------------------------------------------------------------ recipes and errors


def test_recipe_mismatch_raises():
    with te.quantized_model_init(recipe=DelayedScaling()):
        layer = te.Linear(16, 16)
    with pytest.raises(RuntimeError, match="Recipe mismatch for Linear"):
        with te.autocast(recipe=Float8CurrentScaling()):
            layer(torch.randn(8, 16))


def test_fp8_model_init_is_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="fp8_model_init is deprecated"):
        ctx = te.fp8_model_init(enabled=True, recipe=Float8CurrentScaling())
    with ctx:
        assert FP8GlobalStateManager.get_model_init_recipe() == Float8CurrentScaling()
        layer = te.Linear(16, 16)
    assert isinstance(layer.weight, Float8Tensor)


def test_disabled_keeps_high_precision_weights():
    with te.quantized_model_init(enabled=False, recipe=DelayedScaling()):
        layer = te.Linear(16, 16)
    assert type(layer.weight) is torch.nn.Parameter and not layer.primary_weights_in_fp8


# ------------------------------------------------------------------------------------------ ops.Linear


@pytest.mark.parametrize("recipe", RECIPES + [MXFP8BlockScaling()], ids=RECIPE_IDS + ["mxfp8"])
def test_ops_linear_weight_is_an_fp8_parameter_read_without_a_cast(recipe, monkeypatch):
    """The fusible-ops ``Linear`` (NVIDIA TE's ``linear_op`` graph tests build it under quantized_model_init): its
    weight is the recipe's FP8 parameter, and the op trains bit for bit as one holding the weight it was cast from."""
    from transformer_engine.plugin import ops

    torch.manual_seed(10)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        module = te.ops.Sequential(te.ops.Linear(64, 96, dtype=torch.bfloat16))
    weight = module[0].weight
    assert isinstance(weight, QuantizedTensor) and isinstance(weight, torch.nn.Parameter)
    ref = _holding_the_initial_weights(module, te.ops.Sequential(te.ops.Linear(64, 96, dtype=torch.bfloat16)))
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    y_ref, dx_ref = _mx_run(ref, x, recipe)
    shapes = []
    for op in ("quantize", "cast_transpose", "quantize_transposed", "quantize_blockwise", "cast_transpose_blockwise", "quantize_mxfp8"):
        original = getattr(ops, op)
        monkeypatch.setattr(ops, op, lambda t, *a, _o=original, **k: (shapes.append(tuple(t.shape)), _o(t, *a, **k))[1])
    y, dx = _mx_run(module, x, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref) and torch.equal(weight.grad, ref[0].weight.grad)
    assert shapes and (96, 64) not in shapes and (64, 96) not in shapes, shapes  # x and dy only


# ------------------------------------------------------------------------------------------ torch.compile


def _autocast_step(module, call, recipe):
    """x -> call(module, x) under ``te.autocast(recipe=recipe)``."""
    def step(x):
        with te.autocast(recipe=recipe):
            return call(module, x)
    return step


def _sgd_steps(step, module, inputs):
    """Forward, backward and SGD on each input; (output, input gradient) of each."""
    opt, outs = torch.optim.SGD(module.parameters(), lr=0.01), []
    for x in inputs:
        x = x.clone().requires_grad_()
        y = step(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append((y.detach(), x.grad))
    return outs


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("recipe", RECIPES + [MXFP8BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)],
                         ids=RECIPE_IDS + ["mxfp8", "nvfp4"])
def test_fp8_parameters_train_under_torch_compile_as_eagerly(name, recipe):
    """FP8 (and FP4) weight parameters trace whole (the quantized tensors are traceable wrapper subclasses: torch.compile
    sees their buffers); three SGD steps compiled (fullgraph, ``aot_eager``) give eager's outputs, input gradients,
    parameters and scaling state bit for bit (NVFP4 without stochastic rounding, whose random bits the two runs
    would draw from different generator states)."""
    blocked = isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling))
    if blocked and name not in MX_MODULES:
        pytest.skip("MXFP8 / NVFP4 weights need dims that are multiples of 32 / 16 (MX_MODULES)")
    torch.manual_seed(0)
    eager = _mx_build(name, recipe) if blocked else _build(name, recipe)
    rows, features = (32, 64) if blocked else (24, 32)  # GroupedLinear's splits: 8, 0, 16 rows
    call = MODULES[name][1]
    xs = [torch.randn(rows, features, dtype=torch.bfloat16) for _ in range(4)]

    _sgd_steps(_autocast_step(eager, call, recipe), eager, xs[:1])  # the scaling state exists before tracing
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    step = torch.compile(_autocast_step(compiled, call, recipe), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(_sgd_steps(_autocast_step(eager, call, recipe), eager, xs[1:]), _sgd_steps(step, compiled, xs[1:])):
        assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    for (key, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        assert type(p_c) is type(p_e), key
        if isinstance(p_e, QuantizedTensor):  # the FP8 buffers and scales, byte for byte
            names, context = p_e.__tensor_flatten__()
            assert p_c.__tensor_flatten__() == (names, context), key
            assert all(torch.equal(getattr(p_c, attr), getattr(p_e, attr)) for attr in names), key
        else:
            assert torch.equal(p_c, p_e), key
    for role in ("scaling_fwd", "scaling_bwd"):
        state_e, state_c = eager.fp8_meta[role], compiled.fp8_meta[role]
        if getattr(state_e, "has_amax_history", False):
            assert torch.equal(state_c.amax_history, state_e.amax_history) and torch.equal(state_c.scale, state_e.scale), role


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
def test_fp8_parameters_under_inductor_on_gpu_track_eager(recipe):
    """FP8 weight parameters compiled by Inductor on the GPU (fullgraph): three training steps track eager's. The
    compiled norm, activation and casts are Inductor's kernels, eager's flagos', so SQNR, not bits: an activation
    that differs by one bf16 ulp lands on the neighbouring FP8 value (a step of 2^-3 relative in E4M3, 2^-2 in the
    E5M2 gradients) and the SGD steps requantize the weights from there; measured on an H100, outputs 34 dB and input
    gradients 23 dB at worst (current scaling). A wrong scale or operand (a factor of 2 is 0 dB) falls far below the
    bounds, 25 dB for outputs and 20 dB for the E5M2-cast gradients."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        eager = _build("LayerNormMLP", recipe)
        xs = [torch.randn(32, 32, dtype=torch.bfloat16) for _ in range(4)]

    call = MODULES["LayerNormMLP"][1]
    _sgd_steps(_autocast_step(eager, call, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    step = torch.compile(_autocast_step(compiled, call, recipe), fullgraph=True)
    for (y_e, dx_e), (y_c, dx_c) in zip(_sgd_steps(_autocast_step(eager, call, recipe), eager, xs[1:]), _sgd_steps(step, compiled, xs[1:])):
        assert sqnr(y_e, y_c) > 25.0 and sqnr(dx_e, dx_c) > 20.0
