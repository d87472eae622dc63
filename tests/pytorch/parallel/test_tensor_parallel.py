"""Tensor-parallel parameters: settings and their errors, Megatron attributes, sharding, init equal to the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import device
from tests.utils import randn
from transformer_engine.pytorch.parallel import full_tensor, shard_state_dict
from transformer_engine.pytorch.parallel.comm import group_rank, group_size
from transformer_engine.pytorch.parallel.tensor_parallel import _assemble, set_partition_sections, shard


# ------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("stride, dim", [(1, 0), (2, 0), (1, 1), (3, 1)])
def test_shard_and_assemble_are_inverse(stride, dim):
    full = randn(12, 18)
    shards = [shard(full, dim, stride, r, 3) for r in range(3)]
    assert all(s.shape[dim] == full.shape[dim] // 3 for s in shards)
    torch.testing.assert_close(_assemble(shards, dim, stride), full, rtol=0, atol=0)
    # stride s: rank r holds chunks r, r + P, ... of the s * P chunks
    chunks = full.chunk(stride * 3, dim=dim)
    torch.testing.assert_close(shards[1], torch.cat(chunks[1::3], dim=dim), rtol=0, atol=0)


def test_sectioned_shard_holds_each_sections_chunk():
    full = randn(24, 5)  # sections [Q (12 rows); K (6); V (6)], as a fused projection with fewer kv heads
    sections = (12, 6, 6)
    shards = [shard(full, 0, 3, r, 3, sections) for r in range(3)]
    q, k, v = full.split(sections)
    torch.testing.assert_close(shards[2], torch.cat([q[8:12], k[4:6], v[4:6]]), rtol=0, atol=0)
    torch.testing.assert_close(_assemble(shards, 0, 3, sections), full, rtol=0, atol=0)
    weight = torch.empty(8, 5)
    set_partition_sections(weight, sections, 3)
    assert weight.partition_stride == 3 and weight.partition_sections == sections
    with pytest.raises(ValueError, match=r"must each divide by tp_size=3 and sum to the full size 24"):
        set_partition_sections(weight, (12, 8, 4), 3)


def test_megatron_attributes():
    col = te.Linear(32, 16, parallel_mode="column", tp_size=2)
    row = te.Linear(32, 16, parallel_mode="row", tp_size=2)
    mlp = te.LayerNormMLP(32, 64, activation="swiglu", set_parallel_mode=True, tp_size=2)
    attrs = lambda p: (p.tensor_model_parallel, p.partition_dim, p.partition_stride)  # noqa: E731
    assert attrs(col.weight) == (True, 0, 1) and attrs(col.bias) == (True, 0, 1)
    assert attrs(row.weight) == (True, 1, 1) and not hasattr(row.bias, "tensor_model_parallel")
    assert attrs(mlp.fc1_weight) == (True, 0, 2) and attrs(mlp.fc2_weight) == (True, 1, 1)
    assert tuple(mlp.fc1_weight.shape) == (64, 32) and tuple(mlp.fc2_weight.shape) == (32, 32)
    assert not hasattr(mlp.layer_norm_weight, "tensor_model_parallel")


def test_bad_configurations_name_the_value():
    with pytest.raises(ValueError, match="parallel_mode='colum'"):
        te.Linear(32, 16, parallel_mode="colum", tp_size=2)
    with pytest.raises(ValueError, match="in_features=30 is not divisible by tp_size=4"):
        te.Linear(30, 16, parallel_mode="row", tp_size=4)
    with pytest.raises(ValueError, match="out_features=18 is not divisible by tp_size=4"):
        te.LayerNormLinear(32, 18, parallel_mode="column", tp_size=4)
    with pytest.raises(ValueError, match=r"out_features=12 is not divisible by tp_size=4 x 2"):
        te.LayerNormMLP(32, 6, activation="swiglu", set_parallel_mode=True, tp_size=4)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1, got 0"):
        te.Linear(32, 16, tp_size=0)
    with pytest.raises(ValueError, match="parallel_mode='row'"):
        te.LayerNormLinear(32, 16, parallel_mode="row", tp_size=2)


def test_forward_without_a_group_says_how_to_fix_it():
    layer = te.Linear(32, 16, parallel_mode="column", tp_size=2, sequence_parallel=True)
    with pytest.raises(RuntimeError, match=r"tp_size=2 with sequence_parallel=True.*set_tensor_parallel_group"):
        layer(randn(8, 32))
    mlp = te.LayerNormMLP(32, 64, set_parallel_mode=True, tp_size=2)
    with pytest.raises(RuntimeError, match="LayerNormMLP was built with tp_size=2 but has no tensor-parallel group"):
        mlp(randn(8, 32))


def test_state_dict_helpers_are_identities_without_parallelism():
    layer = te.LayerNormLinear(16, 8)
    state = layer.state_dict()
    assert shard_state_dict(layer, state, None).keys() == state.keys()
    assert full_tensor(layer.weight, layer.weight, None) is layer.weight


# ------------------------------------------------------------------------------------ several ranks
def _modules(parallel: bool, tracker=None):
    """The modules whose initialization is compared, built from seed 0 (sharded over the world or not)."""
    p = group_size(None)
    tp = dict(tp_group=dist.group.WORLD, tp_size=p) if parallel else {}
    kw = dict(device=device(), get_rng_state_tracker=tracker, **tp)
    torch.manual_seed(0)
    return {
        "column": te.Linear(32, 16, parallel_mode="column" if parallel else None, **kw),
        "row": te.Linear(32, 16, parallel_mode="row" if parallel else None, **kw),
        "lnlinear": te.LayerNormLinear(32, 24, parallel_mode="column" if parallel else None, parameters_split=("a", "b"), **kw),
        "mlp": te.LayerNormMLP(32, 16, activation="swiglu", set_parallel_mode=parallel, **kw),
        "mlp_gelu": te.LayerNormMLP(32, 16, init_method=lambda w: torch.nn.init.uniform_(w, -1, 1),
                                    set_parallel_mode=parallel, **kw),
    }


def _tracker():
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    return tracker


def check_init_matches_unsharded(use_tracker: bool) -> None:
    trackers = [_tracker(), _tracker()] if use_tracker else [None, None]
    full = _modules(parallel=False, tracker=(lambda: trackers[0]) if use_tracker else None)
    sharded = _modules(parallel=True, tracker=(lambda: trackers[1]) if use_tracker else None)
    rank, size = group_rank(None), group_size(None)
    for key, module in sharded.items():
        ref = dict(full[key].named_parameters())
        for name, param in module.named_parameters():
            expected = ref[name]
            if getattr(param, "tensor_model_parallel", False):
                expected = shard(expected, param.partition_dim, param.partition_stride, rank, size)
            torch.testing.assert_close(param, expected, rtol=0, atol=0, msg=lambda m: f"{key}.{name}: {m}")
            torch.testing.assert_close(full_tensor(param, param, None), ref[name], rtol=0, atol=0)
    if not use_tracker:  # the sharded modules consumed the default generator exactly as the unsharded ones did
        torch.testing.assert_close(torch.rand(3, device=device()), _after_unsharded_init(), rtol=0, atol=0)


def _after_unsharded_init() -> torch.Tensor:
    _modules(parallel=False)
    return torch.rand(3, device=device())


@pytest.mark.parametrize("use_tracker", [False, True], ids=["default-rng", "rng-tracker"])
def test_init_equals_the_unsharded_model(ranks, use_tracker):
    ranks.run(check_init_matches_unsharded, use_tracker)


def check_group_checks_and_late_group() -> None:
    p = group_size(None)
    with pytest.raises(ValueError, match=f"tp_size={2 * p} disagrees with tp_group, which has {p} ranks"):
        te.Linear(32, 16, parallel_mode="column", tp_group=dist.group.WORLD, tp_size=2 * p)
    implied = te.Linear(32, 16, parallel_mode="column", tp_group=dist.group.WORLD)
    assert implied.tp_size == p and implied.weight.shape[0] == 16 // p
    late = te.Linear(32, 16, parallel_mode="row", tp_size=p, sequence_parallel=True, device=device())
    solo, _ = dist.new_subgroups(group_size=1)  # one group per rank
    with pytest.raises(ValueError, match=f"the group has 1 ranks but the module was built with tp_size={p}"):
        late.set_tensor_parallel_group(solo)
    late.set_tensor_parallel_group(dist.group.WORLD)
    x = torch.randn(8, 2, 32 // p, device=device())
    assert tuple(late(x).shape) == (8 // p, 2, 16)


def test_group_size_rules_and_a_group_set_later(ranks2):
    ranks2.run(check_group_checks_and_late_group)


@pytest.mark.parametrize("name", ["comm", "tensor_parallel", "linear_comm"])
def test_docstring_examples(name):
    import doctest
    import importlib

    module = importlib.import_module(f"transformer_engine.pytorch.parallel.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
