"""parallel_cross_entropy against torch.nn.functional.cross_entropy: loss, gradients, reduction, label
smoothing, ignored tokens, 2-D and 3-D logits; the vocab-parallel case on 2 gloo ranks against the
single-process loss over the full vocabulary; errors; torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.pytorch.parallel._ranks import close_pools, get_pool
from tests.utils import dtype_tols
from transformer_engine.plugin import ops
from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

IGNORE = -100
#: the loss is float32 math for any logits dtype: float32 tolerances against a float32 oracle on the same
#: (rounded) logits. Gradients come back in the logits' dtype: one rounding of the float32 value.
LOSS_TOLS = dtype_tols(torch.float32)


@pytest.fixture(scope="module")
def ranks2():
    yield get_pool(2, "gloo")
    close_pools()


def _case(shape, vocab, dtype, seed, ignored=3):
    """Logits [*shape, vocab] (rounded to dtype) and targets [*shape] with ``ignored`` tokens set to IGNORE."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
    t = torch.randint(0, vocab, shape, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:ignored]] = IGNORE
    return z, t


def _torch_loss(z, t, eps, reduce_loss, ignore_idx=IGNORE):
    """F.cross_entropy in float32 on the same logits, shaped as parallel_cross_entropy returns it."""
    loss = F.cross_entropy(z.float().reshape(-1, z.shape[-1]), t.reshape(-1), ignore_index=ignore_idx,
                           label_smoothing=eps, reduction="mean" if reduce_loss else "none")
    return loss.reshape(1) if reduce_loss else loss.reshape(t.shape)


def _loss_and_grad(fn, z, t, eps, reduce_loss, grad_seed=7):
    """fn's loss and d(sum(loss * w)) / dz for fixed random weights w (a non-trivial upstream gradient)."""
    z = z.detach().clone().requires_grad_(requires_grad=True)
    loss = fn(z, t, eps, reduce_loss)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(grad_seed)) + 0.5
    (loss * w).sum().backward()
    return loss.detach(), z.grad


def _ours(z, t, eps, reduce_loss):
    return parallel_cross_entropy(z, t, eps, reduce_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13,), (2, 7), (7, 2)], ids=["2d", "bsv", "sbv"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduce_loss", [False, True])
def test_matches_torch(dtype, shape, eps, reduce_loss):
    z, t = _case(shape, 37, dtype, seed=len(shape) + int(eps * 10))
    loss, grad = _loss_and_grad(_ours, z, t, eps, reduce_loss)
    ref_loss, ref_grad = _loss_and_grad(_torch_loss, z.float(), t, eps, reduce_loss)
    assert loss.dtype == torch.float32 and loss.shape == ((1,) if reduce_loss else t.shape)
    assert grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLS)
    torch.testing.assert_close(grad, ref_grad.to(dtype), **dtype_tols(dtype))
    if not reduce_loss:
        assert (loss[t == IGNORE] == 0).all()
    assert (grad.reshape(-1, 37)[t.reshape(-1) == IGNORE] == 0).all()


def test_ignore_idx_in_vocab_range_and_all_ignored():
    z, t = _case((9,), 11, torch.float32, seed=3, ignored=0)
    t[::2] = 4  # a real class used as the ignore index
    loss, grad = _loss_and_grad(lambda *a: parallel_cross_entropy(*a, ignore_idx=4), z, t, 0.0, reduce_loss=False)
    ref_loss, ref_grad = _loss_and_grad(lambda *a: _torch_loss(*a, ignore_idx=4), z, t, 0.0, reduce_loss=False)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLS)
    torch.testing.assert_close(grad, ref_grad, **LOSS_TOLS)
    # every token ignored: the mean divides by max(count, 1), so loss and gradient are 0, not NaN
    everything = torch.full((9,), IGNORE)
    loss, grad = _loss_and_grad(_ours, z, everything, 0.1, reduce_loss=True)
    assert loss.tolist() == [0.0] and not grad.any()


def test_bf16_gradient_rounded_once_after_the_upstream_gradient():
    """As TE's test: per-token weights scale the float32 gradient before its one rounding to bf16."""
    z = torch.zeros(2, 2, 3, dtype=torch.bfloat16, requires_grad=True)
    t = torch.tensor([[0, 1], [2, IGNORE]])
    w = torch.tensor([[0.01, 0.03], [0.1, 0.7]])
    parallel_cross_entropy(z, t).backward(w)
    zf = z.detach().float().requires_grad_(requires_grad=True)
    _torch_loss(zf, t, 0.0, reduce_loss=False).backward(w)
    torch.testing.assert_close(z.grad, zf.grad.to(torch.bfloat16), rtol=0, atol=0)


def test_transposed_logits_view():
    """[SQ, B, V] logits seen as [B, SQ, V] (not viewable as rows): same loss as the contiguous copy."""
    z, _ = _case((4, 2), 8, torch.float32, seed=5)
    t = torch.randint(0, 8, (2, 4))
    view = z.transpose(0, 1)
    torch.testing.assert_close(parallel_cross_entropy(view, t), parallel_cross_entropy(view.contiguous(), t), rtol=0, atol=0)


def test_deprecated_input_keyword():
    z, t = _case((5,), 6, torch.float32, seed=1, ignored=0)
    with pytest.warns(FutureWarning, match="_input"):
        loss = parallel_cross_entropy(None, t, _input=z)
    torch.testing.assert_close(loss, _torch_loss(z, t, 0.0, reduce_loss=False), **LOSS_TOLS)


