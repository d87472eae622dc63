"""Collectives and their autograd wrappers against their formulas, on 2 and 4 ranks.

Rank q holds x_q = q-dependent integer-valued data, so every sum is exact in float32 and each result
can be written from the values of all ranks, which every rank can rebuild.
"""

from __future__ import annotations

import pytest
import torch

from tests.pytorch.parallel._ranks import device
from transformer_engine.plugin import ops
from transformer_engine.pytorch.parallel import comm
from transformer_engine.pytorch.quantization.float8_tensor import Float8Tensor


def _value(rank: int, *shape) -> torch.Tensor:
    """Rank ``rank``'s integer-valued tensor (the same on every process that asks)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 8, shape, generator=g).float().to(device())


def check_plain_collectives() -> None:
    p, r = comm.group_size(None), comm.group_rank(None)
    xs = [_value(q, 4 * p, 3) for q in range(p)]
    total = sum(xs)
    torch.testing.assert_close(comm.all_reduce(xs[r], None), total, rtol=0, atol=0)
    torch.testing.assert_close(comm.all_reduce_max(xs[r], None), torch.stack(xs).amax(0), rtol=0, atol=0)
    torch.testing.assert_close(comm.all_gather(xs[r], None), torch.cat(xs), rtol=0, atol=0)
    torch.testing.assert_close(comm.reduce_scatter(xs[r], None), total.chunk(p)[r], rtol=0, atol=0)
    torch.testing.assert_close(comm.split(total, None), total.chunk(p)[r], rtol=0, atol=0)
    assert comm.all_reduce(xs[r], None) is not xs[r], "the input is left alone"
    mine = xs[r].clone()
    assert comm.all_reduce_(mine, None) is mine and torch.equal(mine, total), "in place"
    with pytest.raises(ValueError, match=f"dim 0 \\(5\\) divisible by the group size {p}"):
        comm.reduce_scatter(torch.zeros(5, 2, device=device()), None)
    with pytest.raises(ValueError, match=f"input \\(5 rows\\) over {p} ranks"):
        comm.split(torch.zeros(5, 2, device=device()), None)


def check_fp8_gather_moves_the_payload() -> None:
    p, r = comm.group_size(None), comm.group_rank(None)
    scale = torch.tensor(4.0, device=device())
    parts = [ops.quantize(_value(q, 8, 16) / 4, scale, torch.float8_e4m3fn)[0] for q in range(p)]
    gathered = comm.all_gather(Float8Tensor(parts[r], 1 / scale), None)
    assert gathered.data.dtype == torch.float8_e4m3fn and gathered.scale_inv.item() == 0.25
    assert torch.equal(gathered.data.view(torch.uint8), torch.cat(parts).view(torch.uint8))


def check_autograd_regions() -> None:
    """Each wrapper's forward, and its backward = the transposed collective of the upstream gradient."""
    p, r = comm.group_size(None), comm.group_rank(None)
    xs = [_value(q, 2 * p, 4) for q in range(p)]
    gs = [_value(50 + q, 2 * p, 4) for q in range(p)]
    us = [_value(90 + q, 2 * p * p, 4) for q in range(p)]
    cases = {  # name: (wrapper, its input on rank r, expected output, upstream grad, expected input grad)
        "copy": (comm.copy_to_tensor_parallel_region, xs[0], xs[0], gs[r], sum(gs)),
        "reduce": (comm.reduce_from_tensor_parallel_region, xs[r], sum(xs), gs[0], gs[0]),
        "gather_seq": (comm.gather_from_sequence_parallel_region, xs[r], torch.cat(xs), us[r], sum(us).chunk(p)[r]),
        "reduce_scatter_seq": (comm.reduce_scatter_to_sequence_parallel_region, xs[r], sum(xs).chunk(p)[r], gs[r][: 2],
                               torch.cat([g[:2] for g in gs])),
        "scatter_seq": (comm.scatter_to_sequence_parallel_region, xs[0], xs[0].chunk(p)[r], gs[r][:2], torch.cat([g[:2] for g in gs])),
        "gather_tp": (comm.gather_from_tensor_parallel_region, xs[r], torch.cat(xs, dim=-1), torch.cat(gs, dim=-1), gs[r]),
    }
    for name, (fn, x, expected, grad, expected_grad) in cases.items():
        x = x.clone().requires_grad_()
        y = fn(x, None)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, msg=lambda m: f"{name} forward: {m}")
        y.backward(grad)
        torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=0, msg=lambda m: f"{name} backward: {m}")


def check_saved_activation_split() -> None:
    p = comm.group_size(None)
    x = _value(7, 3, 2 * p, 5)
    chunk = comm.split_saved_activation(x, None)
    assert chunk.numel() == x.numel() // p
    torch.testing.assert_close(comm.gather_saved_activation(chunk, x.shape, None), x, rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"\\(7 elements, shape \\(7,\\)\\) over tp_group's {p} ranks"):
        comm.split_saved_activation(torch.zeros(7, device=device()), None)


@pytest.mark.parametrize("check", [check_plain_collectives, check_fp8_gather_moves_the_payload, check_autograd_regions,
                                   check_saved_activation_split], ids=lambda f: f.__name__[6:])
def test_collectives(ranks, check):
    ranks.run(check)


def test_one_rank_needs_no_process_group():
    x = torch.randn(4, 3)
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    for fn in (comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.split, comm.split_saved_activation):
        assert fn(x, None) is x
    assert comm.copy_to_tensor_parallel_region(x, None).data_ptr() == x.data_ptr()
