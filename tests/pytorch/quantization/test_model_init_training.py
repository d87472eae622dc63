"""quantized_model_init: training FP8 weight parameters (optimizers, preserved initial values), their checkpoints, their
memory, and Megatron's buffer swap."""

import gc
import io

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.quantization._model_init import MODULES, RECIPES, RECIPE_IDS, _build, _bytes, _pow2_current, _reference, _run
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from transformer_engine.pytorch.optimizers import FusedAdam
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.tensor import Float8BlockwiseQTensor, Float8Tensor, QuantizedTensor


# ------------------------------------------------------------------------------------------ optimizers


def _regression_batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 32, generator=g).bfloat16()
    target = (x.float() @ (torch.randn(32, 48, generator=g) * 0.1)).bfloat16()
    return x, target


def _loss(module, x, target, recipe):
    with te.autocast(recipe=recipe):
        y = module(x)
    return (y.float() - target.float()).square().mean()


@pytest.mark.parametrize("recipe", [DelayedScaling(), _pow2_current(), Float8CurrentScaling()], ids=["delayed", "current_pow2", "current"])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_torch_optimizer_on_fp32_masters_requantizes_through_copy(recipe, optimizer):
    """Masters in fp32, ``param.copy_(master)`` after each step; the loss falls, and each step the FP8 module
    equals a high-precision module given the FP8 weights' values and the same scaling state: bit for bit for
    delayed and power-of-two current scaling. Plain current scaling: the reference recomputes the scale from
    the bf16-rounded dequantized amax (amax(master) is an fp32 value now), up to 2^-9 off the stored scale,
    and an element near a rounding midpoint may then take the neighbouring FP8 value: the losses agree to 1%."""
    torch.manual_seed(4)
    module = _build("Linear", recipe)
    params = list(module.parameters())
    masters = [p.detach().float().clone() for p in params]  # a QuantizedTensor's .float() dequantizes
    opt = optimizer(masters, lr=0.5 if optimizer is torch.optim.SGD else 0.02)
    x, target = _regression_batch()
    losses = []
    for _ in range(6):
        ref = _reference(module, "Linear")
        loss = _loss(module, x, target, recipe)
        if isinstance(recipe, Float8CurrentScaling):
            torch.testing.assert_close(loss, _loss(ref, x, target, recipe), rtol=1e-2, atol=0)
        else:
            assert torch.equal(loss, _loss(ref, x, target, recipe))
        loss.backward()
        for master, p in zip(masters, params):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, params):
                p.copy_(master)
        assert isinstance(module.weight, Float8Tensor) and module.weight._transpose is None
        assert torch.equal(module.weight.dequantize(), module.weight._get_quantizer().quantize_impl(masters[0]).dequantize().bfloat16())
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_torch_sgd_directly_on_fp8_parameters():
    """No masters: the update runs on the dequantized values and is quantized back (lossy, but it works)."""
    module = _build("Linear", Float8CurrentScaling())
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    x, target = _regression_batch()
    before = module.weight.dequantize().clone()
    _loss(module, x, target, Float8CurrentScaling()).backward()
    opt.step()
    assert isinstance(module.weight, Float8Tensor) and not torch.equal(module.weight.dequantize(), before)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", MODULES)
def test_fused_adam_with_master_weights(name, recipe):
    """FusedAdam(master_weights=True) on FP8 parameters: masters step as torch.optim.AdamW on fp32 copies;
    each FP8 parameter is then its master re-quantized in place (same object, still FP8)."""
    torch.manual_seed(5)
    module = _build(name, recipe, preserve=True)
    params = list(module.parameters())
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, master_weights=True)
    for p in params:  # TE's recipe: masters from the preserved high-precision initial values
        init = p.get_high_precision_init_val() if isinstance(p, QuantizedTensor) else p.detach()
        opt.initialize_state(p)
        opt.set_scaled_state(p, "master_param", init.float())
    ref_masters = [opt.state[p]["master_param"].clone() for p in params]
    ref_opt = torch.optim.AdamW(ref_masters, lr=1e-2, weight_decay=0.01)
    x = torch.randn(24, 32, dtype=torch.bfloat16)
    for _ in range(3):
        _run(module, name, x, recipe)
        for p, m in zip(params, ref_masters):
            m.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for p, m in zip(params, ref_masters):
            torch.testing.assert_close(opt.state[p]["master_param"], m, rtol=1e-5, atol=1e-6)
        for weight_name in MODULES[name][2]:
            p = getattr(module, weight_name)
            assert isinstance(p, Float8BlockwiseQTensor if isinstance(recipe, Float8BlockScaling) else Float8Tensor)
            expected = p._get_quantizer().quantize_impl(opt.state[p]["master_param"]).dequantize()
            assert torch.equal(p.dequantize(dtype=torch.float32), expected)


