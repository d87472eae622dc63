"""Checks shared by the tests of the emulated block-scaled recipes (MXFP8, NVFP4): GroupedLinear against a format's
composed emulation, the full layer against high precision, and a compiled ``te.Linear`` step
against the eager one."""

import copy

import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import forward_backward
from tests.utils import randn, sqnr


def assert_grouped_linear_matches(recipe, linear_reference, tols) -> None:
    """te.GroupedLinear(3, 64, 32) with splits [32, 64, 0] under ``recipe``: each split's y, dx, dW, db equal
    ``linear_reference(rows, w, b, dy) -> (y, dx, dW, db)`` (float64) within ``tols``; the empty split is skipped."""
    layer = te.GroupedLinear(3, 64, 32)
    splits = [32, 64, 0]
    x, dy = randn(96, 64), randn(96, 32, scale=1e-2)
    x_in = x.clone().requires_grad_(requires_grad=True)
    with te.autocast(recipe=recipe):
        out = layer(x_in, splits)
    out.backward(dy)
    for i, (rows, dy_i) in enumerate(zip(x.split(splits), dy.split(splits))):
        if rows.shape[0] == 0:
            continue
        w, b = getattr(layer, f"weight{i}"), getattr(layer, f"bias{i}")
        y, dx_ref, dw_ref, db_ref = linear_reference(rows, w, b.detach(), dy_i)
        torch.testing.assert_close(out.split(splits)[i].double(), y, **tols)
        torch.testing.assert_close(x_in.grad.split(splits)[i].double(), dx_ref, **tols)
        torch.testing.assert_close(w.grad.double(), dw_ref, **tols)
        torch.testing.assert_close(b.grad.double(), db_ref, **tols)


def transformer_layer_sqnr(recipe):
    """(SQNR of the output, of dx) of a te.TransformerLayer step under ``recipe`` against the same step in high
    precision, after checking every output and gradient is finite."""
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = randn(32, 2, 64)
    hp_out, hp_dx, _ = forward_backward(layer, x, torch.ones(32, 2, 64))
    layer.zero_grad()
    with te.autocast(recipe=recipe):
        out, dx, grads = forward_backward(layer, x, torch.ones(32, 2, 64))
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    return sqnr(hp_out, out), sqnr(hp_dx, dx)


def _step(module, recipe):
    def step(x):
        with te.autocast(recipe=recipe):
            return module(x)

    return step


def assert_linear_compiles_as_eager(recipe, steps: int = 2) -> None:
    """``te.Linear`` under ``recipe`` traces as one graph without breaks, and compiled steps (aot_eager) equal the
    eager ones bit for bit: outputs, dx, dW (both runs of a step start from the same torch seed)."""
    torch._dynamo.reset()
    eager = te.Linear(64, 32)
    compiled_module = copy.deepcopy(eager)
    x = randn(32, 2, 64).requires_grad_(requires_grad=True)
    explained = torch._dynamo.explain(_step(eager, recipe))(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    step = torch.compile(_step(compiled_module, recipe), fullgraph=True, backend="aot_eager")
    for seed in range(steps):
        x = randn(32, 2, 64)
        outs = []
        for run, module in ((_step(eager, recipe), eager), (step, compiled_module)):
            x_in = x.clone().requires_grad_(requires_grad=True)
            torch.manual_seed(seed)  # the same random draws (stochastic rounding) in both runs
            y = run(x_in)
            y.square().mean().backward()
            outs.append((y.detach(), x_in.grad, module.weight.grad.clone()))
            module.zero_grad()
        for e, c in zip(*outs):
            assert torch.equal(c, e)
