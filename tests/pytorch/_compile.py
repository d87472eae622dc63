"""What the torch.compile tests (``test_compile*.py``) share: the recipes and modules they compile, a step under the
FP8 autocast, SGD training that returns outputs and input gradients, the delayed-scaling state of a model, and the
check that Inductor tracks eager."""

import copy

import torch

import transformer_engine.pytorch as te
from tests.utils import sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format


RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
}
MODULES = {
    "Linear": lambda: te.Linear(64, 32),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 48),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128),
    "LayerNormMLP_swiglu_rms": lambda: te.LayerNormMLP(64, 128, activation="swiglu", normalization="RMSNorm"),
    "LayerNorm": lambda: te.LayerNorm(64),
    "RMSNorm": lambda: te.RMSNorm(64),
    # two modules under one autocast: their backward states are updated together at the end of backward
    "two_Linears": lambda: torch.nn.Sequential(te.Linear(64, 64), te.Linear(64, 64)),
}


class _SelfAttention(torch.nn.Module):
    """te.DotProductAttention on q = k = v = x viewed as [s, b, 4 heads, 16]."""

    def __init__(self, **kwargs):
        super().__init__()
        self.attention = te.DotProductAttention(4, 16, **kwargs)

    def forward(self, x):
        heads = x.view(*x.shape[:-1], 4, 16)
        return self.attention(heads, heads, heads)


#: attention modules: under torch.compile their attention is PyTorch's SDPA (the same math, not the same
#: rounding as the reference backend's), so compiled and eager agree to float32 precision, not bit for bit
ATTENTION_MODULES = {
    "DotProductAttention": lambda: _SelfAttention(attention_dropout=0.0),
    "DotProductAttention_causal": lambda: _SelfAttention(attention_dropout=0.0, attn_mask_type="causal"),
    "MultiheadAttention": lambda: te.MultiheadAttention(64, 4, attention_dropout=0.0, attn_mask_type="causal"),
    "TransformerLayer": lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0),
    "TransformerLayer_gqa_rms_swiglu": lambda: te.TransformerLayer(
        64, 128, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", hidden_dropout=0.0,
        attention_dropout=0.0),
}


def _step_fn(module, recipe):
    def step(x):
        if recipe is None:
            return module(x)
        with te.autocast(recipe=recipe):
            return module(x)

    return step


def _train(step, module, xs, loss=lambda y: y.float().square().mean(), lr=0.01):
    """Forward + backward + SGD on each input; returns the outputs and input gradients."""
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=lr) if params else None
    outs = []
    for x in xs:
        x = x.clone().requires_grad_(requires_grad=True)
        y = step(x)
        loss(y).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        outs.append((y.detach().clone(), x.grad.clone()))  # clones: a CUDA-graph replay reuses its outputs
    return outs


def _scaling_state(module):
    """{(submodule name, role): (amax_history, scale, scale_inv)} of every delayed-scaling state in ``module``."""
    state = {}
    for name, sub in module.named_modules():
        for role in ("scaling_fwd", "scaling_bwd"):
            meta = getattr(sub, "fp8_meta", {}).get(role)
            if meta is not None and getattr(meta, "has_amax_history", False):
                state[(name, role)] = (meta.amax_history.clone(), meta.scale.clone(), meta.scale_inv.clone())
    return state


def _assert_inductor_tracks_eager(eager, recipe, xs, **train_kwargs):
    """One eager step of ``eager`` on xs[0], then copies trained on xs[1:] eagerly, compiled by Inductor
    (fullgraph, told to keep eager's roundings to bf16) and in high precision: the compiled outputs and
    input gradients must sit closer to eager's than FP8's own rounding noise (eager against high
    precision; at most 40 dB asked, which is also the bar without FP8). Different kernels round an FP8
    element here and there the other way; a wrong scale or operand lands far below that bar."""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    _train(_step_fn(eager, recipe), eager, xs[:1], **train_kwargs)
    compiled, high_precision = copy.deepcopy(eager), copy.deepcopy(eager)
    with inductor_config.patch(emulate_precision_casts=True):
        step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="inductor")
        runs = zip(_train(_step_fn(eager, recipe), eager, xs[1:], **train_kwargs), _train(step, compiled, xs[1:], **train_kwargs),
                   _train(_step_fn(high_precision, None), high_precision, xs[1:], **train_kwargs))
        for (y_e, dx_e), (y_c, dx_c), (y_h, dx_h) in runs:
            assert sqnr(y_e, y_c) > min(sqnr(y_h, y_e), 40.0)
            assert sqnr(dx_e, dx_c) > min(sqnr(dx_h, dx_e), 40.0)
    return eager, compiled
