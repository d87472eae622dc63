"""MultiheadAttention and TransformerLayer with ``set_parallel_mode=True`` (QKV and FC1 column-parallel, the
projection and FC2 row-parallel), with and without sequence parallelism and FP8, against the
single-process layer with the same weights; and ``te.checkpoint(..., distribute_saved_activations=True)``.

Tolerances as in test_linear_comm.py: high precision and delayed scaling differ only in summation
order (the attention of a rank's heads is computed exactly as in the full layer).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import device
from tests.pytorch.parallel._tp import RECIPES, assert_close, compare_grads, delayed_fp8_tolerance, fp8_context, gather, split
from transformer_engine.pytorch.parallel import shard_state_dict
from transformer_engine.pytorch.parallel.comm import group_size

H, FFN, HEADS, S, B = 64, 64, 4, 16, 2
TOLS = {None: dict(rtol=1e-5, atol=1e-5), "delayed": delayed_fp8_tolerance()}


def _layer(parallel: bool, sp: bool, **kwargs) -> torch.nn.Module:
    tp = dict(tp_group=dist.group.WORLD, tp_size=group_size(None), sequence_parallel=sp) if parallel else {}
    return te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                               device=device(), set_parallel_mode=parallel, **tp, **kwargs)


def check_transformer_layer(sp: bool, recipe, kwargs) -> None:
    torch.manual_seed(0)
    ref = _layer(parallel=False, sp=False, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tp = _layer(parallel=True, sp=sp, **kwargs)
    tp.load_state_dict(shard_state_dict(tp, ref.state_dict(), None))
    torch.manual_seed(1)
    x, dy = torch.randn(S, B, H, device=device()), torch.randn(S, B, H, device=device())
    layout = "seq" if sp else "full"
    for step in range(2 if recipe else 1):
        outs = []
        for module, lay in ((ref, "full"), (tp, layout)):
            module.zero_grad(set_to_none=True)
            x_local = split(x, lay).requires_grad_()
            with fp8_context(recipe):
                y = module(x_local)
            y.backward(split(dy, lay))
            outs.append((gather(y, lay), gather(x_local.grad, lay)))
        (y_ref, dx_ref), (y_tp, dx_tp) = outs
        assert_close(y_tp, y_ref, TOLS[recipe], f"output, step {step}")
        assert_close(dx_tp, dx_ref, TOLS[recipe], f"input gradient, step {step}")
        compare_grads(tp, ref, TOLS[recipe])


LAYERS = {
    "gqa": dict(num_gqa_groups=2, activation="swiglu"),
    "fused-qkv": dict(fuse_qkv_params=True, normalization="RMSNorm"),
    "fused-qkv-concat-gqa": dict(fuse_qkv_params=True, qkv_weight_interleaved=False, num_gqa_groups=2),
    "qk-norm": dict(qk_norm_type="RMSNorm", bias=False),
    "comm-overlap": dict(ub_tp_comm_overlap=True),  # pipelined forward collectives under SP
}


@pytest.mark.parametrize("recipe", [None, "delayed"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_transformer_layer_matches_single_process(ranks2, layer, sp, recipe):
    ranks2.run(check_transformer_layer, sp, recipe, LAYERS[layer])


def test_transformer_layer_on_four_ranks(ranks):
    ranks.run(check_transformer_layer, sp=True, recipe="delayed", kwargs={"activation": "swiglu"})


def check_set_group_later() -> None:
    """A layer built with tp_size and no group runs once set_tensor_parallel_group reaches every module."""
    p = group_size(None)
    layer = _layer(parallel=False, sp=False)
    late = te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device=device(),
                               set_parallel_mode=True, tp_size=p, sequence_parallel=True)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        late(torch.randn(S // p, B, H, device=device()))
    late.set_tensor_parallel_group(dist.group.WORLD)
    late.load_state_dict(shard_state_dict(late, layer.state_dict(), None))
    x = torch.randn(S, B, H, device=device())
    assert_close(gather(late(split(x, "seq")), "seq"), layer(x), TOLS[None], "output")


def test_set_tensor_parallel_group_later(ranks2):
    ranks2.run(check_set_group_later)


def check_distributed_saved_activations() -> None:
    """te.checkpoint keeps 1/P of the region's input per rank; gradients equal the undistributed run's."""
    p = group_size(None)
    layer = _layer(parallel=True, sp=True)
    x = torch.randn(S // p, B, H, device=device())
    results = []
    for distribute in (False, True):
        layer.zero_grad(set_to_none=True)
        x_local = x.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y = te.checkpoint(layer, x_local, distribute_saved_activations=distribute, tp_group=dist.group.WORLD)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), x_local.grad, [q.grad.clone() for q in layer.parameters()], saved))
    (y0, dx0, g0, saved0), (y1, dx1, g1, saved1) = results
    assert saved0 == [x.numel()] and saved1 == [x.numel() // p], (saved0, saved1)
    for a, b in zip((y1, dx1, *g1), (y0, dx0, *g0)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs use_reentrant=True"):
        te.checkpoint(layer, x, distribute_saved_activations=True, tp_group=dist.group.WORLD, use_reentrant=False)


def test_checkpoint_distributes_saved_activations(ranks):
    ranks.run(check_distributed_saved_activations)


def check_graphed_tensor_parallel_layer(recipe, overlap: bool) -> None:
    """make_graphed_callables on a TP + SP layer (collectives and the amax all-reduce inside the graphs;
    ``overlap``: pipelined with the forward GEMMs over symmetric memory): three SGD steps give this rank the
    outputs, gradients and scaling state of the eager layer."""
    from tests.pytorch.test_graph import _scaling_tensors, _train

    p = group_size(None)
    eager, graphed = (_layer(parallel=True, sp=True, ub_tp_comm_overlap=overlap) for _ in range(2))
    graphed.load_state_dict(eager.state_dict())
    x = torch.randn(S // p, B, H, device=device(), requires_grad=True)
    rec = None if recipe is None else RECIPES[recipe]()
    graphed = te.make_graphed_callables(graphed, (x,), enabled=rec is not None, recipe=rec)
    inputs = [torch.randn_like(x).requires_grad_() for _ in range(3)]
    grads = [torch.randn_like(x) for _ in range(3)]
    expected = _train(eager, torch.optim.SGD(eager.parameters(), lr=0.1), inputs, grads, rec)
    actual = _train(graphed, torch.optim.SGD(graphed.parameters(), lr=0.1), inputs, grads, rec)
    for a, b in zip(actual[0] + sum(actual[1], []), expected[0] + sum(expected[1], [])):
        assert_close(a, b, TOLS[None], "graphed vs eager")
    for a, b in zip(_scaling_tensors(graphed), _scaling_tensors(eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["", "comm-overlap"])
@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_graphed_tensor_parallel_layer_matches_eager(ranks2, recipe, overlap):
    if ranks2.backend != "nccl":
        pytest.skip("CUDA graphs need GPUs (the nccl variant runs on 2 GPUs)")
    ranks2.run(check_graphed_tensor_parallel_layer, recipe, overlap)
