"""transformer_engine.pytorch.permutation against compositions written here with loops over experts.

The oracle lists the routed slots (t, w) in the order the API promises (expert, then token, then top-k
position), keeps the first num_out_tokens, and builds permute / unpermute from plain indexing and
``index_add`` in float64, so autograd gives the reference gradients. Permutes move values, so they must
match exactly; sums over a token's copies are accumulated in float32 and rounded once to the dtype, so
they are compared with ``dtype_tols(dtype)`` (a few ulps of that dtype).
"""

import warnings

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.pytorch.permutation import (
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from transformer_engine.pytorch.tensor import DType, Float8CurrentScalingQuantizer, Float8Tensor

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 4, 8), (7, 5, 16), (33, 8, 24)]  # (num_tokens, num_experts, hidden)
EXACT = dict(rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Routing inputs and the oracle
# ----------------------------------------------------------------------------------------------


def skewed_indices(num_tokens, num_experts, topk, seed=0):
    """[T, topk] distinct experts per token, drawn with weights 1, 2, ..., E-1, 0: uneven loads, and
    the last expert never chosen (an expert with no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1.0, num_experts + 1.0)
    weights[-1] = 0.0
    return torch.stack([torch.multinomial(weights, topk, replacement=False, generator=gen)
                        for _ in range(num_tokens)])


def mask_from_indices(indices, num_experts):
    mask = torch.zeros(indices.shape[0], num_experts, dtype=torch.bool)
    return mask.scatter_(1, indices, value=True)


def ref_slots_mask(routing_map):
    """Routed (t, e) slots, expert-major, tokens in order within an expert."""
    return [(t, e) for e in range(routing_map.shape[1]) for t in range(routing_map.shape[0]) if routing_map[t, e]]


def ref_slots_index(indices, num_experts):
    """Routed (t, k) slots grouped by expert id indices[t, k], then by t, then by k."""
    return [(t, k) for e in range(num_experts) for t in range(indices.shape[0])
            for k in range(indices.shape[1]) if indices[t, k] == e]


def ref_permute(x, slots, num_out, probs=None):
    """y[j] = x[t_j] for the first num_out slots, zero rows after; py[j] = probs[slot_j] and y[j] = 0 where it is 0."""
    kept = slots[:num_out]
    rows = [x[t] for t, _ in kept] + [x.new_zeros(x.shape[1])] * (num_out - len(kept))
    y = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
    if probs is None:
        return y, None
    py = torch.stack([probs[t, w] for t, w in kept] + [probs.new_zeros(())] * (num_out - len(kept)))
    return torch.where((py != 0)[:, None], y, 0), py


def ref_unpermute(y, slots, num_tokens, probs=None):
    """z[t] = sum_j p[slot_j] * y[j] over the kept slots."""
    kept = slots[: y.shape[0]]
    z = y.new_zeros(num_tokens, y.shape[1])
    for j, (t, w) in enumerate(kept):
        weight = 1.0 if probs is None else probs[t, w]
        z = z.index_add(0, torch.tensor([t]), (y[j] * weight)[None])
    return z


def leaf(*shape, dtype=torch.float32, positive=False):
    t = torch.rand(*shape) + 0.1 if positive else randn(*shape)
    return t.to(dtype).requires_grad_(requires_grad=True)


def grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, allow_unused=True)


def num_out_cases(total):
    """No drop, a drop, and padding rows past the routed count."""
    return [total, max(total - 3, 1), total + 2]


# ----------------------------------------------------------------------------------------------
# Permute
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("topk", [1, 2, 3, 4])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["all", "drop", "pad"])
def test_permute_mask_matches_reference(dtype, shape, topk, case):
    num_tokens, num_experts, hidden = shape
    routing_map = mask_from_indices(skewed_indices(num_tokens, num_experts, min(topk, num_experts - 1)), num_experts)
    slots = ref_slots_mask(routing_map)
    num_out = num_out_cases(len(slots))[case]
    x = leaf(num_tokens, hidden, dtype=dtype)

    y, row_id_map = moe_permute(x, routing_map, num_out_tokens=num_out)
    y_ref, _ = ref_permute(x.detach().double(), slots, num_out)
    assert y.dtype == dtype and y.shape == (num_out, hidden)
    torch.testing.assert_close(y.double(), y_ref, **EXACT)
    assert row_id_map.shape == routing_map.shape and row_id_map.dtype == torch.int32
    expected_map = torch.full(routing_map.shape, -1, dtype=torch.int32)
    for j, (t, e) in enumerate(slots[:num_out]):
        expected_map[t, e] = j
    assert torch.equal(row_id_map, expected_map)

    dy = randn(num_out, hidden, dtype=dtype)
    (dx,) = grads(y, x, dy)
    x64 = x.detach().double().requires_grad_(requires_grad=True)
    (dx_ref,) = grads(ref_permute(x64, slots, num_out)[0], x64, dy.double())
    torch.testing.assert_close(dx.double(), dx_ref, **dtype_tols(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("topk", [1, 2, 3, 4])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["all", "drop", "pad"])
def test_permute_index_matches_reference(dtype, shape, topk, case):
    num_tokens, num_experts, hidden = shape
    indices = skewed_indices(num_tokens, num_experts, min(topk, num_experts - 1), seed=1).to(torch.int32)
    slots = ref_slots_index(indices, num_experts)
    num_out = num_out_cases(len(slots))[case]
    x = leaf(num_tokens, hidden, dtype=dtype)

    y, row_id_map = moe_permute(x, indices, num_out_tokens=num_out, map_type="index")
    torch.testing.assert_close(y.double(), ref_permute(x.detach().double(), slots, num_out)[0], **EXACT)
    assert row_id_map.shape == indices.shape

    dy = randn(num_out, hidden, dtype=dtype)
    (dx,) = grads(y, x, dy)
    x64 = x.detach().double().requires_grad_(requires_grad=True)
    (dx_ref,) = grads(ref_permute(x64, slots, num_out)[0], x64, dy.double())
    torch.testing.assert_close(dx.double(), dx_ref, **dtype_tols(dtype))


@pytest.mark.parametrize("num_out", [-1, 0])
def test_index_map_default_num_out_keeps_every_slot(num_out):
    indices = skewed_indices(9, 6, 3)
    x = randn(9, 8)
    y, _ = moe_permute(x, indices, num_out, map_type="index")
    torch.testing.assert_close(y, ref_permute(x, ref_slots_index(indices, 6), 27)[0], **EXACT)


def test_mask_map_default_num_out_counts_routed_slots():
    routing_map = mask_from_indices(skewed_indices(9, 6, 2), 6)
    x = randn(9, 8)
    y, _ = moe_permute(x, routing_map)
    assert y.shape == (18, 8)
    y_t, _ = moe_permute(x, routing_map.to(torch.int32), num_out_tokens=torch.tensor(18))  # Megatron passes a tensor
    torch.testing.assert_close(y_t, y, **EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", [0, 1, 2], ids=["all", "drop", "pad"])
def test_permute_with_probs_matches_reference(dtype, shape, case):
    num_tokens, num_experts, hidden = shape
    routing_map = mask_from_indices(skewed_indices(num_tokens, num_experts, 2, seed=2), num_experts)
    slots = ref_slots_mask(routing_map)
    num_out = num_out_cases(len(slots))[case]
    probs = (torch.rand(num_tokens, num_experts) * routing_map).to(dtype)
    probs[0, routing_map[0].nonzero()[0, 0]] = 0.0  # a padding slot: routed with prob 0
    probs.requires_grad_(requires_grad=True)
    x = leaf(num_tokens, hidden, dtype=dtype)

    y, py, row_id_map = moe_permute_with_probs(x, probs, routing_map, num_out)
    y_ref, py_ref = ref_permute(x.detach(), slots, num_out, probs.detach())
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(py, py_ref, **EXACT)
    assert py.dtype == dtype

    dy, dpy = randn(num_out, hidden, dtype=dtype), randn(num_out, dtype=dtype)
    dx, dprobs = grads((y, py), (x, probs), (dy, dpy))
    x64, p64 = (t.detach().double().requires_grad_(requires_grad=True) for t in (x, probs))
    dx_ref, dp_ref = grads(ref_permute(x64, slots, num_out, p64), (x64, p64), (dy.double(), dpy.double()))
    torch.testing.assert_close(dx.double(), dx_ref, **dtype_tols(dtype))
    torch.testing.assert_close(dprobs.double(), dp_ref, **EXACT)


# ----------------------------------------------------------------------------------------------
# Unpermute
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["sum", "merging_probs"])
@pytest.mark.parametrize("drop", [False, True], ids=["all", "drop"])
def test_unpermute_matches_reference(dtype, shape, topk, map_type, with_probs, drop):
    num_tokens, num_experts, hidden = shape
    indices = skewed_indices(num_tokens, num_experts, min(topk, num_experts - 1), seed=3)
    if map_type == "mask":
        routing_map = mask_from_indices(indices, num_experts)
        slots = ref_slots_mask(routing_map)
    else:
        routing_map = indices
        slots = ref_slots_index(indices, num_experts)
    num_out = max(len(slots) - 3, 1) if drop else len(slots)
    _, row_id_map = moe_permute(randn(num_tokens, hidden), routing_map, num_out, map_type=map_type)
    y = leaf(num_out, hidden, dtype=dtype)
    probs = leaf(*routing_map.shape, dtype=dtype, positive=True) if with_probs else None

    z = moe_unpermute(y, row_id_map, probs, restore_shape=(num_tokens, hidden), map_type=map_type)
    p64 = probs.detach().double().requires_grad_(requires_grad=True) if with_probs else None
    y64 = y.detach().double().requires_grad_(requires_grad=True)
    z_ref = ref_unpermute(y64, slots, num_tokens, p64)
    assert z.dtype == dtype and z.shape == (num_tokens, hidden)
    torch.testing.assert_close(z.double(), z_ref, **dtype_tols(dtype))

    dz = randn(num_tokens, hidden, dtype=dtype)
    inputs, inputs64 = ((y, probs), (y64, p64)) if with_probs else ((y,), (y64,))
    got, want = grads(z, inputs, dz), grads(z_ref, inputs64, dz.double())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **dtype_tols(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1, 2, 3, 4])
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_round_trip_restores_tokens_times_probs(dtype, topk, map_type):
    num_tokens, num_experts, hidden = 17, 6, 12
    indices = skewed_indices(num_tokens, num_experts, topk, seed=4)
    routing_map = mask_from_indices(indices, num_experts) if map_type == "mask" else indices
    probs = torch.rand(*routing_map.shape) * (routing_map if map_type == "mask" else 1)
    x = randn(num_tokens, hidden, dtype=dtype)

    y, row_id_map = moe_permute(x, routing_map, num_tokens * topk, map_type=map_type)
    summed = moe_unpermute(y, row_id_map, map_type=map_type)
    torch.testing.assert_close(summed, (x.float() * topk).to(dtype), **EXACT)  # topk copies added
    merged = moe_unpermute(y, row_id_map, probs, map_type=map_type)
    torch.testing.assert_close(merged, (x.float() * probs.sum(1, keepdim=True)).to(dtype), **dtype_tols(dtype))


def test_deprecated_probs_keyword():
    routing_map = mask_from_indices(skewed_indices(5, 4, 2), 4)
    y, row_id_map = moe_permute(randn(5, 8), routing_map, 10)
    probs = torch.rand(5, 4)
    with pytest.warns(DeprecationWarning, match="merging_probs"):
        old = moe_unpermute(y, row_id_map, probs=probs)
    torch.testing.assert_close(old, moe_unpermute(y, row_id_map, merging_probs=probs), **EXACT)


def test_empty_input():
    x = leaf(0, 8)
    y, row_id_map = moe_permute(x, torch.zeros(0, 4, dtype=torch.bool), 0)
    assert y.shape == (0, 8) and row_id_map.shape == (0, 4)
    z = moe_unpermute(y, row_id_map, torch.zeros(0, 4))
    assert z.shape == (0, 8)
    (dx,) = grads(z, x, torch.zeros(0, 8))
    assert dx.shape == (0, 8)


# ----------------------------------------------------------------------------------------------
# Chunk sort
# ----------------------------------------------------------------------------------------------


def ref_sort_chunks(x, split_sizes, sorted_index):
    chunks = torch.split(x, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_index.tolist()], dim=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_sizes", [[5], [3, 0, 4, 2], [1, 2, 3, 4, 5, 6, 7], [0, 6, 0, 1]])
def test_sort_chunks_by_index_matches_reference(dtype, split_sizes):
    split_sizes = torch.tensor(split_sizes)
    sorted_index = torch.randperm(len(split_sizes), generator=torch.Generator().manual_seed(len(split_sizes)))
    num_tokens = int(split_sizes.sum())
    x, probs = leaf(num_tokens, 8, dtype=dtype), leaf(num_tokens, dtype=torch.float32)

    y = moe_sort_chunks_by_index(x, split_sizes, sorted_index)
    torch.testing.assert_close(y, ref_sort_chunks(x.detach(), split_sizes, sorted_index), **EXACT)
    y2, py = moe_sort_chunks_by_index_with_probs(x, probs, split_sizes, sorted_index)
    torch.testing.assert_close(y2, y, **EXACT)
    torch.testing.assert_close(py, ref_sort_chunks(probs.detach(), split_sizes, sorted_index), **EXACT)

    dy, dpy = randn(num_tokens, 8, dtype=dtype), randn(num_tokens)
    dx, dp = grads((y2, py), (x, probs), (dy, dpy))
    dx_ref, dp_ref = grads((ref_sort_chunks(x, split_sizes, sorted_index),
                            ref_sort_chunks(probs, split_sizes, sorted_index)), (x, probs), (dy, dpy))
    torch.testing.assert_close(dx, dx_ref, **EXACT)
    torch.testing.assert_close(dp, dp_ref, **EXACT)


# ----------------------------------------------------------------------------------------------
# FP8 inputs
# ----------------------------------------------------------------------------------------------


def test_float8_tensor_rows_move_with_their_scale():
    x_hp = randn(9, 16)
    x = Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(x_hp)
    routing_map = mask_from_indices(skewed_indices(9, 5, 2), 5)
    indices = skewed_indices(9, 5, 3)
    cases = [
        (moe_permute(x, routing_map, 20)[0], moe_permute(x.dequantize(), routing_map, 20)[0]),
        (moe_permute(x, indices, map_type="index")[0], moe_permute(x.dequantize(), indices, map_type="index")[0]),
        (moe_sort_chunks_by_index(x, torch.tensor([4, 5]), torch.tensor([1, 0])),
         moe_sort_chunks_by_index(x.dequantize(), torch.tensor([4, 5]), torch.tensor([1, 0]))),
    ]
    for got, want in cases:
        assert isinstance(got, Float8Tensor) and torch.equal(got._scale_inv, x._scale_inv)
        torch.testing.assert_close(got.dequantize(), want, **EXACT)
    _, row_id_map = moe_permute(x_hp, routing_map, 18)
    with pytest.raises(TypeError, match="quantized"):
        moe_unpermute(moe_permute(x, routing_map, 18)[0], row_id_map)


# ----------------------------------------------------------------------------------------------
# Bad arguments
# ----------------------------------------------------------------------------------------------

_X, _MAP, _IDX = randn(4, 8), torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, 2, dtype=torch.int64)
_Y, _ROW_ID_MAP = moe_permute(_X, _MAP, 12)

BAD_CALLS = [
    (lambda: moe_permute(_X, _MAP, map_type="dense"), ValueError, "map_type"),
    (lambda: moe_permute(_X.numpy(), _MAP), TypeError, "torch.Tensor"),
    (lambda: moe_permute(_X[0], _MAP), ValueError, "2-D"),
    (lambda: moe_permute(_X, _MAP[:3]), ValueError, "num_tokens=4"),
    (lambda: moe_permute(_X, _MAP.float()), TypeError, "integers"),
    (lambda: moe_permute(_X, _MAP, map_type="index"), TypeError, "bool mask"),
    (lambda: moe_permute(_X, _MAP, num_out_tokens=2.5), TypeError, "num_out_tokens"),
    (lambda: moe_permute(_X, _IDX, max_token_num="8", map_type="index"), TypeError, "max_token_num"),
    (lambda: moe_permute_with_probs(_X, torch.rand(4, 2), _MAP), ValueError, "probs must have shape"),
    (lambda: moe_permute_with_probs(_X, torch.ones(4, 3, dtype=torch.int64), _MAP), TypeError, "floating"),
    (lambda: moe_permute_with_probs(_X, None, _MAP), TypeError, "probs"),
    (lambda: moe_permute(_X, _MAP.to("meta")), ValueError, "meta"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP, map_type="sparse"), ValueError, "map_type"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP.flatten()), ValueError, "2-D"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP.float()), TypeError, "integers"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP, torch.rand(4, 2)), ValueError, "merging_probs"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP, torch.rand(4, 3), probs=torch.rand(4, 3)), ValueError, "deprecated"),
    (lambda: moe_unpermute(_Y, _ROW_ID_MAP, restore_shape=(5, 8)), ValueError, "restore_shape"),
    (lambda: moe_sort_chunks_by_index(_X, torch.tensor([2, 2]), torch.tensor([0])), ValueError, "same length"),
    (lambda: moe_sort_chunks_by_index(_X, torch.tensor([2.0, 2.0]), torch.tensor([1, 0])), TypeError, "split_sizes"),
    (lambda: moe_sort_chunks_by_index_with_probs(_X, torch.rand(3), torch.tensor([2, 2]), torch.tensor([1, 0])),
     ValueError, "num_tokens=4"),
]


@pytest.mark.parametrize("call, error, match", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_bad_arguments_raise(call, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=match):
            call()


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def _mask_call(x, probs, routing_map, indices, split_sizes, sorted_index):
    y, py, row_id_map = moe_permute_with_probs(x, probs, routing_map, 20)
    return moe_unpermute(y * py[:, None].to(y.dtype), row_id_map, probs), py


def _index_call(x, probs, routing_map, indices, split_sizes, sorted_index):
    y, row_id_map = moe_permute(x, indices, 25, map_type="index")
    return (moe_unpermute(y, row_id_map, probs[:, :3], map_type="index"),)


def _chunk_call(x, probs, routing_map, indices, split_sizes, sorted_index):
    y, py = moe_sort_chunks_by_index_with_probs(x, probs[:, 0], split_sizes, sorted_index)
    return y, py, moe_sort_chunks_by_index(x, split_sizes, sorted_index)


@pytest.mark.parametrize("fn", [_mask_call, _index_call, _chunk_call], ids=["mask", "index", "chunks"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_without_graph_breaks_and_matches_eager(fn, dtype, fresh_dynamo):
    num_tokens, num_experts = 9, 6
    x, probs = leaf(num_tokens, 16, dtype=dtype), leaf(num_tokens, num_experts, dtype=dtype, positive=True)
    routing_map = mask_from_indices(skewed_indices(num_tokens, num_experts, 2), num_experts)
    args = (x, probs, routing_map, skewed_indices(num_tokens, num_experts, 3),
            torch.tensor([2, 0, 4, 3]), torch.tensor([3, 1, 0, 2]))
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    eager_out = fn(*args)
    compiled_out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    for eager, comp in zip(eager_out, compiled_out):
        assert comp.dtype == eager.dtype
        torch.testing.assert_close(comp, eager, **dtype_tols(dtype))
    grad_out = [randn(*out.shape, dtype=out.dtype) for out in eager_out]
    eager_grads = grads(eager_out, (x, probs), grad_out)
    compiled_grads = grads(compiled_out, (x, probs), grad_out)
    for eager, comp in zip(eager_grads, compiled_grads):
        assert (eager is None) == (comp is None)
        if eager is not None:
            torch.testing.assert_close(comp, eager, **dtype_tols(dtype))


def test_mask_map_without_num_out_tokens_refuses_to_compile(fresh_dynamo):
    def fn(x, routing_map):
        return moe_permute(x, routing_map)[0]

    with pytest.raises(Exception, match="num_out_tokens > 0"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(randn(4, 8), torch.ones(4, 2, dtype=torch.bool))
