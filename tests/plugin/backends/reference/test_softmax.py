"""Reference fused softmax family vs float64 formulas; backward vs autograd of the float64 forward."""

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference import softmax as ref
from transformer_engine.plugin.core import with_preference, with_strict_mode

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE = 0.37
SHAPES_4D = [(1, 1, 1, 1), (2, 3, 5, 7), (1, 2, 13, 29), (2, 1, 7, 3)]  # [b, h, sq, sk], sq > sk included


def _prefix_softmax64(x, scale, valid_len):
    """Row i of the last two dims: softmax over the first valid_len(i) keys, zeros elsewhere (row loop)."""
    x64 = x.double() * scale
    y = torch.zeros_like(x64)
    for i in range(x.shape[-2]):
        n = max(0, min(valid_len(i), x.shape[-1]))
        if n:
            y[..., i, :n] = torch.softmax(x64[..., i, :n], dim=-1)
    return y


def _masked64(x, mask, scale):
    """softmax(scale x - 10000 mask) in float64, fully masked rows set to zero (catalog)."""
    y = torch.softmax(x.double() * scale - 10000.0 * mask.double(), dim=-1)
    return y.masked_fill(mask.all(dim=-1, keepdim=True).expand_as(y), 0.0)


def _check(got, want64, dtype):
    assert got.dtype == dtype and got.shape == want64.shape
    torch.testing.assert_close(got.double(), want64, **dtype_tols(dtype))


def _random_mask(x):
    b, _, sq, sk = x.shape
    mask = torch.rand(b, 1, sq, sk) < 0.4
    mask[0, 0, 0, :] = True  # one fully masked row
    return mask


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES_4D + [(9,), (3, 31)])
def test_scaled_softmax_forward(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    _check(ref.scaled_softmax_forward(x, SCALE), torch.softmax(x.double() * SCALE, dim=-1), dtype)


@pytest.mark.parametrize("mask_batch", ["full", "broadcast"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES_4D)
def test_scaled_masked_softmax_forward(shape, dtype, mask_batch):
    x = randn(*shape, dtype=dtype, scale=3.0)
    mask = _random_mask(x)
    if mask_batch == "broadcast":
        mask = mask[:1]
    y = ref.scaled_masked_softmax_forward(x, mask, SCALE)
    _check(y, _masked64(x, mask, SCALE), dtype)
    assert torch.all(y[0, :, 0] == 0)  # the fully masked row


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (6, 5, 5), (3, 17, 17), (2, 4, 9)])
def test_scaled_upper_triang_masked_softmax_forward(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    expected = _prefix_softmax64(x, SCALE, lambda i: i + 1)  # keys j <= i
    _check(ref.scaled_upper_triang_masked_softmax_forward(x, SCALE), expected, dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES_4D + [(1, 2, 3, 11)])
def test_scaled_aligned_causal_masked_softmax_forward(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    sq, sk = shape[-2:]
    expected = _prefix_softmax64(x, SCALE, lambda i: i + sk - sq + 1)  # keys j <= i + sk - sq
    _check(ref.scaled_aligned_causal_masked_softmax_forward(x, SCALE), expected, dtype)


def _variants(x):
    """(forward64 differentiable in x, forward op, backward op) for every member of the family."""
    mask = _random_mask(x)
    sq, sk = x.shape[-2:]
    return [
        (lambda t: torch.softmax(t * SCALE, -1), lambda t: ref.scaled_softmax_forward(t, SCALE), ref.scaled_softmax_backward),
        (lambda t: _masked64(t, mask, SCALE), lambda t: ref.scaled_masked_softmax_forward(t, mask, SCALE),
         ref.scaled_masked_softmax_backward),
        (
            lambda t: _prefix_softmax64(t.flatten(0, 1), SCALE, lambda i: i + 1).reshape(t.shape),
            lambda t: ref.scaled_upper_triang_masked_softmax_forward(t.flatten(0, 1), SCALE).reshape(t.shape),
            ref.scaled_upper_triang_masked_softmax_backward,
        ),
        (
            lambda t: _prefix_softmax64(t, SCALE, lambda i: i + sk - sq + 1),
            lambda t: ref.scaled_aligned_causal_masked_softmax_forward(t, SCALE),
            ref.scaled_aligned_causal_masked_softmax_backward,
        ),
    ]


@pytest.mark.parametrize("variant", range(4))
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 5), (1, 2, 7, 13), (2, 1, 6, 4)])
def test_backward_matches_autograd(shape, variant):
    """float32: the backward op, fed the forward op's y, equals the VJP of the float64 forward."""
    x = randn(*shape, scale=3.0)
    dy = randn(*shape)
    forward64, forward, backward = _variants(x)[variant]
    x64 = x.double().requires_grad_()
    expected = torch.autograd.grad(forward64(x64), x64, dy.double())[0]
    dx = backward(dy, forward(x), SCALE)
    assert dx.dtype == torch.float32 and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), expected, **dtype_tols(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", range(4))
def test_backward_half_precision(variant, dtype):
    """bf16/fp16: y is rounded to the dtype, and the VJP of softmax depends on y alone, so the oracle
    is the catalog's VJP dx = scale y (dy - sum(dy y)) evaluated in float64 at that same rounded y
    (the float32 test above ties this formula to autograd)."""
    x, dy = randn(2, 2, 6, 9, dtype=dtype, scale=3.0), randn(2, 2, 6, 9, dtype=dtype)
    _, forward, backward = _variants(x)[variant]
    y = forward(x)
    y64, dy64 = y.double(), dy.double()
    expected = SCALE * y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))
    _check(backward(dy, y, SCALE), expected, dtype)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ref.scaled_masked_softmax_forward(randn(2, 3, 4), torch.zeros(2, 1, 3, 4, dtype=torch.bool), 1.0), ValueError,
         r"\[b, h, sq, sk\]"),
        (lambda: ref.scaled_masked_softmax_forward(randn(2, 3, 4, 5), torch.zeros(2, 3, 4, 5, dtype=torch.bool), 1.0), ValueError,
         r"\[2 or 1, 1, 4, 5\]"),
        (lambda: ref.scaled_masked_softmax_forward(randn(2, 3, 4, 5), torch.zeros(2, 1, 4, 5), 1.0), ValueError, "torch.bool"),
        (lambda: ref.scaled_upper_triang_masked_softmax_forward(randn(2, 3, 4, 5), 1.0), ValueError, r"\[b\*h, sq, sk\]"),
        (lambda: ref.scaled_aligned_causal_masked_softmax_forward(randn(3, 4, 5), 1.0), ValueError, r"\[b, h, sq, sk\]"),
        (lambda: ref.scaled_softmax_backward(randn(2, 3), randn(2, 4), 1.0), ValueError, "must match"),
        (lambda: ref.scaled_softmax_forward(torch.ones(3, dtype=torch.int32), 1.0), TypeError, "dtype"),
    ],
)
def test_softmax_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_softmax_dispatch_through_ops():
    x = randn(2, 2, 4, 4)
    with with_preference("reference"), with_strict_mode():
        y, impl = ops.scaled_upper_triang_masked_softmax_forward.traced(x.flatten(0, 1), SCALE)
        dx = ops.scaled_softmax_backward(x, ref.scaled_softmax_forward(x, SCALE), SCALE)
    assert impl.impl_id == IMPL_ID
    assert torch.equal(y, ref.scaled_upper_triang_masked_softmax_forward(x.flatten(0, 1), SCALE)) and dx.shape == x.shape
