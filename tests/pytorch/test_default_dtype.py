"""A changed default dtype changes nothing inside the modules.

Lightning's ``precision="transformer-engine"`` (and any code under ``torch.set_default_dtype``) runs forward
with bf16 as the default dtype. Every tensor the library makes for itself (scaling state, amax scratch,
dropout uniforms, attention offsets) names its dtype, so a training step gives the same outputs, gradients
and scaling state, bit for bit, whatever the default dtype is.
"""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, NVFP4BlockScaling

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),  # stochastic rounding included: its seeds come from torch's generator
}


class _SelfAttention(torch.nn.Module):
    """te.DotProductAttention on q = k = v = x viewed as [s, b, 4 heads, 16], with dropout."""

    def __init__(self):
        super().__init__()
        self.attention = te.DotProductAttention(4, 16, attention_dropout=0.1, attn_mask_type="causal")

    def forward(self, x):
        heads = x.view(*x.shape[:-1], 4, 16)
        return self.attention(heads, heads, heads)


MODULES = {
    "Linear": lambda: te.Linear(64, 32),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 48),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128),
    "LayerNorm": lambda: te.LayerNorm(64),
    "RMSNorm": lambda: te.RMSNorm(64),
    "DotProductAttention": _SelfAttention,
    "MultiheadAttention": lambda: te.MultiheadAttention(64, 4, attention_dropout=0.1, attn_mask_type="causal"),
    "TransformerLayer": lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.1, attention_dropout=0.1),
}


def _train(module, recipe, default_dtype):
    """Three SGD steps on fixed inputs with ``default_dtype`` as the default dtype around each step:
    (outputs, input gradients, parameters, every float tensor of the scaling state)."""
    torch.manual_seed(7)
    xs = [torch.randn(8, 2, 64, dtype=torch.float32) for _ in range(3)]
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.01) if params else None
    results = []
    for x in xs:
        x = x.clone().requires_grad_(requires_grad=True)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default_dtype)
        try:
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x)
            y.float().square().mean().backward()
        finally:
            torch.set_default_dtype(previous)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        results.append((y.detach(), x.grad))
    return results, [p.detach().clone() for p in module.parameters()], _scaling_tensors(module)


def _scaling_tensors(module):
    """{(submodule, role, name): tensor} of the delayed-scaling state of every TE submodule."""
    found = {}
    for sub_name, sub in module.named_modules():
        for role in ("scaling_fwd", "scaling_bwd"):
            state = getattr(sub, "fp8_meta", {}).get(role)
            for name in ("amax_history", "scale", "scale_inv"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    found[(sub_name, role, name)] = value.detach().clone()
    return found


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module_name", list(MODULES))
def test_bf16_default_dtype_changes_nothing(module_name, recipe_name):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    module = MODULES[module_name]()
    twin = copy.deepcopy(module)
    expected = _train(module, recipe, torch.float32)
    got = _train(twin, recipe, torch.bfloat16)
    for (y_ref, dx_ref), (y, dx) in zip(expected[0], got[0]):
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    for p_ref, p in zip(expected[1], got[1]):
        torch.testing.assert_close(p, p_ref, rtol=0, atol=0)
    assert expected[2].keys() == got[2].keys()
    for key, value in got[2].items():
        assert value.dtype == torch.float32, f"{key} is {value.dtype}"
        torch.testing.assert_close(value, expected[2][key], rtol=0, atol=0)
    if recipe_name == "delayed" and module_name not in ("LayerNorm", "RMSNorm", "DotProductAttention"):
        assert got[2], "delayed scaling kept no state"


def test_public_quantizers_make_float32_scales_under_a_bf16_default():
    """make_empty's unit scales name their dtype (a bf16 default made the per-tensor one bf16, which its own
    constructor then refused)."""
    from transformer_engine.pytorch.tensor import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        fp8 = Float8CurrentScalingQuantizer(DType.kFloat8E4M3).make_empty((32, 64))
        block = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True).make_empty((32, 64))
        mxfp8 = MXFP8Quantizer(DType.kFloat8E4M3).make_empty((32, 64))
    finally:
        torch.set_default_dtype(saved)
    assert fp8._scale_inv.dtype == torch.float32 and block._rowwise_scale_inv.dtype == torch.float32
    assert mxfp8._rowwise_scale_inv.dtype == torch.uint8
