"""quantized_model_init / fp8_model_init: recipe recorded, init values kept, recipe mismatch."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


def test_modules_remember_the_recipe_and_keep_init_values():
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        assert FP8GlobalStateManager.with_fp8_parameters()
        layer = te.Linear(16, 16)
    assert not FP8GlobalStateManager.with_fp8_parameters()
    assert layer.primary_weights_in_fp8
    init = layer.weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and torch.equal(init, layer.weight.detach().cpu())
    layer.weight.clear_high_precision_init_val()
    assert layer.weight.get_high_precision_init_val() is None
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        layer(torch.randn(8, 16))


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


def test_unimplemented_recipe_raises():
    with pytest.raises(NotImplementedError, match="MXFP8BlockScaling"):
        with te.quantized_model_init(recipe=MXFP8BlockScaling()):
            pass
