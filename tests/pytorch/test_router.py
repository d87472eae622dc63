"""transformer_engine.pytorch.router against compositions written here from the formulas.

The oracle selects experts on float32 scores (as TE's kernels do: selection must agree exactly, so it
sees the same float32 values) by ranking every expert against every other, value descending and index
ascending on ties, and computes the probabilities and their gradients in float64 with masks instead of
gathers. Results in dtype d are compared with ``dtype_tols(d)``: the router computes in float32 and rounds
once to d, so its error is one rounding of d (or a few float32 ulps for float32), inside those bounds.
"""

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.pytorch.router import (
    RoutingMapFormat,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 8), (7, 16), (33, 24), (3, 5, 64)]  # [..., num_experts]; group size 2, 4, 6, 16 for 4 groups
SCORE_FUNCTIONS = ["softmax", "sigmoid", "sqrtsoftplus"]


# ----------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------


def ref_topk_mask(r: torch.Tensor, k: int) -> torch.Tensor:
    """True for the k best entries along the last axis: rank_i = #{j: r_j > r_i or (r_j == r_i, j < i)}."""
    index = torch.arange(r.shape[-1])
    beats = (r.unsqueeze(-2) > r.unsqueeze(-1)) | ((r.unsqueeze(-2) == r.unsqueeze(-1)) & (index < index[:, None]))
    return beats.sum(-1) < k


