"""Data parallelism: DDP and FSDP2 (``fully_shard``) train the modules as one process does, FP8 included;
the delayed-scaling amaxes are MAX-reduced in one collective per update and leave every rank with the
same scales.

Each rank trains on its rows of a global batch with the mean loss of its rows; data parallelism
averages the ranks' gradients. The single-process model, rebuilt on every rank, trains on the whole
batch with P times the mean loss and 1/P of the learning rate: its dy is then elementwise the ranks'
dy (so FP8 casts of dy see the same values from the first step on, when the scale is still 1) and
its updates are the same (powers of two are exact). What is compared is each parameter's change
over the steps. Tolerances: high precision and delayed scaling (identical FP8 operands: the reduced
amaxes are the global batch's) differ only in the summation order of the gradient reduction; current
scaling casts dy with the amax of the rank's rows, not of the whole batch: FP8 noise (E5M2, 2 mantissa bits).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import device
from tests.pytorch.parallel._tp import assert_close, delayed_fp8_tolerance, fp8_context, split
from transformer_engine.pytorch.parallel.comm import group_size

ROWS, H, FFN, OUT, STEPS = 8, 32, 64, 16, 3  # rows per rank: the FP8 shape rule holds on every rank
TOLS = {None: {"rel_err": 1e-5}, "delayed": delayed_fp8_tolerance(), "current": {"rel_err": 0.2}}
LR = 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # the split Linear's two parameters are slices of one buffer: the wrappers must cope with shared storage
    head = te.Linear(H, OUT, parameters_split=("first", "second"), device=device())
    return torch.nn.Sequential(te.LayerNormMLP(H, FFN, device=device()), head).to(device())


def _batches():
    torch.manual_seed(1)
    n = ROWS * group_size(None)
    return [(torch.randn(n, H, device=device()), torch.randn(n, OUT, device=device())) for _ in range(STEPS)]


def _train(model: torch.nn.Module, batches, recipe, local: bool) -> None:
    """SGD steps: on this rank's rows (``local``), or on all rows with P x the loss and lr / P."""
    p = 1 if local else group_size(None)
    opt = torch.optim.SGD(model.parameters(), lr=LR / p)
    for x, target in batches:
        if local:
            x, target = split(x, "seq"), split(target, "seq")
        with fp8_context(recipe):
            y = model(x)
        (p * torch.nn.functional.mse_loss(y, target)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (group_size(None),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_data_parallel_training(wrapper: str, recipe) -> None:
    ref, batches = _model(), _batches()
    initial = {name: p.detach().clone() for name, p in ref.named_parameters()}
    _train(ref, batches, recipe, local=False)
    model = _wrap(_model(), wrapper)
    _train(model, batches, recipe, local=True)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        change = _full(param.detach()) - initial[name]
        assert_close(change, ref_params[name].detach() - initial[name], TOLS[recipe], f"change of {name}")
    if recipe == "delayed":
        for mine, theirs in zip(getattr(model, "module", model).modules(), ref.modules()):
            if getattr(mine, "fp8_meta", {}).get("scaling_fwd") is not None:
                torch.testing.assert_close(mine.fp8_meta["scaling_fwd"].scale, theirs.fp8_meta["scaling_fwd"].scale,
                                           rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_matches_one_process(ranks2, wrapper, recipe):
    ranks2.run(check_data_parallel_training, wrapper, recipe)


def test_four_ranks(ranks):
    ranks.run(check_data_parallel_training, "fsdp2", "delayed")


def check_one_amax_reduction_per_update() -> None:
    """Four modules: one MAX all-reduce at the autocast exit, one at the end of backward; equal scales after."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(op)
        return original(tensor, op=op, group=group, async_op=async_op)

    model = torch.nn.Sequential(*[te.Linear(H, H, device=device()) for _ in range(4)])
    torch.manual_seed(10 + dist.get_rank())  # different data on every rank
    x = torch.randn(ROWS, H, device=device())
    dist.all_reduce = counting
    try:
        with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=2)):
            y = model(x)
        forward_calls = list(calls)
        y.sum().backward()
    finally:
        dist.all_reduce = original
    assert forward_calls == [dist.ReduceOp.MAX] and calls == [dist.ReduceOp.MAX] * 2, calls
    for layer in model:
        for key in ("scaling_fwd", "scaling_bwd"):
            scale = layer.fp8_meta[key].scale
            gathered = [torch.empty_like(scale) for _ in range(group_size(None))]
            dist.all_gather(gathered, scale)
            assert all(torch.equal(g, scale) for g in gathered), f"{key} scales differ across ranks"
            assert bool((scale != 1).any()), "the update ran"


def test_amax_reduction_is_one_collective_per_update(ranks2):
    ranks2.run(check_one_amax_reduction_per_update)


def _delayed_step(module, recipe):
    def step(x):
        with te.autocast(recipe=recipe):
            return module(x)

    return step


def check_compiled_amax_reduction_matches_eager() -> dict:
    """A LayerNormMLP trained on rank-dependent data, eagerly and compiled (fullgraph, aot_eager: the update with its
    MAX all-reduce traced) from one state: equal outputs, input gradients and scaling state, bit for bit; the
    reduced scales are the same on every rank."""
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    eager = te.LayerNormMLP(H, FFN, device=device())
    torch.manual_seed(20 + dist.get_rank())
    xs = [torch.randn(ROWS, H, device=device()) * (1 + dist.get_rank()) for _ in range(4)]

    def train(step, module, inputs):
        outs = []
        for x in inputs:
            x = x.clone().requires_grad_()
            y = step(x)
            y.square().sum().backward()
            module.zero_grad(set_to_none=True)
            outs.append((y.detach(), x.grad))
        return outs

    train(_delayed_step(eager, recipe), eager, xs[:1])  # the state exists before tracing
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    step = torch.compile(_delayed_step(compiled, recipe), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(train(_delayed_step(eager, recipe), eager, xs[1:]), train(step, compiled, xs[1:])):
        assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    for key in ("scaling_fwd", "scaling_bwd"):
        for name in ("amax_history", "scale", "scale_inv"):
            ours, theirs = getattr(compiled.fp8_meta[key], name), getattr(eager.fp8_meta[key], name)
            assert torch.equal(ours, theirs), (key, name)
        scale = compiled.fp8_meta[key].scale
        gathered = [torch.empty_like(scale) for _ in range(group_size(None))]
        dist.all_gather(gathered, scale)
        assert all(torch.equal(g, scale) for g in gathered), f"{key} scales differ across ranks"
    return {}


def test_compiled_amax_reduction_matches_eager(ranks2):
    ranks2.run(check_compiled_amax_reduction_matches_eager)
