"""delay_wgrad_compute: backward leaves the weight gradients to backward_dw(), which gives what backward would have."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

RECIPES = {"bf16": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), "current": Float8CurrentScaling()}
#: name -> (constructor, call, GEMM weight names, norm parameter names)
MODULES = {
    "Linear": (lambda **kw: te.Linear(64, 32, **kw), lambda m, x: m(x), ("weight",), ()),
    "Linear_split": (lambda **kw: te.Linear(64, 48, parameters_split=("q", "k", "v"), **kw), lambda m, x: m(x),
                     ("q_weight", "k_weight", "v_weight"), ()),
    "LayerNormLinear": (lambda **kw: te.LayerNormLinear(64, 32, **kw), lambda m, x: m(x), ("weight",),
                        ("layer_norm_weight", "layer_norm_bias")),
    "LayerNormMLP": (lambda **kw: te.LayerNormMLP(64, 128, **kw), lambda m, x: m(x), ("fc1_weight", "fc2_weight"),
                     ("layer_norm_weight", "layer_norm_bias")),
    "GroupedLinear": (lambda **kw: te.GroupedLinear(3, 64, 32, **kw), lambda m, x: m(x, [16, 0, 16]),
                      ("weight0", "weight1", "weight2"), ()),
}


def _pair(name, fuse):
    """A module that delays its wgrads and one that does not, with the same parameters (main_grad zeroed when fused)."""
    build = MODULES[name][0]
    torch.manual_seed(0)
    eager = build(fuse_wgrad_accumulation=fuse)
    delayed = build(fuse_wgrad_accumulation=fuse, delay_wgrad_compute=True)
    delayed.load_state_dict(eager.state_dict())
    if fuse:
        for module in (eager, delayed):
            for weight in MODULES[name][2]:
                getattr(module, weight).main_grad = torch.zeros_like(getattr(module, weight), dtype=torch.float32)
    return eager, delayed


def _backward(module, name, x, dy, recipe):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = MODULES[name][1](module, x)
    y.backward(dy)
    return y, x.grad


def _weight_grads(module, name, fuse):
    return [getattr(getattr(module, w), "main_grad" if fuse else "grad") for w in MODULES[name][2]]


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_backward_dw_gives_the_weight_gradients_backward_would(name, recipe_name, fuse):
    """Two micro-batches: backward gives eager's outputs, input and bias gradients and no weight gradient; each
    backward_dw() then adds one micro-batch's dW (first in, first out), bit for bit eager's sums, and calls the
    registered hooks; the scaling state matches eager's; a backward_dw with nothing queued raises."""
    recipe = RECIPES[recipe_name]
    eager, delayed = _pair(name, fuse)
    calls = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    out_features = MODULES[name][1](eager, randn(32, 64)).shape[-1]
    batches = [(randn(32, 64), randn(32, out_features)) for _ in range(2)]
    for x, dy in batches:
        y_e, dx_e = _backward(eager, name, x, dy, recipe)
        y_d, dx_d = _backward(delayed, name, x, dy, recipe)
        assert torch.equal(y_d, y_e) and torch.equal(dx_d, dx_e)
    for (key, p_e), p_d in zip(eager.named_parameters(), delayed.parameters()):
        if key not in MODULES[name][2]:
            assert torch.equal(p_d.grad, p_e.grad), key  # norm and bias gradients come with backward
    expected = [g.clone() for g in _weight_grads(eager, name, fuse)]
    untouched = [torch.zeros_like(g) for g in expected] if fuse else [None] * len(expected)
    for got, before in zip(_weight_grads(delayed, name, fuse), untouched):
        assert got is None if before is None else torch.equal(got, before)
    delayed.backward_dw()
    delayed.backward_dw()
    assert len(calls) == 2
    for got, want in zip(_weight_grads(delayed, name, fuse), expected):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="no delayed weight gradient is queued"):
        delayed.backward_dw()
    for role in ("scaling_fwd", "scaling_bwd"):
        state_e, state_d = eager.fp8_meta[role], delayed.fp8_meta[role]
        if getattr(state_e, "has_amax_history", False):
            assert torch.equal(state_d.amax_history, state_e.amax_history) and torch.equal(state_d.scale, state_e.scale)


@pytest.mark.parametrize("name", list(MODULES))
def test_gemm_parameters_skip_the_backward_post_hook(name):
    """As NVIDIA TE marks them for Megatron-Core's DDP: the GEMM weights and biases, not the norm parameters."""
    _, delayed = _pair(name, fuse=False)
    gemm_names = {key for key, _ in delayed.named_parameters() if key not in MODULES[name][3]}
    for key, param in delayed.named_parameters():
        assert getattr(param, "skip_backward_post_hook", False) == (key in gemm_names), key
    assert not any(hasattr(p, "skip_backward_post_hook") for p in MODULES[name][0]().parameters())


def test_backward_dw_without_delay_does_nothing_and_delay_does_not_compile():
    module = te.Linear(64, 32)
    module(randn(16, 64)).sum().backward()
    grad = module.weight.grad.clone()
    module.backward_dw()
    assert torch.equal(module.weight.grad, grad)
    delayed = te.Linear(64, 32, delay_wgrad_compute=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="delay_wgrad_compute=True.* does not run under torch.compile"):
        torch.compile(delayed, fullgraph=True, backend="aot_eager")(randn(16, 64).requires_grad_())
