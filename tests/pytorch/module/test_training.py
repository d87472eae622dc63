"""A few training steps of a tiny model: the FP8 loss tracks the BF16 loss."""

import pytest

from tests.pytorch._training import train_losses
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
def test_fp8_loss_tracks_bf16(recipe):
    bf16, fp8 = train_losses(None, hidden=32), train_losses(recipe, hidden=32)
    assert bf16[-1] < 0.5 * bf16[0]  # the model learns
    for step, (a, b) in enumerate(zip(bf16, fp8)):
        assert abs(a - b) <= 0.05 * a + 1e-3, f"step {step}: bf16 {a:.4f} vs fp8 {b:.4f}"
