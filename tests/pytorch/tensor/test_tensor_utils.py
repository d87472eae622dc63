"""transformer_engine.pytorch.tensor.utils: replace_raw_data and cast_master_weights_to_fp8 (Megatron-Core's
distributed optimizer with FP8 weights), one process and two gloo ranks."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import close_pools, get_pool
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from transformer_engine.pytorch.tensor import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer
from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8, replace_raw_data


@pytest.fixture(scope="module")
def ranks2():
    yield get_pool(2, "gloo")
    close_pools()


def _weight(recipe, seed=0):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe):
        return te.Linear(64, 32, params_dtype=torch.bfloat16).weight


def _master(seed=1):
    return torch.randn(32 * 64, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("quantizer", [Float8CurrentScalingQuantizer(DType.kFloat8E4M3, columnwise=False),
                                       Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)], ids=["fp8", "block"])
def test_replace_raw_data_moves_the_bytes_and_keeps_everything_else(quantizer):
    x = quantizer(torch.randn(128, 128, dtype=torch.bfloat16))
    key = "_data" if hasattr(x, "_data") else "_rowwise_data"
    old, values = getattr(x, key), x.dequantize()
    kept = {name: getattr(x, name) for name in ("_quantizer", "_fp8_dtype")}
    flat = torch.zeros(2 * old.numel(), dtype=torch.uint8)
    new = flat[old.numel():].view(old.shape)
    replace_raw_data(x, new)
    assert getattr(x, key).data_ptr() == new.data_ptr() and torch.equal(getattr(x, key), old)
    assert torch.equal(x.dequantize(), values) and all(getattr(x, k) is v for k, v in kept.items())
    with pytest.raises(ValueError, match="uint8"):
        replace_raw_data(x, torch.zeros(old.shape, dtype=torch.int8))
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        replace_raw_data(MXFP8Quantizer(DType.kFloat8E4M3)(torch.randn(32, 32)), torch.zeros(32, 32, dtype=torch.uint8))


def test_transpose_invalid_is_teS_flag_for_a_missing_transpose():
    x = Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(torch.randn(16, 32))
    assert x._transpose is not None and not x._transpose_invalid
    x._transpose_invalid = True
    assert x._transpose is None and x._transpose_invalid
    with pytest.raises(ValueError, match="no transposed copy"):
        x._transpose_invalid = False


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_one_process_writes_each_shard_as_the_whole_weights_cast(recipe):
    """Without a process group: two shards written in two calls give the whole weight's cast (current scaling:
    its scale from the amax of the shard each call sees, so one call with the whole master)."""
    weight, master = _weight(recipe), _master()
    weight.get_high_precision_init_val = lambda: None  # NVIDIA TE clears the kept initial values here
    weight.clear_high_precision_init_val = lambda: setattr(weight, "cleared", True)
    cast_master_weights_to_fp8([weight], [master], [0], None)
    expected = weight._get_quantizer().quantize_impl(master.to(torch.bfloat16).view(32, 64))
    assert torch.equal(weight._data, expected._data) and torch.equal(weight._scale_inv, expected._scale_inv)
    assert weight.cleared


def test_checks_before_any_write():
    weight = _weight(DelayedScaling())
    with pytest.raises(ValueError, match="one entry per weight"):
        cast_master_weights_to_fp8([weight], [], [], None)
    with pytest.raises(ValueError, match="does not fit"):
        cast_master_weights_to_fp8([weight], [_master()[:100]], [2000], None)
    with pytest.raises(NotImplementedError, match="1 x 128 tiles"):
        one_d = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)(torch.randn(32, 64))
        cast_master_weights_to_fp8([weight, one_d], [_master(), None], [0, None], None)
    assert not torch.equal(weight._data.view(-1), weight._get_quantizer().quantize_impl(_master().view(32, 64))._data.view(-1))
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        cast_master_weights_to_fp8([MXFP8Quantizer(DType.kFloat8E4M3)(torch.randn(32, 64))], [None], [None], None)


def _block_weight(seed=0):
    # 160 x 300: ragged 128 x 128 tiles in both dimensions
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=Float8BlockScaling()):
        return te.Linear(300, 160, params_dtype=torch.bfloat16).weight


def _block_master(seed=1):
    return torch.randn(160 * 300, generator=torch.Generator().manual_seed(seed)) * 0.05


def _block_cast(master):
    quantizer = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)
    return quantizer(master.to(torch.bfloat16).view(160, 300))


def test_one_process_block_scaled_weight_is_the_whole_masters_block_cast():
    weight, master = _block_weight(), _block_master()
    weight.update_usage(columnwise_usage=True)  # a column-wise copy would be stale: it is dropped
    cast_master_weights_to_fp8([weight], [master], [0], None)
    expected = _block_cast(master)
    assert torch.equal(weight._rowwise_data, expected._rowwise_data)
    assert torch.equal(weight._rowwise_scale_inv, expected._rowwise_scale_inv)
    assert weight._columnwise_data is None
    assert torch.equal(weight.dequantize(), expected.dequantize())


def check_sharded_block_master(cuts):
    """On each rank: the same block-scaled weight, this rank's range of the master (the ranges cut across tiles)."""
    import torch.distributed as dist

    rank, weight, master = dist.get_rank(), _block_weight(), _block_master()
    start, end = cuts[rank], cuts[rank + 1]
    cast_master_weights_to_fp8([weight], [master[start:end] if end > start else None], [start], None)
    return weight._rowwise_data.view(-1)[start:end].clone(), weight._rowwise_scale_inv.clone()


