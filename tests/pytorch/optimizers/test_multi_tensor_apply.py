"""multi_tensor_applier with the catalog's scale / l2norm ops, against torch (and Megatron's call forms)."""

import pytest
import torch

from transformer_engine.pytorch.optimizers import MultiTensorApply, multi_tensor_applier, multi_tensor_l2norm, multi_tensor_scale

SHAPES = [(1,), (7, 13), (127,), (3, 5, 2)]


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _tensors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scale_matches_torch(out_dtype):
    src = _tensors()
    dst = [torch.empty_like(t, dtype=out_dtype) for t in src]
    flag = _flag()
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.37)
    for s, d in zip(src, dst):
        torch.testing.assert_close(d, (s * 0.37).to(out_dtype), rtol=0, atol=0)  # one multiply, one rounding
    assert flag.item() == 0


def test_scale_in_place_like_megatron_clip_grads():
    grads = _tensors()
    expected = [g * 0.5 for g in grads]
    multi_tensor_applier(multi_tensor_scale, _flag(), [grads, grads], 0.5)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_scale_flags_non_finite_input():
    src = _tensors()
    src[1][0, 0] = float("nan")
    flag = _flag()
    multi_tensor_applier(multi_tensor_scale, flag, [src, [torch.empty_like(t) for t in src]], 1.0)
    assert flag.item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_matches_torch(dtype):
    tensors = _tensors(dtype)
    total, per = multi_tensor_applier(multi_tensor_l2norm, _flag(), [tensors], per_tensor=True)
    expected_per = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    # float32 accumulation of at most a few hundred squares: relative error well under 1e-5
    torch.testing.assert_close(per, expected_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total, torch.linalg.vector_norm(expected_per).reshape(1), rtol=1e-5, atol=0)


def test_l2norm_megatron_form_and_non_finite_flag():
    tensors = _tensors()
    norm, _ = multi_tensor_applier(multi_tensor_l2norm, _flag(), [tensors], per_tensor=False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    tensors[0][0] = float("inf")
    flag = _flag()
    multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], per_tensor=False)
    assert flag.item() == 1


def test_empty_slots_are_dropped_without_touching_the_callers_lists():
    seen = []

    def op(chunk_size, noop_flag, tensor_lists, *args, **kwargs):
        seen.append((chunk_size, [len(lst) for lst in tensor_lists], args, kwargs))
        return "ran"

    apply = MultiTensorApply(1024)
    lists = [[torch.ones(2), torch.empty(0), torch.ones(3)], [torch.ones(2), torch.empty(0), torch.ones(3)]]
    assert apply(op, _flag(), lists, 2.0, scale=3.0) == "ran"
    assert seen == [(1024, [2, 2], (2.0,), {"scale": 3.0})]
    assert len(lists[0]) == 3
    assert apply(op, _flag(), [[torch.empty(0)], [torch.empty(0)]]) is None
    assert multi_tensor_applier.chunk_size == 2048 * 32


def test_misaligned_lists_raise():
    with pytest.raises(RuntimeError, match="aligned"):
        multi_tensor_applier(multi_tensor_scale, _flag(), [[torch.ones(2)], []], 1.0)


@pytest.mark.parametrize("module", ["multi_tensor_apply", "fused_adam", "fused_sgd"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"transformer_engine.pytorch.optimizers.{module}"))
    assert result.attempted > 0 and result.failed == 0
