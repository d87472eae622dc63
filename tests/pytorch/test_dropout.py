"""Dropout and bias-dropout-add on the catalog's dropout ops: forward, gradients against the formula
with the op's own keep mask, which op runs on which path."""

from __future__ import annotations

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends._dropout_mask import unpack_keep
from transformer_engine.pytorch import _dropout
from transformer_engine.pytorch._dropout import bias_dropout_add, dropout


def test_dropout_forward_backward_share_the_mask():
    x = randn(64, 32).requires_grad_(requires_grad=True)
    y = dropout(x, 0.25, training=True)
    kept = y != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(grad, kept.float() / 0.75)


def test_identity_in_eval_or_p0():
    x = randn(4, 4)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0, training=True) is x
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.5, training=True)


def test_bias_dropout_add():
    x, bias, residual = randn(3, 4), randn(4), randn(3, 4)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0.3, training=False), residual + x + bias)
    torch.testing.assert_close(bias_dropout_add(x, None, residual, 0.3, training=False, drop_path=lambda t: 2 * t), residual + 2 * x)
    torch.manual_seed(0)
    a = bias_dropout_add(x, bias, residual, 0.5, training=True)
    torch.manual_seed(0)
    b = bias_dropout_add(x, bias, residual, 0.5, training=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _mask_of_call(seed, x, bias, residual, p):
    """The keep mask bias_dropout_add_fwd draws after torch.manual_seed(seed) (the fused path's own)."""
    torch.manual_seed(seed)
    mask = ops.bias_dropout_add_fwd(x.detach(), None if bias is None else bias.detach(), residual.detach(), p)[1]
    return unpack_keep(mask, x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_gradients_match_formula(dtype, with_bias):
    p = 0.3
    x = randn(2, 5, 33, dtype=dtype).requires_grad_(requires_grad=True)
    residual = randn(2, 5, 33, dtype=dtype).requires_grad_(requires_grad=True)
    bias = randn(33, dtype=dtype).requires_grad_(requires_grad=True) if with_bias else None
    torch.manual_seed(5)
    out = bias_dropout_add(x, bias, residual, p, training=True)
    keep = _mask_of_call(5, x, bias, residual, p)
    h = x.double() + (0 if bias is None else bias.double())
    tol = dtype_tols(dtype)
    torch.testing.assert_close(out.double(), (residual.double() + h * keep / (1 - p)).to(dtype).double(), **tol)
    dout = randn(2, 5, 33, dtype=dtype)
    out.backward(dout)
    dx = dout.double() * keep / (1 - p)
    torch.testing.assert_close(x.grad.double(), dx.to(dtype).double(), **tol)
    assert torch.equal(residual.grad, dout)
    if with_bias:
        assert bias.grad.dtype == dtype
        dbias = dx.sum((0, 1))  # db = sum over rows of dx, from the unrounded products (float32 sum, rounded once)
        torch.testing.assert_close(bias.grad.double(), dbias.to(dtype).double(), **tol)


def test_bias_dropout_add_grad_only_where_needed():
    x, bias, residual = randn(4, 8).requires_grad_(requires_grad=True), randn(8), randn(4, 8)
    bias_dropout_add(x, bias, residual, 0.5, training=True).sum().backward()
    assert x.grad is not None and bias.grad is None
    x, bias = randn(4, 8), randn(8).requires_grad_(requires_grad=True)
    torch.manual_seed(1)
    bias_dropout_add(x, bias, residual, 0.5, training=True).sum().backward()
    keep = _mask_of_call(1, x, bias, residual, 0.5)
    torch.testing.assert_close(bias.grad, (keep * 2.0).sum(0))


def _count_ops(monkeypatch):
    calls = {"bias_dropout_add_fwd": 0, "dropout_fwd": 0}
    for name in calls:
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(_dropout.ops, name, spy)
    return calls


@pytest.mark.parametrize("case, fused", [("bias_h", 1), ("no_bias", 1), ("full_bias", 1), ("mixed_dtype", 0),
                                         ("eval", 0), ("p0", 0), ("drop_path", 0)])  # fmt: skip
def test_which_path_runs(monkeypatch, case, fused):
    x, residual = randn(3, 4), randn(3, 4)
    bias = {"no_bias": None, "full_bias": randn(3, 4), "mixed_dtype": randn(4, dtype=torch.float64)}.get(case, randn(4))
    p = 0.0 if case == "p0" else 0.5
    calls = _count_ops(monkeypatch)
    out = bias_dropout_add(x, bias, residual, p, case != "eval", drop_path=(lambda t: t) if case == "drop_path" else None)
    assert calls["bias_dropout_add_fwd"] == fused
    assert calls["dropout_fwd"] == int(case in ("mixed_dtype", "drop_path"))
    assert out.dtype == (torch.float64 if case == "mixed_dtype" else torch.float32)  # torch's promotion, as before
    if case in ("eval", "p0"):
        torch.testing.assert_close(out, residual + (x + bias), rtol=0, atol=0)


def test_full_shaped_bias_gets_its_gradient():
    x, bias, residual = randn(3, 4), randn(3, 4).requires_grad_(requires_grad=True), randn(3, 4)
    torch.manual_seed(2)
    bias_dropout_add(x, bias, residual, 0.25, training=True).backward(torch.ones(3, 4))
    keep = _mask_of_call(2, x + bias, None, residual, 0.25)
    torch.testing.assert_close(bias.grad, keep / 0.75)
