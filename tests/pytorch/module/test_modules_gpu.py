"""On CUDA: the modules run through the flagos and vendor backends and agree with the reference backend."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import forward_backward
from tests.utils import randn, sqnr
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.plugin.core import with_preference, with_strict_mode

pytestmark = pytest.mark.gpu

MODULES = {
    "Linear": lambda: te.Linear(64, 96),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 96, normalization="RMSNorm"),
    "LayerNormMLP-gelu": lambda: te.LayerNormMLP(64, 96),
    "LayerNormMLP-swiglu": lambda: te.LayerNormMLP(64, 96, activation="swiglu"),
    "LayerNorm": lambda: te.LayerNorm(64),
    "RMSNorm": lambda: te.RMSNorm(64, zero_centered_gamma=True),
}
RECIPES = {"bf16": None, "delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


def _run(module, x, dy, recipe, prefer):
    with with_preference(prefer), with_strict_mode(strict=True):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            result = forward_backward(module, x, dy)
    module.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize("prefer", ["flagos", "vendor"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_cuda_backends_agree_with_reference(name, recipe_name, prefer):
    recipe = RECIPES[recipe_name]
    if recipe is not None and name in ("LayerNorm", "RMSNorm"):
        pytest.skip("norms are not quantized")
    torch.manual_seed(0)
    module = MODULES[name]().to(device="cuda", dtype=torch.bfloat16)
    x = randn(4, 8, 64, dtype=torch.bfloat16, device="cuda")
    dy = randn(4, 8, 64 if name in ("LayerNorm", "RMSNorm", "LayerNormMLP-gelu", "LayerNormMLP-swiglu") else 96,
               dtype=torch.bfloat16, device="cuda")
    if recipe is not None and recipe.delayed():  # same calibrated scales for both runs
        _run(module, x, dy, recipe, "reference")
    state = {k: v.clone() for k, v in module.state_dict().items()}
    want = _run(module, x, dy, recipe, "reference")
    module.load_state_dict(state)
    got = _run(module, x, dy, recipe, prefer)
    floor = 35.0 if recipe is None else 25.0
    assert got[0].device.type == "cuda" and got[0].dtype == torch.bfloat16
    assert sqnr(want[0], got[0]) >= floor and sqnr(want[1], got[1]) >= floor
    for pname, grad in got[2].items():
        assert sqnr(want[2][pname], grad) >= floor, pname


def test_fp8_runs_natively_on_this_gpu():
    available, reason = te.is_fp8_available(return_reason=True)
    capability = te.get_device_compute_capability()
    assert available == (capability >= (8, 9)), reason
