"""Reference dropout and bias-dropout-add (statistics, formula with the returned mask, seeding) and
cross entropy vs torch.nn.functional.cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends._dropout_mask import pack_keep, packed_bytes, unpack_keep
from transformer_engine.plugin.backends.reference.misc import (
    bias_dropout_add_fwd,
    cross_entropy_bwd,
    cross_entropy_fwd,
    dropout_bwd,
    dropout_bwd_dbias,
    dropout_fwd,
)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.83])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_1_minus_p_and_scales(p, dtype):
    x = randn(61, 127, dtype=dtype)
    y, mask = dropout_fwd(x, p)
    assert mask.dtype == torch.uint8 and mask.shape == (packed_bytes(x.numel()),) and y.dtype == dtype
    keep = unpack_keep(mask, x.shape)
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    torch.testing.assert_close(y.double(), x.double() * keep / (1 - p), **dtype_tols(dtype))
    dy = randn(61, 127, dtype=dtype)
    torch.testing.assert_close(dropout_bwd(dy, mask, p).double(), dy.double() * keep / (1 - p), **dtype_tols(dtype))


@pytest.mark.parametrize("numel", [1, 8, 13, 64, 1001])
def test_packed_mask_round_trip(numel):
    keep = torch.rand(numel) < 0.5
    mask = pack_keep(keep)
    assert mask.dtype == torch.uint8 and mask.shape == (packed_bytes(numel),)
    assert torch.equal(unpack_keep(mask, (numel,)), keep)
    assert int(mask[0]) == sum(int(keep[j]) << j for j in range(min(8, numel)))  # bit j = element j, LSB first


@pytest.mark.parametrize("shape", [(5,), (7, 13), (2, 3, 8)])
def test_dropout_bwd_dbias_sums_the_unrounded_products(shape):
    dy = randn(*shape, dtype=torch.bfloat16)
    keep = torch.rand(shape) >= 0.3
    dx, dbias = dropout_bwd_dbias(dy, pack_keep(keep), 0.3)
    assert torch.equal(dx, dropout_bwd(dy, pack_keep(keep), 0.3))
    products = dy.float() * keep * (1 / 0.7)  # the op multiplies by the scale
    assert dbias.dtype == torch.float32 and torch.equal(dbias, products.reshape(-1, shape[-1]).sum(0))
    with pytest.raises(ValueError, match="last dim"):
        dropout_bwd_dbias(dy.reshape(-1)[0], pack_keep(keep.reshape(-1)[:1]), 0.3)


def test_dropout_edge_probabilities_and_generator():
    x = randn(7, 13)
    y, mask = dropout_fwd(x, 0.0)
    assert unpack_keep(mask, x.shape).all() and torch.equal(y, x)
    assert mask[-1] == 0b111  # 91 elements: the last byte holds 3 of them, the bits past numel are 0
    y, mask = dropout_fwd(x, 1.0)
    assert not mask.any() and torch.all(y == 0)
    torch.manual_seed(7)
    first = dropout_fwd(x, 0.5)[1]
    torch.manual_seed(7)
    assert torch.equal(first, ops.dropout_fwd(x, 0.5)[1])  # same default generator through ops
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout_fwd(x, 1.5)
    with pytest.raises(ValueError, match="12 bytes"):
        dropout_bwd(x, mask[:3], 0.5)


@pytest.mark.parametrize("rows, hidden", [(1, 1), (5, 7), (61, 127)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_matches_float64_formula(rows, hidden, dtype, with_bias):
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
    bias = randn(hidden, dtype=dtype) if with_bias else None
    out, mask = bias_dropout_add_fwd(x, bias, residual, 0.3)
    assert mask.dtype == torch.uint8 and out.dtype == dtype
    keep = unpack_keep(mask, x.shape)
    h = x.double() + (0 if bias is None else bias.double())
    torch.testing.assert_close(out.double(), (residual.double() + h * keep / 0.7).to(dtype).double(), **dtype_tols(dtype))


def test_bias_dropout_add_statistics_seeding_and_errors():
    x, bias, residual = randn(50, 100), randn(100), randn(50, 100)
    keep = unpack_keep(bias_dropout_add_fwd(x, bias, residual, 0.83)[1], x.shape)
    assert abs(keep.double().mean().item() - 0.17) < 6 * math.sqrt(0.83 * 0.17 / keep.numel())  # 6 sigma
    torch.manual_seed(3)
    first = ops.bias_dropout_add_fwd(x, bias, residual, 0.5)[1]
    assert not torch.equal(first, ops.bias_dropout_add_fwd(x, bias, residual, 0.5)[1])
    torch.manual_seed(3)
    assert torch.equal(bias_dropout_add_fwd(x, bias, residual, 0.5)[1], first)
    out, mask = bias_dropout_add_fwd(x, bias, residual, 1.0)
    assert not mask.any() and torch.equal(out, residual)
    out, mask = bias_dropout_add_fwd(x, None, residual, 0.0)
    assert unpack_keep(mask, x.shape).all() and torch.equal(out, residual + x)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        bias_dropout_add_fwd(x, bias, residual, -0.5)
    with pytest.raises(ValueError, match=r"bias must be \[100\]"):
        bias_dropout_add_fwd(x, randn(50, 100), residual, 0.5)
    with pytest.raises(ValueError, match="residual"):
        bias_dropout_add_fwd(x, bias, residual[:, :5], 0.5)
    with pytest.raises(TypeError, match="uint8"):
        dropout_bwd(x, unpack_keep(mask, x.shape), 0.5)  # the unpacked bool mask


def _reference_ce(logits, target, grad_loss, eps, ignore_index):
    """float64 loss and dlogits through F.cross_entropy (reduction='none') and autograd."""
    z = logits.double().requires_grad_()
    loss = F.cross_entropy(z, target, reduction="none", label_smoothing=eps, ignore_index=ignore_index)
    (loss * grad_loss.double()).sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("n,vocab", [(1, 2), (13, 37), (29, 1031)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch(n, vocab, eps, ignore_index, dtype):
    logits = randn(n, vocab, dtype=dtype, scale=3.0)
    target = torch.randint(0, vocab, (n,))
    target[::4] = ignore_index
    grad_loss = randn(n)
    loss, lse = cross_entropy_fwd(logits, target, eps, ignore_index)
    ref_loss, ref_grad = _reference_ce(logits, target, grad_loss, eps, ignore_index)
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, **dtype_tols(torch.float32))
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), **dtype_tols(torch.float32))
    dlogits = cross_entropy_bwd(grad_loss, logits, target, lse, eps, ignore_index)
    assert dlogits.dtype == dtype and dlogits.shape == logits.shape
    torch.testing.assert_close(dlogits.double(), ref_grad, **dtype_tols(dtype))
    ignored = target == ignore_index
    assert torch.all(loss[ignored] == 0) and torch.all(dlogits[ignored] == 0)


def test_cross_entropy_through_ops_and_errors():
    logits, target = randn(5, 11), torch.tensor([0, 10, -100, 3, 7])
    (loss, lse), impl = ops.cross_entropy_fwd.traced(logits, target, 0.05)
    assert impl.impl_id == "reference.torch"
    torch.testing.assert_close(loss, cross_entropy_fwd(logits, target, 0.05)[0], rtol=0, atol=0)
    grad = ops.cross_entropy_bwd(torch.ones(5), logits, target, lse, 0.05)
    torch.testing.assert_close(grad, cross_entropy_bwd(torch.ones(5), logits, target, lse, 0.05), rtol=0, atol=0)
    # an out-of-range target is not an error (raising would need a host sync): its row is NaN
    bad = torch.tensor([0, 11, 1, -5, 3])
    loss, lse = cross_entropy_fwd(logits, bad)
    assert torch.isnan(loss).tolist() == [False, True, False, True, False] and bool(torch.isfinite(lse).all())
    grad = cross_entropy_bwd(torch.ones(5), logits, bad, lse)
    assert torch.isnan(grad).all(1).tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError, match="at least one class"):
        cross_entropy_fwd(logits[:, :0], target)
    with pytest.raises(ValueError, match="2-D"):
        cross_entropy_fwd(logits[None], target)
    with pytest.raises(TypeError, match="integer"):
        cross_entropy_fwd(logits, target.float())