def ref_group_limited_mask(r, topk, num_groups, group_topk):
    """Keep the group_topk groups with the largest sum of their top (topk / group_topk), then the top k."""
    grouped = r.unflatten(-1, (num_groups, -1))
    group_scores = torch.where(ref_topk_mask(grouped, topk // group_topk), grouped, 0.0).sum(-1)
    kept_experts = ref_topk_mask(group_scores, group_topk).repeat_interleave(grouped.shape[-1], dim=-1)
    return ref_topk_mask(r.masked_fill(~kept_experts, float("-inf")), topk)


def ref_score(x, score_function):
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    if score_function == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    return torch.sqrt(torch.where(x > 20, x, torch.log1p(torch.exp(x))))


def ref_topk_router(x32, x64, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, bias):
    """(probs in float64 as a function of x64, routing mask chosen on float32 scores)."""
    if score_function == "softmax" and not use_pre_softmax:
        routing_scores = x32
    else:
        routing_scores = torch.sigmoid(x32) if score_function == "sigmoid" else ref_score(x32, score_function)
        if bias is not None:
            routing_scores = routing_scores + bias
    if group_topk:
        mask = ref_group_limited_mask(routing_scores, topk, num_groups, group_topk)
    else:
        mask = ref_topk_mask(routing_scores, topk)
    if score_function == "softmax" and not use_pre_softmax:
        probs = torch.where(mask, x64, float("-inf")).softmax(-1)
    else:
        probs = torch.where(mask, ref_score(x64, score_function), 0.0)
        if score_function != "softmax" and topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, mask


def ref_aux_scores(x64, score_function):
    scores = ref_score(x64, score_function)
    return scores if score_function == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)


def _leaf(shape, dtype, scale=2.0):
    return randn(*shape, dtype=dtype, scale=scale).requires_grad_()


def _grads(out, inp, grad_out):
    return torch.autograd.grad(out, inp, grad_outputs=grad_out)[0]


# ----------------------------------------------------------------------------------------------
# fused_topk_with_score_function
# ----------------------------------------------------------------------------------------------


ROUTER_CASES = [
    # (score_function, topk, use_pre_softmax, grouped, with_bias)
    *[("softmax", k, pre, g, False) for k in (1, 4) for pre in (False, True) for g in (False, True)],
    *[
        (f, k, False, g, b)
        for f in ("sigmoid", "sqrtsoftplus") for k in (1, 4) for g in (False, True) for b in (False, True)
    ],
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.parametrize("scaling_factor", [None, 2.5])
def test_topk_with_score_function_matches_reference(dtype, shape, case, scaling_factor):
    score_function, topk, use_pre_softmax, grouped, with_bias = case
    num_experts = shape[-1]
    num_groups, group_topk = (4, min(2, topk)) if grouped else (None, None)
    logits = _leaf(shape, dtype)
    bias = randn(num_experts, scale=0.3) if with_bias else None
    kwargs = dict(
        topk=topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function,
    )

    probs, routing_map = fused_topk_with_score_function(logits=logits, expert_bias=bias, **kwargs)
    x64 = logits.detach().double().requires_grad_()
    ref_probs, ref_mask = ref_topk_router(x32=logits.detach().float(), x64=x64, bias=bias, **kwargs)

    assert probs.dtype == dtype and probs.shape == logits.shape
    assert routing_map.dtype == torch.bool and torch.equal(routing_map, ref_mask)
    assert torch.all(routing_map.sum(-1) == topk)
    assert torch.all(probs[~routing_map] == 0)
    torch.testing.assert_close(probs, ref_probs.to(dtype), **dtype_tols(dtype))

    grad_out = randn(*shape, dtype=dtype)
    grad = _grads(probs, logits, grad_out)
    ref_grad = _grads(ref_probs, x64, grad_out.double())
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad.to(dtype), **dtype_tols(dtype))


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_ties_go_to_the_lower_expert_index(score_function):
    logits = torch.zeros(3, 16)
    for use_pre_softmax in (False, True):
        for num_groups, group_topk in ((None, None), (4, 2)):
            probs, routing_map = fused_topk_with_score_function(
                logits=logits, topk=4, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                group_topk=group_topk, scaling_factor=None, score_function=score_function, expert_bias=None,
            )
            # grouped: groups 0 and 1 win the group tie, and experts 0..3 the tie among experts 0..7
            assert routing_map[:, :4].all() and not routing_map[:, 4:].any()
            expected = 1 / 16 if score_function == "softmax" and use_pre_softmax else 1 / 4
            torch.testing.assert_close(probs[:, :4], torch.full((3, 4), expected))


@pytest.mark.parametrize("score_function", ["sigmoid", "sqrtsoftplus"])
def test_expert_bias_steers_selection_only_and_gets_no_gradient(score_function):
    logits = _leaf((5, 8), torch.float32, scale=0.1)
    bias = torch.zeros(8)
    bias[-2:] = 100.0
    bias.requires_grad_()
    probs, routing_map = fused_topk_with_score_function(
        logits=logits, topk=2, use_pre_softmax=False, num_groups=None, group_topk=None,
        scaling_factor=None, score_function=score_function, expert_bias=bias,
    )
    assert routing_map[:, -2:].all() and routing_map.sum() == 10
    scores = ref_score(logits.detach(), score_function)[:, -2:]
    torch.testing.assert_close(probs[:, -2:], scores / scores.sum(-1, keepdim=True))
    probs.sum().backward()
    assert bias.grad is None and logits.grad is not None


def test_bitmap_and_dense_index_outputs():
    logits = randn(6, 2, 20)
    common = dict(topk=3, use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None,
                  score_function="softmax", expert_bias=None)
    probs, routing_map = fused_topk_with_score_function(logits=logits, **common)
    for fmt in ("bitmap_u8", RoutingMapFormat.BITMAP_U8, 1):
        bitmap = fused_topk_with_score_function(logits=logits, routing_map_format=fmt, **common)[1]
        assert bitmap.dtype == torch.uint8 and bitmap.shape == (6, 2, 3)
        bits = torch.stack([(bitmap[..., e // 8] >> (e % 8)) & 1 for e in range(20)], dim=-1)
        assert torch.equal(bits.bool(), routing_map)

    buffer = torch.empty(6, 2, 3, dtype=torch.int16)
    probs_idx, indices = fused_topk_with_score_function(logits=logits, topk_indices=buffer, **common)
    assert indices is buffer and torch.equal(probs_idx, probs)
    assert torch.equal(torch.zeros_like(routing_map).scatter(-1, indices.long(), value=True), routing_map)
    chosen = probs.gather(-1, indices.long())
    assert torch.all(chosen[..., :-1] >= chosen[..., 1:])  # descending routing score


def test_routing_map_format_for_aux_loss_scores():
    logits = randn(4, 13)
    routing_map, _ = fused_compute_score_for_moe_aux_loss(logits=logits, topk=5, score_function="sigmoid")
    bitmap, _ = fused_compute_score_for_moe_aux_loss(
        logits=logits, topk=5, score_function="sigmoid", routing_map_format="bitmap_u8"
    )
    bits = torch.stack([(bitmap[..., e // 8] >> (e % 8)) & 1 for e in range(13)], dim=-1)
    assert bitmap.shape == (4, 2) and torch.equal(bits.bool(), routing_map)


# ----------------------------------------------------------------------------------------------
# fused_compute_score_for_moe_aux_loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("topk", [1, 4])
def test_scores_for_aux_loss_match_reference(dtype, shape, score_function, topk):
    logits = _leaf(shape, dtype)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits=logits, topk=topk, score_function=score_function)
    x64 = logits.detach().double().requires_grad_()
    ref_scores = ref_aux_scores(x64, score_function)
    x32 = logits.detach().float()
    scores32 = torch.softmax(x32, -1) if score_function == "softmax" else None
    if scores32 is None:
        s = torch.sigmoid(x32) if score_function == "sigmoid" else ref_score(x32, score_function)
        scores32 = s / (s.sum(-1, keepdim=True) + 1e-20)

    assert scores.dtype == torch.float32 and routing_map.dtype == torch.bool
    assert torch.equal(routing_map, ref_topk_mask(scores32, topk))
    # scores stay float32 whatever the logits' dtype: float32 tolerances
    torch.testing.assert_close(scores, ref_scores.float(), **dtype_tols(torch.float32))

    grad_out = randn(*shape)
    grad = _grads(scores, logits, grad_out)
    ref_grad = _grads(ref_scores, x64, grad_out.double())
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad.to(dtype), **dtype_tols(dtype))


# ----------------------------------------------------------------------------------------------
# fused_moe_aux_loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,expert_multiplier", [(1, 8, 1), (37, 16, 2), (129, 64, 1)])
@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64, torch.float32])
def test_moe_aux_loss_matches_reference(dtype, num_tokens, num_experts, expert_multiplier, counts_dtype):
    num_cols = num_experts * expert_multiplier
    probs = torch.rand(num_tokens, num_cols).to(dtype).requires_grad_()
    tokens_per_expert = torch.randint(1, 1000, (num_cols,)).to(counts_dtype)
    topk, coeff, total = 4, 1e-2, 3 * num_tokens
    loss = fused_moe_aux_loss(probs=probs, tokens_per_expert=tokens_per_expert, total_num_tokens=total,
                              num_experts=num_experts, topk=topk, coeff=coeff)
    p64 = probs.detach().double().requires_grad_()
    ref = (p64 * tokens_per_expert.double()).sum() * num_experts * coeff / (topk * total * total)

    assert loss.dtype == dtype and loss.shape == ()
    torch.testing.assert_close(loss, ref.to(dtype), **dtype_tols(dtype))
    grad_out = randn(1, dtype=dtype).reshape(())
    torch.testing.assert_close(_grads(loss, probs, grad_out), _grads(ref, p64, grad_out.double()).to(dtype),
                               **dtype_tols(dtype))

    loss_tensor_count = fused_moe_aux_loss(
        probs=probs, tokens_per_expert=tokens_per_expert, total_num_tokens=torch.tensor(total),
        num_experts=num_experts, topk=topk, coeff=coeff,
    )
    torch.testing.assert_close(loss_tensor_count, loss, **dtype_tols(dtype))


def test_moe_aux_loss_gives_no_gradient_to_token_counts():
    probs = torch.rand(5, 8, requires_grad=True)
    counts = torch.rand(8, requires_grad=True)
    fused_moe_aux_loss(probs=probs, tokens_per_expert=counts, total_num_tokens=5, num_experts=8, topk=2,
                       coeff=0.1).backward()
    assert counts.grad is None
    torch.testing.assert_close(probs.grad, (0.1 * 8 / (2 * 25) * counts.detach()).expand(5, 8))


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------

_TOPK_DEFAULTS = dict(topk=2, use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None,
                      score_function="sigmoid", expert_bias=None)


@pytest.mark.parametrize(
    "overrides,logits_shape,message",
    [
        (dict(topk=9), (4, 8), r"topk=9 must be in \[1, num_experts=8\]"),
        (dict(topk=0), (4, 8), r"topk=0"),
        (dict(score_function="relu"), (4, 8), r"score_function='relu' is unknown"),
        (dict(num_groups=3, group_topk=1), (4, 8), r"num_groups=3 must divide num_experts=8"),
        (dict(num_groups=None, group_topk=2), (4, 8), r"num_groups=None must be a positive integer"),
        (dict(num_groups=4, group_topk=5, topk=5), (4, 8), r"group_topk=5 must be <= num_groups=4"),
        (dict(num_groups=4, group_topk=2, topk=3), (4, 8), r"topk=3 must be divisible by group_topk=2"),
        (dict(num_groups=4, group_topk=1, topk=4), (4, 8), r"4 experts per group exceeds the group size"),
        (dict(group_topk=-1), (4, 8), r"group_topk=-1"),
        (dict(score_function="softmax", expert_bias=torch.zeros(8)), (4, 8), r"expert_bias is only supported"),
        (dict(expert_bias=torch.zeros(8, dtype=torch.bfloat16)), (4, 8), r"float32 tensor of shape \(8,\)"),
        (dict(expert_bias=torch.zeros(7)), (4, 8), r"expert_bias must be a float32"),
        (dict(routing_map_format="bitmap"), (4, 8), r"routing_map_format='bitmap' is unknown"),
        (dict(routing_map_format=2), (4, 8), r"routing_map_format=2"),
        (dict(topk_indices=torch.empty(4, 3, dtype=torch.int32)), (4, 8), r"topk_indices must be .* shape \(4, 2\)"),
        (dict(topk_indices=torch.empty(4, 2, dtype=torch.float32)), (4, 8), r"topk_indices must be"),
        (
            dict(topk_indices=torch.empty(4, 2, dtype=torch.int64), routing_map_format="bitmap_u8"),
            (4, 8),
            r"leave routing_map_format",
        ),
        (dict(), (4, 0), r"num_experts >= 1"),
    ],
)
def test_topk_with_score_function_rejects_bad_arguments(overrides, logits_shape, message):
    with pytest.raises(ValueError, match=message):
        fused_topk_with_score_function(logits=torch.zeros(logits_shape), **{**_TOPK_DEFAULTS, **overrides})


def test_float64_logits_are_rejected():
    with pytest.raises(ValueError, match="float64 is not supported"):
        fused_topk_with_score_function(logits=torch.zeros(2, 8, dtype=torch.float64), **_TOPK_DEFAULTS)
    with pytest.raises(ValueError, match="float64 is not supported"):
        fused_compute_score_for_moe_aux_loss(
            logits=torch.zeros(2, 8, dtype=torch.float64), topk=2, score_function="softmax"
        )


@pytest.mark.parametrize("kwargs,message", [
    (dict(topk=9), r"topk=9 must be in \[1, num_experts=8\]"),
    (dict(score_function="tanh"), r"score_function='tanh' is unknown"),
    (dict(routing_map_format="BYTEMAP"), r"routing_map_format='BYTEMAP' is unknown"),
])
def test_scores_for_aux_loss_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kwargs = {"topk": 2, "score_function": "softmax", **kwargs}
        fused_compute_score_for_moe_aux_loss(logits=torch.zeros(2, 8), **kwargs)


_AUX_DEFAULTS = dict(total_num_tokens=4, num_experts=8, topk=2, coeff=0.1)


@pytest.mark.parametrize("probs,counts,overrides,message", [
    (torch.zeros(4, 8), torch.ones(8), dict(num_experts=3), r"num_experts=3 must .* divide probs.shape\[1\]=8"),
    (torch.zeros(4, 8), torch.ones(8), dict(num_experts=0), r"num_experts=0"),
    (torch.zeros(4, 8), torch.ones(7), dict(), r"tokens_per_expert must be a tensor of shape \(8,\)"),
    (torch.zeros(4, 8), torch.ones(8, dtype=torch.bool), dict(), r"tokens_per_expert must be"),
    (torch.zeros(4, 8), torch.ones(8), dict(topk=0), r"topk=0 must be >= 1"),
    (torch.zeros(4, 8), torch.ones(8), dict(total_num_tokens=0), r"total_num_tokens=0 must be >= 1"),
    (torch.zeros(4, 8), torch.ones(8), dict(total_num_tokens=torch.tensor(4.0)), r"one int64 value"),
    (torch.zeros(32), torch.ones(8), dict(), r"probs must be a 2-D"),
    (torch.zeros(4, 8, dtype=torch.float64), torch.ones(8), dict(), r"probs must be a 2-D float32"),
])
def test_moe_aux_loss_rejects_bad_arguments(probs, counts, overrides, message):
    with pytest.raises(ValueError, match=message):
        fused_moe_aux_loss(probs=probs, tokens_per_expert=counts, **{**_AUX_DEFAULTS, **overrides})


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def _topk_call(logits, bias):
    return fused_topk_with_score_function(
        logits=logits, topk=4, use_pre_softmax=False, num_groups=4, group_topk=2, scaling_factor=1.5,
        score_function="sigmoid", expert_bias=bias,
    )


def _softmax_call(logits, bias):
    del bias
    return fused_topk_with_score_function(
        logits=logits, topk=2, use_pre_softmax=True, num_groups=None, group_topk=None, scaling_factor=None,
        score_function="softmax", expert_bias=None, routing_map_format="bitmap_u8",
    )


def _aux_scores_call(logits, bias):
    del bias
    return fused_compute_score_for_moe_aux_loss(logits=logits, topk=3, score_function="sqrtsoftplus")


def _aux_loss_call(logits, bias):
    del bias
    probs = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    counts = torch.arange(1, logits.shape[-1] + 1, dtype=torch.int32)
    return (fused_moe_aux_loss(probs=probs, tokens_per_expert=counts, total_num_tokens=logits.shape[0],
                               num_experts=logits.shape[-1], topk=2, coeff=0.01),)


@pytest.mark.parametrize("fn", [_topk_call, _softmax_call, _aux_scores_call, _aux_loss_call],
                         ids=["topk_sigmoid_grouped", "topk_softmax_bitmap", "aux_scores", "aux_loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiles_without_graph_breaks_and_matches_eager(fn, dtype, fresh_dynamo):
    logits = _leaf((9, 16), dtype)
    bias = randn(16, scale=0.1)
    explanation = torch._dynamo.explain(fn)(logits, bias)
    assert explanation.graph_break_count == 0, explanation.break_reasons

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager_out, compiled_out = fn(logits, bias), compiled(logits, bias)
    for eager, comp in zip(eager_out, compiled_out):
        assert comp.dtype == eager.dtype
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    differentiable = [out for out in eager_out if out.is_floating_point()]
    grad_out = [randn(out.numel(), dtype=out.dtype).reshape(out.shape) for out in differentiable]
    eager_grad = torch.autograd.grad(differentiable, logits, grad_outputs=grad_out)[0]
    compiled_diff = [out for out in compiled_out if out.is_floating_point()]
    compiled_grad = torch.autograd.grad(compiled_diff, logits, grad_outputs=grad_out)[0]
    torch.testing.assert_close(compiled_grad, eager_grad, **dtype_tols(dtype))