@pytest.mark.parametrize(
    "inp, target, kwargs, error, match",
    [
        (torch.randn(5), torch.zeros(5, dtype=torch.long), {}, ValueError, "tokens, V"),
        (torch.randn(2, 2, 2, 5), torch.zeros(2, 2, 2, dtype=torch.long), {}, ValueError, "tokens, V"),
        (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long), {}, ValueError, "floating-point"),
        (torch.randn(3, 5), torch.zeros(3), {}, TypeError, "integer class indices"),
        (torch.randn(3, 5), torch.zeros(4, dtype=torch.long), {}, ValueError, "one target per token"),
        (torch.randn(3, 5), torch.zeros(3, dtype=torch.long), {"label_smoothing": 1.5}, ValueError, r"\[0, 1\]"),
        (torch.randn(3, 5), torch.zeros(3, dtype=torch.long), {"ignore_idx": 1.0}, TypeError, "ignore_idx"),
        (torch.randn(3, 5), torch.tensor([0, 5, 1]), {}, ValueError, r"in \[0, 5\).*got \[5\]"),
        (torch.randn(3, 5), torch.tensor([0, -1, IGNORE]), {}, ValueError, r"ignore_idx=-100; got \[-1\]"),
    ],
)
def test_errors(inp, target, kwargs, error, match):
    with pytest.raises(error, match=match):
        parallel_cross_entropy(inp, target, **kwargs)


def test_out_of_range_target_raises_before_any_backend_runs(monkeypatch):
    """A bad target is our ValueError whatever the backend would do with it (NaN or its own error)."""
    calls = []
    monkeypatch.setattr(ops, "cross_entropy_fwd", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(ValueError, match="parallel_cross_entropy: every target"):
        parallel_cross_entropy(torch.randn(2, 4), torch.tensor([1, 4]))
    assert not calls


def test_compiles_without_graph_breaks():
    z, t = _case((3, 4), 19, torch.float32, seed=11)

    def step(z, t):
        return parallel_cross_entropy(z, t, 0.1, reduce_loss=True)

    explained = torch._dynamo.explain(step)(z.clone().requires_grad_(requires_grad=True), t)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss, grad = _loss_and_grad(lambda z, t, *_: compiled(z, t), z, t, 0.1, reduce_loss=True)
    ref_loss, ref_grad = _loss_and_grad(lambda z, t, *_: step(z, t), z, t, 0.1, reduce_loss=True)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLS)
    torch.testing.assert_close(grad, ref_grad, **LOSS_TOLS)
    with pytest.raises(RuntimeError, match="every target must be in"):  # traced: an async assert
        compiled(z, torch.full_like(t, 19))


# --- vocab parallel on 2 gloo ranks -----------------------------------------------------------------


def check_vocab_parallel(dtype: torch.dtype, shape, eps: float, reduce_loss: bool):
    """On every rank: the loss of this rank's vocab shard equals the single-process loss over the full
    vocabulary, and the gradient of the shard is the shard of the full gradient."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    z, t = _case(shape, 10 * world, dtype, seed=17)
    shard = z.chunk(world, dim=-1)[rank].contiguous()

    def sharded(z_local, t, eps, reduce_loss):
        return parallel_cross_entropy(z_local, t, eps, reduce_loss, dist.group.WORLD)

    loss, grad = _loss_and_grad(sharded, shard, t, eps, reduce_loss)
    full_loss, full_grad = _loss_and_grad(_ours, z, t, eps, reduce_loss)
    ref_loss, _ = _loss_and_grad(_torch_loss, z.float(), t, eps, reduce_loss)
    torch.testing.assert_close(loss, full_loss, **LOSS_TOLS)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLS)
    torch.testing.assert_close(grad, full_grad.chunk(world, dim=-1)[rank], **dtype_tols(dtype))
    # a target of the full vocabulary beyond this rank's columns is valid; beyond the full vocabulary is not
    with pytest.raises(ValueError, match=rf"in \[0, {10 * world}\)"):
        sharded(shard, torch.full_like(t, 10 * world), 0.0, reduce_loss=False)
    return float(loss.sum())


@pytest.mark.parametrize(
    "dtype, shape, eps, reduce_loss",
    [
        (torch.float32, (2, 6), 0.0, False),
        (torch.float32, (11,), 0.1, True),
        (torch.bfloat16, (6, 2), 0.1, False),
    ],
)
def test_vocab_parallel_equals_full_vocab(ranks2, dtype, shape, eps, reduce_loss):
    losses = ranks2.run(check_vocab_parallel, dtype, shape, eps, reduce_loss)
    assert losses[0] == losses[1]  # every rank holds the same (replicated) loss


def check_group_of_one_rank():
    """A group of one rank is the single-process case (no shard offset, no collectives)."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    z, t = _case((5,), 7, torch.float32, seed=2)
    mine = parallel_cross_entropy(z, t, 0.1, reduce_loss=False, dist_process_group=groups[dist.get_rank()])
    torch.testing.assert_close(mine, parallel_cross_entropy(z, t, 0.1, reduce_loss=False, dist_process_group=None), rtol=0, atol=0)
    return True


def test_group_of_one_rank(ranks2):
    assert ranks2.run(check_group_of_one_rank) == [True, True]
