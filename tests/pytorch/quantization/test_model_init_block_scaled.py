"""quantized_model_init with block-scaled weights: MXFP8 and NVFP4 weight parameters (both copies kept), their forward
and backward, optimizer steps, checkpoints and memory."""

import io

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.quantization._model_init import MX_MODULES, _bytes, _holding_the_initial_weights, _mx_build, _mx_run, _nv_build, _nv_run
from tests.utils import sqnr
from transformer_engine.common.recipe import CustomRecipe, MXFP8BlockScaling, NVFP4BlockScaling
from transformer_engine.pytorch.optimizers import FusedAdam
from transformer_engine.pytorch.tensor import DType, MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor


# ------------------------------------------------------------------------------------------ MXFP8 and NVFP4 parameters


MX_CUSTOM = CustomRecipe(qfactory=lambda role: MXFP8Quantizer(DType.kFloat8E4M3))


NV_CUSTOM = CustomRecipe(qfactory=lambda role: NVFP4Quantizer(with_2d_quantization=role == "linear_weight"))


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), MX_CUSTOM, NVFP4BlockScaling(), NV_CUSTOM],
                         ids=["mxfp8", "mxfp8_custom", "nvfp4", "nvfp4_custom"])
@pytest.mark.parametrize("name", MX_MODULES)
def test_block_scaled_weights_are_parameters_holding_both_copies_and_train_as_the_dequantized_module(name, recipe):
    """MXFP8: both copies (blocks along K for fprop, along N for dgrad's W^T) are two quantizations of W, kept as
    NVIDIA TE keeps MXFP8 weights; NVFP4: the module's two quantizations of W (16 x 16 tiles under the recipe's
    defaults). The module then computes bit for bit what a bf16 module holding W itself computes (its per-step
    casts of W give the stored copies; NVFP4's gradients with the same random bits), and dW is a plain
    high-precision tensor. The dequantized weights would not do: re-quantized along N, the row-wise copy's
    values do not give MXFP8's column-wise copy (other blocks, other scales)."""
    nvfp4 = isinstance(recipe, NVFP4BlockScaling) or recipe is NV_CUSTOM
    torch.manual_seed(8)
    module = _mx_build(name, recipe, preserve=True)
    for weight_name in MX_MODULES[name][1]:
        weight = getattr(module, weight_name)
        assert isinstance(weight, NVFP4Tensor if nvfp4 else MXFP8Tensor) and isinstance(weight, torch.nn.Parameter)
        assert weight.dtype == torch.bfloat16 and weight.get_usages() == {"rowwise": True, "columnwise": True}
        assert not nvfp4 or weight._get_quantizer().with_2d_quantization
    ref = _holding_the_initial_weights(module, MX_MODULES[name][0](torch.bfloat16))
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    (y, dx), (y_ref, dx_ref) = _nv_run(module, x, recipe), _nv_run(ref, x, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for (param_name, p), p_ref in zip(module.named_parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor and torch.equal(p.grad, p_ref.grad), param_name


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_forward_and_backward_read_the_stored_copies_without_a_cast(fmt, monkeypatch):
    from transformer_engine.plugin import ops

    build, run, op = {"mxfp8": (_mx_build, _mx_run, "quantize_mxfp8"), "nvfp4": (_nv_build, _nv_run, "quantize_nvfp4")}[fmt]
    module, shapes = build("Linear"), []
    original = getattr(ops, op)
    monkeypatch.setattr(ops, op, lambda x, *a, **k: (shapes.append(tuple(x.shape)), original(x, *a, **k))[1])
    run(module, torch.randn(32, 64, dtype=torch.bfloat16))
    assert shapes and (96, 64) not in shapes, shapes  # x and dy only


def test_mxfp8_weights_built_without_gradients_keep_the_row_wise_copy_only(monkeypatch):
    """NVIDIA TE's inference heuristic: built under no_grad, an MXFP8 weight holds its row-wise copy alone, which an
    inference forward reads as stored; a later training step casts the dequantized weight instead."""
    from transformer_engine.plugin import ops

    with torch.no_grad(), te.quantized_model_init(recipe=MXFP8BlockScaling()):
        module = te.Linear(64, 96)
    assert module.weight._rowwise_data is not None and module.weight._columnwise_data is None
    shapes, original = [], ops.quantize_mxfp8
    monkeypatch.setattr(ops, "quantize_mxfp8", lambda x, *a, **k: (shapes.append(tuple(x.shape)), original(x, *a, **k))[1])
    x = torch.randn(32, 64)
    with torch.inference_mode(), te.autocast(recipe=MXFP8BlockScaling()):
        y = module(x)
    assert shapes == [(32, 64)] and module.weight._columnwise_data is None  # x only: the weight is read as stored
    expected = x @ module.weight.dequantize().t() + module.bias
    assert sqnr(expected, y) > 25
    x.requires_grad_(requires_grad=True)
    with te.autocast(recipe=MXFP8BlockScaling()):
        module(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(module.weight.grad.float()).all()


def test_mxfp8_weight_memory_is_both_copies_and_their_scales():
    """Two FP8 bytes per element plus two E8M0 bytes per 32: (2 + 2/32) / 2 = 1.03x of bf16, no per-step cast."""
    bf16, mx = MX_MODULES["LayerNormMLP"][0](torch.bfloat16), _mx_build("LayerNormMLP")
    names = MX_MODULES["LayerNormMLP"][1]
    ratio = _bytes([getattr(mx, n) for n in names]) / _bytes([getattr(bf16, n) for n in names])
    assert ratio == pytest.approx((2 + 2 / 32) / 2)


# ------------------------------------------------------------------------------------------ NVFP4 parameters


def test_nvfp4_weight_stored_with_other_tiles_is_cast_as_the_autocast_recipe_casts():
    """A weight stored in 1 x 16 blocks (a CustomRecipe) under an autocast whose weights take 16 x 16 tiles: the stored
    copies are not what the GEMMs read, so the module casts the dequantized weight (as an MXFP8 weight read under
    no_grad-built usages), and still trains."""
    with te.quantized_model_init(recipe=CustomRecipe(qfactory=lambda role: NVFP4Quantizer())):
        module = te.Linear(64, 96, params_dtype=torch.bfloat16)
    assert not module.weight._get_quantizer().with_2d_quantization
    recipe = CustomRecipe(qfactory=lambda role: NVFP4Quantizer(with_2d_quantization=role == "linear_weight"))
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    y, dx = _nv_run(module, x, recipe)
    ref = te.Linear(64, 96, params_dtype=torch.bfloat16)
    ref.load_state_dict(module.state_dict())
    with torch.no_grad():
        ref.weight.copy_(module.weight.dequantize())
    y_ref, dx_ref = _nv_run(ref, x, recipe)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_parameters_step_through_fused_adam_masters_and_load_from_a_weights_only_checkpoint(fmt):
    """MXFP8 / NVFP4 weights: after a FusedAdam step with fp32 masters both copies (and their scales) are the
    re-quantization of the master; a weights_only checkpoint loads them byte for byte."""
    build, run, cls, keys = {
        "mxfp8": (_mx_build, _mx_run, MXFP8Tensor, ("_rowwise_data", "_columnwise_data")),
        "nvfp4": (_nv_build, _nv_run, NVFP4Tensor, ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")),
    }[fmt]
    torch.manual_seed(9)
    module = build("LayerNormMLP", preserve=True)
    opt = FusedAdam(module.parameters(), lr=1e-2, master_weights=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    before = module.fc1_weight.dequantize()
    run(module, x)
    opt.step()
    for weight_name in MX_MODULES["LayerNormMLP"][1]:
        p = getattr(module, weight_name)
        assert isinstance(p, cls) and p.get_usages() == {"rowwise": True, "columnwise": True}
        expected = p._get_quantizer().quantize_impl(opt.state[p]["master_param"])
        for key in keys:  # re-quantized from the master
            assert torch.equal(getattr(p, key).view(torch.uint8), getattr(expected, key).view(torch.uint8)), (weight_name, key)
    assert not torch.equal(module.fc1_weight.dequantize(), before)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    loaded = build("LayerNormMLP")
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(loaded.fc2_weight._columnwise_data.view(torch.uint8), module.fc2_weight._columnwise_data.view(torch.uint8))
    assert torch.equal(run(loaded, x)[0], run(module, x)[0])


def test_nvfp4_weight_memory_is_two_fp4_copies_and_their_tile_scales():
    """Per element and copy half a byte of E2M1 codes plus one E4M3 byte per 16 (the tile's scale in each of its 16 rows),
    both copies: (2 * (0.5 + 1/16)) / 2 = 0.5625x of bf16, plus two float32 amaxes a weight."""
    bf16, nv = MX_MODULES["LayerNormMLP"][0](torch.bfloat16), _nv_build("LayerNormMLP")
    names = MX_MODULES["LayerNormMLP"][1]
    stored, dense = _bytes([getattr(nv, n) for n in names]), _bytes([getattr(bf16, n) for n in names])
    assert stored == dense * (2 * (0.5 + 1 / 16)) / 2 + len(names) * 2 * 4