@pytest.mark.parametrize("cuts", [(0, 20000, 48000), (0, 0, 48000), (0, 301, 48000)], ids=["across_tiles", "one_rank_none", "one_row"])
def test_two_ranks_write_their_block_ranges_with_the_whole_weights_tile_scales(ranks2, cuts):
    """Each rank's range of the bytes is that range of the one-process block cast of the whole master, and both
    ranks hold every tile's scale_inv (the tile amaxes MAX-reduced over the ranks)."""
    results = ranks2.run(check_sharded_block_master, cuts)
    expected = _block_cast(_block_master())
    for rank, (raw, scale_inv) in enumerate(results):
        assert torch.equal(raw, expected._rowwise_data.view(-1)[cuts[rank]:cuts[rank + 1]]), rank
        assert torch.equal(scale_inv, expected._rowwise_scale_inv), rank


def check_sharded_masters(recipe_name):
    """On each of two ranks: the same FP8 weight (same seed), this rank's half of the master."""
    import torch.distributed as dist

    recipe = DelayedScaling() if recipe_name == "delayed" else Float8CurrentScaling()
    rank, weight, master = dist.get_rank(), _weight(recipe), _master()
    half = master.numel() // 2
    start = rank * half
    cast_master_weights_to_fp8([weight], [master[start:start + half]], [start], None)
    amax = weight._get_quantizer().amax.clone() if recipe_name == "delayed" else None
    return weight._data.view(-1)[start:start + half].clone(), weight._scale_inv.clone(), amax


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_two_ranks_write_their_halves_with_the_whole_weights_scaling(ranks2, recipe_name):
    """Each rank's half of the bytes is that half of the one-process cast of the whole master: current scaling
    with the scale of the whole weight's amax (reduced over the ranks); delayed scaling with the weight's scale,
    the amax slot then holding the whole weight's amax on both ranks."""
    results = ranks2.run(check_sharded_masters, recipe_name)
    recipe = DelayedScaling() if recipe_name == "delayed" else Float8CurrentScaling()
    weight, master = _weight(recipe), _master()
    slot_before = weight._get_quantizer().amax.item() if recipe_name == "delayed" else None  # the initial weight's amax
    expected = weight._get_quantizer().quantize_impl(master.to(torch.bfloat16).view(32, 64))
    half = master.numel() // 2
    for rank, (raw, scale_inv, amax) in enumerate(results):
        assert torch.equal(raw, expected._data.view(-1)[rank * half:(rank + 1) * half]), rank
        assert torch.equal(scale_inv, expected._scale_inv), rank
        if recipe_name == "delayed":
            assert amax.item() == max(slot_before, master.to(torch.bfloat16).abs().max().item()), rank

