"""A short training run of a tiny TE model, shared by the tests that compare a recipe's loss curve with BF16's."""

import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te


def train_losses(recipe, steps: int = 12, hidden: int = 64):
    """Losses of ``steps`` Adam steps of LayerNormMLP(hidden, 2 hidden, swiglu) + LayerNormLinear(hidden, hidden / 2)
    fitting tanh(2x) under torch's bf16 autocast and ``recipe`` (None: high precision), from fixed weights and data."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(te.LayerNormMLP(hidden, 2 * hidden, activation="swiglu"), te.LayerNormLinear(hidden, hidden // 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(3)
    x = torch.randn(64, hidden, generator=data)
    target = torch.tanh(x[:, : hidden // 2] * 2.0)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
