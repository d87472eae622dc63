"""save_original_input: backward keeps the input as given and casts x^T again, giving what the saved FP8 x^T gives."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {"current": Float8CurrentScaling(), "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling()}
MODULES = {
    "Linear": (lambda **kw: te.Linear(64, 96, **kw), lambda m, x: m(x)),
    "GroupedLinear": (lambda **kw: te.GroupedLinear(3, 64, 96, **kw), lambda m, x: m(x, [32, 0, 64])),
}


def _step(module, name, x, dy, recipe):
    """Outputs, gradients and the tensors autograd saved (by ``saved_tensors_hooks``) of one fwd + bwd."""
    saved = []
    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with te.autocast(recipe=recipe):
            y = MODULES[name][1](module, x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()], saved, x


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_saved_input_gives_the_saved_transposes_results(name, recipe_name):
    """Outputs and every gradient equal the default module's bit for bit; autograd keeps the input itself (its
    memory) instead of an FP8 transpose."""
    torch.manual_seed(0)
    default = MODULES[name][0]()
    keeping = MODULES[name][0](save_original_input=True)
    keeping.load_state_dict(default.state_dict())
    x, dy = randn(96, 64), randn(96, 96)
    y_d, dx_d, grads_d, saved_d, _ = _step(default, name, x, dy, RECIPES[recipe_name])
    y_k, dx_k, grads_k, saved_k, x_k = _step(keeping, name, x, dy, RECIPES[recipe_name])
    assert torch.equal(y_k, y_d) and torch.equal(dx_k, dx_d)
    assert all(torch.equal(a, b) for a, b in zip(grads_k, grads_d))
    assert any(t.untyped_storage().data_ptr() == x_k.untyped_storage().data_ptr() for t in saved_k)
    assert not any(t.untyped_storage().data_ptr() == x_k.untyped_storage().data_ptr() for t in saved_d)


@pytest.mark.parametrize("name", list(MODULES))
def test_delayed_scaling_is_refused(name):
    module = MODULES[name][0](save_original_input=True)
    with pytest.raises(ValueError, match="save_original_input=True.* DelayedScaling"):
        with te.autocast(recipe=DelayedScaling()):
            MODULES[name][1](module, randn(96, 64))


@pytest.mark.parametrize("name", list(MODULES))
def test_traces_whole_and_compiled_equals_eager(name):
    """fullgraph (aot_eager): the backward's cast of x^T traces into the backward graph; one step equals eager's."""
    torch.manual_seed(0)
    eager = MODULES[name][0](save_original_input=True)
    compiled = MODULES[name][0](save_original_input=True)
    compiled.load_state_dict(eager.state_dict())
    recipe = RECIPES["current"]

    def step(x):
        with te.autocast(recipe=recipe):
            return MODULES[name][1](compiled, x)

    x, dy = randn(96, 64), randn(96, 96)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    y_e, dx_e, grads_e, _, _ = _step(eager, name, x, dy, recipe)
    x_c = x.clone().requires_grad_()
    y_c = torch.compile(step, fullgraph=True, backend="aot_eager")(x_c)
    y_c.backward(dy)
    assert torch.equal(y_c, y_e) and torch.equal(x_c.grad, dx_e)
    assert all(torch.equal(p.grad, g) for p, g in zip(compiled.parameters(), grads_e))
