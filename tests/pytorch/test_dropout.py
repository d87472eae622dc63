"""Dropout and bias-dropout-add on the catalog's dropout ops."""

from __future__ import annotations

import pytest
import torch

from tests.utils import randn
from transformer_engine.pytorch._dropout import bias_dropout_add, dropout


def test_dropout_forward_backward_share_the_mask():
    x = randn(64, 32).requires_grad_(True)
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
    torch.testing.assert_close(bias_dropout_add(x, None, residual, 0.3, False, drop_path=lambda t: 2 * t), residual + 2 * x)
    torch.manual_seed(0)
    a = bias_dropout_add(x, bias, residual, 0.5, training=True)
    torch.manual_seed(0)
    b = bias_dropout_add(x, bias, residual, 0.5, training=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