def test_fused_adam_needs_master_weights_for_fp8_parameters():
    module = _build("Linear", DelayedScaling())
    opt = FusedAdam(module.parameters())
    _run(module, "Linear", torch.randn(16, 32, dtype=torch.bfloat16), DelayedScaling())
    with pytest.raises(NotImplementedError, match="needs master_weights=True"):
        opt.step()


# ------------------------------------------------------------------------------------------ init values


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_preserve_high_precision_init_val(recipe):
    """TE's test_quantized_model_init_high_precision_init_val: the kept values quantize to the parameter."""
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        assert FP8GlobalStateManager.with_fp8_parameters()
        layer = te.Linear(64, 64)
    assert not FP8GlobalStateManager.with_fp8_parameters()
    assert layer.primary_weights_in_fp8
    weight = layer.weight
    assert hasattr(weight, "_high_precision_init_val")
    init = weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and init.dtype == weight.dtype and type(init) is torch.Tensor
    new_weight = weight._get_quantizer().make_empty(shape=weight.shape, dtype=weight.dtype, device=weight.device)
    weight._get_quantizer().update_quantized(init.to(weight.device), new_weight)
    torch.testing.assert_close(new_weight.dequantize(dtype=weight.dtype), weight.dequantize(dtype=weight.dtype), rtol=0, atol=0)
    weight.clear_high_precision_init_val()
    assert weight.get_high_precision_init_val() is None and not hasattr(weight, "_high_precision_init_val")
    assert not hasattr(layer.bias, "get_high_precision_init_val")  # only the FP8 weights keep one, as TE
    with te.quantized_model_init(recipe=recipe):
        assert not hasattr(te.Linear(16, 16).weight, "get_high_precision_init_val")


# ------------------------------------------------------------------------------------------ checkpoints


def _train_a_step(module, name, recipe):
    opt = FusedAdam(module.parameters(), lr=1e-2, master_weights=True)
    _run(module, name, torch.randn(24, 32, dtype=torch.bfloat16), recipe)
    opt.step()


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", MODULES)
def test_state_dict_round_trip_with_weights_only_load(name, recipe):
    torch.manual_seed(6)
    module = _build(name, recipe)
    _train_a_step(module, name, recipe)  # scales and amax histories away from their initial values
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    loaded = _build(name, recipe)
    loaded.load_state_dict(state)
    for (n, p), q in zip(module.named_parameters(), loaded.parameters()):
        assert type(p) is type(q), n
        if isinstance(p, Float8Tensor):  # the FP8 bytes and scale, not a re-quantization
            assert torch.equal(p._data.view(torch.uint8), q._data.view(torch.uint8)) and torch.equal(p._scale_inv, q._scale_inv), n
        else:
            assert torch.equal(p, q), n
    if recipe.delayed():
        for key in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(module.fp8_meta[key].scale, loaded.fp8_meta[key].scale)
            assert torch.equal(module.fp8_meta[key].amax_history, loaded.fp8_meta[key].amax_history)
    x = torch.randn(24, 32, dtype=torch.bfloat16)
    assert torch.equal(_run(module, name, x, recipe)[0], _run(loaded, name, x, recipe)[0])
    # a high-precision module takes the dequantized values
    plain = MODULES[name][0](torch.bfloat16)
    plain.load_state_dict(state)
    assert torch.equal(getattr(plain, MODULES[name][2][0]), getattr(module, MODULES[name][2][0]).dequantize())


