"""CustomRecipe: the modules cast each tensor role with the quantizer the user's factory returns."""

import pytest
import torch

import transformer_engine.pytorch as te
import transformer_engine.pytorch.ops as te_ops
from transformer_engine.common.recipe import CustomRecipe, Float8BlockScaling, Float8CurrentScaling

E4M3, E5M2 = te.DType.kFloat8E4M3, te.DType.kFloat8E5M2
FWD_ROLES, BWD_ROLES = ("linear_input", "linear_weight", "linear_output"), ("linear_grad_output", "linear_grad_input")


def _current_scaling_factory(asked=None):
    def factory(role):
        if asked is not None:
            asked.append(role)
        return te.Float8CurrentScalingQuantizer(E5M2 if role in BWD_ROLES else E4M3, device="cpu")

    return factory


MODULES = {
    "Linear": lambda: te.Linear(64, 64),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 64),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128),
    "ops.Linear": lambda: te_ops.Linear(64, 64, device="cpu"),
}


def _step(module, recipe, x, **kwargs):
    x = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    (y.float() * torch.logspace(-3, 3, y.shape[-1])).sum().backward()  # a wide dynamic range in dy
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("name", list(MODULES))
def test_current_scaling_factory_equals_float8_current_scaling(name):
    torch.manual_seed(0)
    reference, custom = MODULES[name](), MODULES[name]()
    custom.load_state_dict(reference.state_dict())
    x = torch.randn(32, 64)
    asked = []
    expected = _step(reference, Float8CurrentScaling(), x)
    got = _step(custom, CustomRecipe(qfactory=_current_scaling_factory(asked)), x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert set(asked) == set(FWD_ROLES + BWD_ROLES)


def test_grouped_linear_under_a_custom_recipe():
    torch.manual_seed(1)
    reference, custom = te.GroupedLinear(3, 64, 32), te.GroupedLinear(3, 64, 32)
    custom.load_state_dict(reference.state_dict())
    x = torch.randn(48, 64)
    expected = _step(reference, Float8CurrentScaling(), x, m_splits=[16, 8, 24])
    got = _step(custom, CustomRecipe(qfactory=_current_scaling_factory()), x, m_splits=[16, 8, 24])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_fixed_scale_quantizers_cast_with_their_scale_and_record_amax():
    """Float8Quantizer from the factory: the module casts with its scale and maxes its amax into the user's tensor."""
    torch.manual_seed(2)
    slots = {role: (torch.full((1,), 4.0), torch.zeros(1)) for role in FWD_ROLES + BWD_ROLES}
    recipe = CustomRecipe(qfactory=lambda role: te.Float8Quantizer(*slots[role], E5M2 if role in BWD_ROLES else E4M3))
    layer = te.Linear(32, 16, bias=False)
    x = torch.randn(8, 32)
    with te.autocast(recipe=recipe):
        y = layer(x)
    assert slots["linear_input"][1].item() == x.abs().max().item()
    assert slots["linear_weight"][1].item() == layer.weight.abs().max().item()
    q = lambda t: (t * 4.0).to(torch.float8_e4m3fn).float() / 4.0  # noqa: E731 - the cast with scale 4
    torch.testing.assert_close(y, q(x) @ q(layer.weight.detach()).t(), rtol=1e-6, atol=1e-6)


def test_a_factory_returning_something_else_is_named():
    recipe = CustomRecipe(qfactory=lambda role: "not a quantizer")
    with pytest.raises(TypeError, match=r"qfactory\('linear_input'\) returned str"):
        with te.autocast(recipe=recipe):
            te.Linear(16, 16)(torch.randn(8, 16))


def _block_scaling_factory(role):
    """Float8BlockScaling's quantizers as a factory: 1 x 128 tiles for inputs and gradients, 128 x 128 for weights."""
    dim = 2 if role == "linear_weight" else 1
    return te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_block_quantizer_factory_equals_float8_block_scaling(name):
    torch.manual_seed(3)
    reference, custom = MODULES[name](), MODULES[name]()
    custom.load_state_dict(reference.state_dict())
    x = torch.randn(256, 64)
    expected = _step(reference, Float8BlockScaling(), x)
    got = _step(custom, CustomRecipe(qfactory=_block_scaling_factory), x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_block_quantizer_factory_stores_block_scaled_weights():
    with te.quantized_model_init(recipe=CustomRecipe(qfactory=_block_scaling_factory)):
        layer = te.Linear(128, 256)
    assert isinstance(layer.weight, te.Float8BlockwiseQTensor) and layer.weight._is_2D_scaled
    assert layer.weight.get_usages() == {"rowwise": True, "columnwise": False}  # W^T: the transpose of the tiles
