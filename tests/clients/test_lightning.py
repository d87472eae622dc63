"""PyTorch Lightning's Transformer Engine precision, as its users run it (default settings).

``Trainer(precision="transformer-engine")`` / ``Fabric(precision="transformer-engine")``: Lightning swaps
``nn.Linear`` and ``nn.LayerNorm`` for ours, casts the weights to bf16, and runs each forward under
``te.fp8_autocast`` with its default ``DelayedScaling`` and bf16 as the default dtype. On the CPU the same
code path runs with FP8 emulated by the reference backend.
"""

import warnings

import lightning as L
import pytest
import torch

import transformer_engine.pytorch as te


class _Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(n=128):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=generator)
    return torch.utils.data.TensorDataset(x, (x @ torch.randn(32, 16, generator=generator)) / 8)


def _delayed_histories(module):
    return [sub.fp8_meta["scaling_fwd"].amax_history for sub in module.modules()
            if isinstance(sub, te.Linear) and sub.fp8_meta.get("scaling_fwd") is not None]


@pytest.fixture(autouse=True)
def _quiet_cpu_autocast():
    with warnings.catch_warnings():  # Lightning's fallback torch.autocast("cuda") says it is off on a CPU
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        yield


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_trainer_default_transformer_engine_precision_trains_in_fp8(accelerator):
    model = _Regressor()
    trainer = L.Trainer(precision="transformer-engine", max_steps=12, accelerator=accelerator, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=16))
    linears = [m for m in model.net if isinstance(m, te.Linear)]
    assert len(linears) == 2 and isinstance(model.net[1], te.LayerNorm)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    histories = _delayed_histories(model)
    assert len(histories) == 2 and all(h.dtype == torch.float32 and h.abs().sum() > 0 for h in histories)
    assert len(model.losses) == 12 and all(torch.isfinite(torch.tensor(model.losses)))
    assert sum(model.losses[-3:]) < sum(model.losses[:3])


def test_fabric_default_transformer_engine_precision():
    fabric = L.Fabric(precision="transformer-engine", accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    epochs = []
    for _ in range(4):
        losses = []
        for x, y in fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(), batch_size=16)):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        epochs.append(sum(losses) / len(losses))
    assert all(isinstance(m, te.Linear) for m in model.module if not isinstance(m, torch.nn.GELU))
    assert all(h.abs().sum() > 0 for h in _delayed_histories(model))
    assert epochs[-1] < epochs[0]