def test_loaded_delayed_scales_drive_the_next_requantization():
    module = _build("Linear", DelayedScaling())
    _train_a_step(module, "Linear", DelayedScaling())
    loaded = _build("Linear", DelayedScaling())
    loaded.load_state_dict(module.state_dict())
    scale = loaded.fp8_meta["scaling_fwd"].scale[1]
    assert scale != 1.0 and torch.equal(loaded.weight._get_quantizer().scale.view(()), scale)
    w = torch.randn(48, 32, dtype=torch.bfloat16) * 0.02
    with torch.no_grad():
        loaded.weight.copy_(w)
    assert torch.equal(loaded.weight._scale_inv.view(()), (1.0 / scale).view(()))


# ------------------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", MODULES)
def test_weight_memory_is_at_most_055x_of_bf16(name, recipe):
    """Measured on the storages: one FP8 byte per element plus a 4-byte scale_inv (0.5x + epsilon); the bf16
    buffer the weights were initialized in is freed."""
    bf16 = MODULES[name][0](torch.bfloat16)
    fp8 = _build(name, recipe)
    names = MODULES[name][2]
    bf16_bytes = _bytes([getattr(bf16, n) for n in names])
    fp8_bytes = _bytes([getattr(fp8, n) for n in names])
    assert fp8_bytes <= 0.55 * bf16_bytes, (fp8_bytes, bf16_bytes)
    print(f"{name}: FP8 weights {fp8_bytes} B vs bf16 {bf16_bytes} B = {fp8_bytes / bf16_bytes:.4f}x")
    del bf16
    gc.collect()
    shapes = {tuple(getattr(fp8, n).shape) for n in names}
    live = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.bfloat16
            and tuple(t.shape) in shapes]
    assert not live  # no high-precision copy of the weights survives construction


def test_large_linear_memory():
    """A 4096 x 4096 weight: 16 MiB + 4 B in FP8 against 32 MiB in bf16."""
    with te.quantized_model_init(recipe=DelayedScaling()):
        layer = te.Linear(4096, 4096, bias=False, params_dtype=torch.bfloat16)
    assert _bytes([layer.weight]) == 4096 * 4096 + 4


# ------------------------------------------------------------------------------------------ Megatron's buffer swap


def test_fp8_weight_bytes_moved_into_a_flat_uint8_buffer_as_megatrons_distributed_optimizer_does():
    """Megatron-Core (fp8_utils) moves each FP8 parameter's ``_data`` into its flat uint8 parameter buffer
    (asserting equal dtypes), then writes optimizer updates through Float8Tensors over 1-D shards of that buffer."""
    torch.manual_seed(11)
    module = _build("Linear", DelayedScaling())
    weight = module.weight
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    y_before = _run(module, "Linear", x, DelayedScaling())[0]
    flat = torch.zeros(2 * weight.numel(), dtype=torch.uint8)
    new_raw = flat[weight.numel():].view(weight.shape)
    assert weight._data.dtype == new_raw.dtype  # Megatron's assertion
    new_raw.copy_(weight._data)
    weight._data = new_raw
    module.fp8_meta["scaling_fwd"].scale.fill_(1.0)  # the first step's scale again: the same cast as before
    assert torch.equal(_run(module, "Linear", x, DelayedScaling())[0], y_before)
    # an optimizer step writes the new master values through a Float8Tensor over a shard of the buffer
    master = torch.randn(weight.shape) * 0.02
    shard = flat[weight.numel():weight.numel() + 100]
    out = Float8Tensor(shape=(100,), dtype=weight.dtype, data=shard, fp8_scale_inv=weight._scale_inv, fp8_dtype=weight._fp8_dtype,
                       quantizer=weight._get_quantizer())
    weight._get_quantizer().update_quantized(master.to(weight.dtype).view(-1)[:100], out)
    expected = weight._get_quantizer().quantize_impl(master.to(weight.dtype).view(-1)[:100])
    assert torch.equal(weight._data.view(-1)[:100], expected._data) and torch.equal(flat[weight.numel():][:100], expected._data)
