"""``module.quantizers``: NVIDIA TE's public quantizer classes, one per slot, casting as the module does."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import (
    CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
)
from transformer_engine.pytorch import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer, QuantizedTensor,
)
from transformer_engine.pytorch.tensor import DType

PUBLIC_CLASSES = {
    "delayed": (DelayedScaling(amax_history_len=4), Float8Quantizer),
    "current": (Float8CurrentScaling(), Float8CurrentScalingQuantizer),
    "block": (Float8BlockScaling(), Float8BlockQuantizer),
    "mxfp8": (MXFP8BlockScaling(), MXFP8Quantizer),
    "nvfp4": (NVFP4BlockScaling(disable_stochastic_rounding=True), NVFP4Quantizer),
}


def _ran(recipe, module=None):
    module = module if module is not None else te.LayerNormMLP(64, 128)
    with te.autocast(recipe=recipe):
        module(randn(32, 64)).sum().backward()
    return module


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_quantizers_are_the_public_classes_and_cast_as_the_module(name):
    """Each slot's public quantizer turns x into a QuantizedTensor whose values are those of the module's own cast of
    x with that slot (the same rule, scale and tiles), forward and backward slots alike."""
    recipe, cls = PUBLIC_CLASSES[name]
    module = _ran(recipe)
    x = randn(64, 128)
    for key in ("scaling_fwd", "scaling_bwd"):
        public, internal = module.quantizers[key], module._slot_quantizers[key]
        assert len(public) == len(internal) == {"scaling_fwd": 6, "scaling_bwd": 4}[key]
        for q, q_module in zip(public, internal):
            assert isinstance(q, cls)
            made = q(x)
            assert isinstance(made, QuantizedTensor)
            expected = q_module.quantize(x).dequantize(torch.float32)
            assert torch.equal(made.dequantize(dtype=torch.float32), expected), (key, type(q).__name__)


def test_delayed_quantizers_read_and_write_the_state_slot():
    """DelayedScaling: quantizer i's scale and amax are views of the state's scale[i] and amax_history[0, i], taken at
    each use (the state's tensors may be replaced, e.g. by a history length change), and its format follows the recipe."""
    module = _ran(DelayedScaling(amax_history_len=4))
    state, q = module.fp8_meta["scaling_fwd"], module.quantizers["scaling_fwd"][0]
    state.scale[0] = 2.0
    assert q.scale.item() == 2.0 and q.scale.data_ptr() == state.scale.data_ptr()
    state.amax_history[0].zero_()
    q(torch.tensor([[1.0, -3.0]]).repeat(16, 8))
    assert state.amax_history[0, 0].item() == 3.0
    with pytest.warns(UserWarning, match="Quantizer is being updated"):
        _ran(DelayedScaling(amax_history_len=8), module)
    assert q.amax.data_ptr() == module.fp8_meta["scaling_fwd"].amax_history[0, 0:1].data_ptr()
    assert module.quantizers["scaling_bwd"][0].dtype == DType.kFloat8E5M2  # HYBRID: gradients in E5M2
    _ran(DelayedScaling(amax_history_len=8, fp8_format=Format.E4M3), module)
    assert module.quantizers["scaling_bwd"][0].dtype == DType.kFloat8E4M3


def test_custom_recipe_quantizers_are_what_its_factory_returned():
    made = []

    def factory(role):
        made.append(Float8CurrentScalingQuantizer(DType.kFloat8E5M2 if "grad" in role else DType.kFloat8E4M3))
        return made[-1]

    module = _ran(CustomRecipe(qfactory=factory), te.Linear(64, 64))
    assert module.quantizers["scaling_fwd"] + module.quantizers["scaling_bwd"] == made


def test_a_recipe_type_change_gives_the_new_recipes_quantizers():
    """NVIDIA TE's test_recipe.py (test_dynamic_recipe_update): DelayedScaling, then MXFP8 warns once, then the quantizers
    are MXFP8Quantizers; later steps do not warn."""
    module = te.Linear(64, 64)
    for _ in range(2):
        _ran(DelayedScaling(), module)
    assert all(isinstance(q, Float8Quantizer) for q in module.quantizers["scaling_fwd"])
    with pytest.warns(UserWarning, match="Recipe type changed"):
        _ran(MXFP8BlockScaling(), module)
    assert all(isinstance(q, MXFP8Quantizer) for q in module.quantizers["scaling_fwd"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ran(MXFP8BlockScaling(), module)


def test_quantizers_are_made_when_asked_for_not_on_the_forward_path():
    """Empty before the first FP8 step; made on first access after the states change, then the same objects."""
    module = te.Linear(64, 64)
    assert module.quantizers == {"scaling_fwd": [], "scaling_bwd": []}
    _ran(DelayedScaling(), module)
    assert module._public_quantizers is None  # not made on the forward path: no work per step
    first = module.quantizers
    assert len(first["scaling_fwd"]) == 3 and module.quantizers is first
