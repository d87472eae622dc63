"""Collective operations and tensor-parallel ops.Linear on 2 gloo ranks, against the single-process math.

Every rank builds the same full tensors from one seed, so each can check its own shard exactly.
"""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch.ops as te_ops
from tests.pytorch.parallel._ranks import close_pools, get_pool
from transformer_engine.pytorch.parallel import comm


@pytest.fixture(scope="module")
def ranks2():
    yield get_pool(2, "gloo")
    close_pools()


def _full(*shape, seed):
    return torch.randint(-4, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def check_collectives() -> None:
    p, r = comm.group_size(None), comm.group_rank(None)
    xs = [_full(4, 3, seed=q) for q in range(p)]
    for op, y_expected in ((te_ops.AllReduce(), sum(xs)), (te_ops.ReduceScatter(), sum(xs).chunk(p)[r]),
                           (te_ops.AllGather(), torch.cat(xs))):
        torch.testing.assert_close(op(xs[r]), y_expected, rtol=0, atol=0)
    # gradients: AllGather reduce-scatters the (here identical) dy of every rank; ReduceScatter all-gathers
    dy_full = _full(4 * p, 3, seed=99)
    x = xs[r].clone().requires_grad_(requires_grad=True)
    te_ops.AllGather()(x).backward(dy_full)
    torch.testing.assert_close(x.grad, dy_full.chunk(p)[r] * p, rtol=0, atol=0)
    dys = [_full(4 // p, 3, seed=50 + q) for q in range(p)]
    x = xs[r].clone().requires_grad_(requires_grad=True)
    te_ops.ReduceScatter()(x).backward(dys[r])
    torch.testing.assert_close(x.grad, torch.cat(dys), rtol=0, atol=0)
    x = xs[r].clone().requires_grad_(requires_grad=True)
    te_ops.AllReduce()(x).backward(xs[0])
    torch.testing.assert_close(x.grad, xs[0], rtol=0, atol=0)


def check_tensor_parallel_linear(mode: str, sequence_parallel: bool) -> None:
    p, r = comm.group_size(None), comm.group_rank(None)
    x_full, w_full, b_full = _full(8, 16, seed=1), _full(12, 16, seed=2), _full(p, 12, seed=3)
    dy_full = _full(8, 12, seed=4)
    bias_total = b_full.sum(0) if mode == "row" else b_full[0]  # row: each rank adds its bias before the sum (TE)
    x_ref = x_full.clone().requires_grad_(requires_grad=True)
    (x_ref @ w_full.T + bias_total).backward(dy_full)
    op = te_ops.Linear(16, 12, device="cpu", tensor_parallel_mode=mode, sequence_parallel=sequence_parallel)
    rows = slice(r * 8 // p, (r + 1) * 8 // p) if sequence_parallel else slice(None)
    with torch.no_grad():
        if mode == "column":
            op.weight.copy_(w_full.chunk(p, 0)[r])
            op.bias.copy_(b_full[0].chunk(p)[r])
            x = x_full[rows]
        else:
            op.weight.copy_(w_full.chunk(p, 1)[r])
            op.bias.copy_(b_full[r])
            x = x_full.chunk(p, 1)[r]  # every row (the output is what sequence parallelism shards)
    x = x.clone().requires_grad_(requires_grad=True)
    y = op(x)
    if mode == "column":
        y_exp, dy = (x_ref.detach() @ w_full.T + bias_total).chunk(p, 1)[r], dy_full.chunk(p, 1)[r]
    else:
        y_exp, dy = (x_full @ w_full.T + bias_total)[rows], dy_full[rows]
    torch.testing.assert_close(y, y_exp, rtol=0, atol=0)
    y.backward(dy)
    dx_exp = x_ref.grad[rows] if mode == "column" else x_ref.grad.chunk(p, 1)[r]
    torch.testing.assert_close(x.grad, dx_exp, rtol=0, atol=0)


def test_collectives(ranks2):
    ranks2.run(check_collectives)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_tensor_parallel_linear(ranks2, mode, sequence_parallel):
    ranks2.run(check_tensor_parallel_linear, mode, sequence_parallel)
