"""RecipeState: the FP8 dtypes follow the recipe in force."""

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch.quantization.recipe_state import RecipeState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_fp8_dtype_follows_a_new_recipe(cls):
    forward = RecipeState.create(cls(fp8_format=Format.HYBRID), mode="forward", num_gemms=1, device="cpu")
    backward = RecipeState.create(cls(fp8_format=Format.HYBRID), mode="backward", num_gemms=1, device="cpu")
    assert (forward.fp8_dtype, backward.fp8_dtype) == (E4M3, E5M2)
    for state in (forward, backward):
        state.recipe = cls(fp8_format=Format.E4M3)
    assert (forward.fp8_dtype, backward.fp8_dtype) == (E4M3, E4M3)
    if cls is DelayedScaling:  # its quantizers read the dtype from the state
        assert backward.make_quantizers()[0].fp8_dtype == E4M3 and backward.fp8_max == 448.0
