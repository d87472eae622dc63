"""Layout helpers: packing padded batches to thd and back, and the rows of padded thd sequences."""

from __future__ import annotations

import torch

from tests.utils import randn
from transformer_engine.pytorch.attention import _layout


def test_token_rows_example():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert _layout.token_rows(cu, torch.tensor([0, 8])).tolist() == [0, 1, 8, 9, 10]


def test_pack_unpack_round_trip_and_gradients():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    x = randn(8, 2, 5).requires_grad_(requires_grad=True)
    padded = _layout.unpack_to_bshd(x, cu, 4)
    assert padded.shape == (3, 4, 2, 5)
    assert torch.all(padded[0, 3] == 0) and torch.all(padded[1, 1:] == 0)
    torch.testing.assert_close(padded[2], x[4:8], rtol=0, atol=0)
    back = _layout.pack_bshd(padded, cu)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(back, x, torch.ones_like(back))
    torch.testing.assert_close(grad, torch.ones_like(x), rtol=0, atol=0)


def test_scatter_gather_inverse():
    rows = torch.tensor([4, 0, 2])
    x = randn(3, 2)
    spread = _layout.scatter_rows(x, rows, 6)
    assert torch.all(spread[[1, 3, 5]] == 0)
    torch.testing.assert_close(_layout.gather_rows(spread, rows), x, rtol=0, atol=0)


def test_sbhd_views_and_lengths():
    x = randn(5, 3, 2, 4)
    assert _layout.to_bshd(x, "sbhd").shape == (3, 5, 2, 4)
    assert _layout.from_bshd(_layout.to_bshd(x, "sbhd"), "sbhd").data_ptr() == x.data_ptr()
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    assert _layout.seqlens(cu).tolist() == [2, 5] and _layout.max_seqlen(cu, None) == 5 and _layout.max_seqlen(cu, 9) == 9
