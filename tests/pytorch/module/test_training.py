"""A few training steps of a tiny model: the FP8 loss tracks the BF16 loss."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling


def _train(recipe, steps=12):
    torch.manual_seed(7)
    model = torch.nn.Sequential(te.LayerNormMLP(32, 64, activation="swiglu"), te.LayerNormLinear(32, 16))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=data)
    target = torch.tanh(x[:, :16] * 2.0)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_fp8_loss_tracks_bf16(recipe):
    bf16, fp8 = _train(None), _train(recipe)
    assert bf16[-1] < 0.5 * bf16[0]  # the model learns
    for step, (a, b) in enumerate(zip(bf16, fp8)):
        assert abs(a - b) <= 0.05 * a + 1e-3, f"step {step}: bf16 {a:.4f} vs fp8 {b:.4f}"
