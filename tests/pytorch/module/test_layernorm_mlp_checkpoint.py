"""LayerNormMLP(checkpoint=True): backward recomputes the norm, fc1 and the activation, with forward's scales."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
)

RECIPES = {
    "bf16": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling(),
}
TOKENS, HIDDEN, FFN = 256, 64, 128  # (tokens x ffn above every weight's size)


def _step(module, x, dy, recipe, seed=0):
    """Output, input gradient and the tensors autograd saved, of one fwd + bwd (the generator seeded first: NVFP4's
    stochastic rounding draws its seeds from it)."""
    saved = []
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
    (y[0] if isinstance(y, tuple) else y).backward(dy)
    return y, x.grad, saved


@pytest.mark.parametrize("config", [dict(), dict(activation="swiglu", normalization="RMSNorm"), dict(return_layernorm_output=True)],
                         ids=["gelu_layernorm", "swiglu_rmsnorm", "ln_out"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_recomputation_gives_the_saved_activations_results(recipe_name, config):
    """Three steps: outputs, every gradient and the scaling state equal the default module's bit for bit (the recomputed
    casts use forward's scales: a delayed-scaling update happens between forward and backward), and autograd keeps no
    tensor of [tokens, ffn] elements or more (the default keeps h and the activation's FP8 copy)."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    default = te.LayerNormMLP(HIDDEN, FFN, **config)
    checkpointed = te.LayerNormMLP(HIDDEN, FFN, checkpoint=True, **config)
    checkpointed.load_state_dict(default.state_dict())
    for _ in range(3):
        x, dy = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
        y_d, dx_d, saved_d = _step(default, x, dy, recipe)
        y_c, dx_c, saved_c = _step(checkpointed, x, dy, recipe)
        if config.get("return_layernorm_output"):
            y_d, y_c = y_d[0], y_c[0]
        assert torch.equal(y_c, y_d) and torch.equal(dx_c, dx_d)
        for (name, p_d), p_c in zip(default.named_parameters(), checkpointed.parameters()):
            assert torch.equal(p_c.grad, p_d.grad), name
            p_d.grad = p_c.grad = None
        assert max(t.numel() for t in saved_d) >= TOKENS * FFN
        assert max(t.numel() for t in saved_c) < TOKENS * FFN
    for role in ("scaling_fwd", "scaling_bwd"):
        state_d, state_c = default.fp8_meta[role], checkpointed.fp8_meta[role]
        if getattr(state_d, "has_amax_history", False):
            assert torch.equal(state_c.amax_history, state_d.amax_history) and torch.equal(state_c.scale, state_d.scale), role


def test_calibration_records_the_amaxes_of_the_default():
    """Calibration (FP8 off, amaxes recorded): the amax histories equal the default module's after several steps
    (the recomputation in high precision records nothing of its own)."""
    recipe = RECIPES["delayed"]
    torch.manual_seed(0)
    default = te.LayerNormMLP(HIDDEN, FFN)
    checkpointed = te.LayerNormMLP(HIDDEN, FFN, checkpoint=True)
    checkpointed.load_state_dict(default.state_dict())
    for _ in range(3):
        x, dy = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
        for module in (default, checkpointed):
            x_m = x.clone().requires_grad_()
            with te.autocast(enabled=False, calibrating=True, recipe=recipe):
                y = module(x_m)
            y.backward(dy)
    history = default.fp8_meta["scaling_fwd"].amax_history
    assert history.abs().sum() > 0 and torch.equal(checkpointed.fp8_meta["scaling_fwd"].amax_history, history)


def test_tensor_parallelism_is_refused():
    with pytest.raises(NotImplementedError, match="checkpoint=True.* tensor or sequence parallelism"):
        te.LayerNormMLP(HIDDEN, FFN, checkpoint=True, tp_size=2, set_parallel_mode=True)


def test_compiled_checkpointed_training_equals_eager():
    """fullgraph (aot_eager): the recomputation traces into the backward graph; three steps bit for bit."""
    import copy

    recipe = RECIPES["delayed"]
    torch.manual_seed(0)
    eager = te.LayerNormMLP(HIDDEN, FFN, checkpoint=True)
    _step(eager, randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN), recipe)  # the scaling state exists before tracing
    compiled = copy.deepcopy(eager)

    def step(x):
        with te.autocast(recipe=recipe):
            return compiled(x)

    torch._dynamo.reset()
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x, dy = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
        y_e, dx_e, _ = _step(eager, x, dy, recipe)
        x_c = x.clone().requires_grad_()
        y_c = compiled_step(x_c)
        y_c.backward(dy)
        assert torch.equal(y_c, y_e) and torch.equal(x_c.grad, dx_e)
