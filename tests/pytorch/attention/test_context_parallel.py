"""Context parallelism (``cp_group``): every rank's output and dQ / dK / dV equal its part of single-process
attention on the whole sequence, for each implemented ``cp_comm_type``, at CP = 2 and 4 (gloo on CPU).

Every rank builds the same full q, k, v, dO, runs the plain module on them (the oracle), then the
context-parallel module on its load-balanced part (chunks r and 2P-1-r of 2P, ``shard_sequence``) and
compares with the oracle's part. Tolerance (float32): both sides compute from identical inputs in
float32; only the order of the softmax sums (the ring's log-sum-exp merge, the per-chunk calls) and of
the dK / dV sums over ranks differ, a few ulp of O(1) values (~1e-6), so atol = rtol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import close_pools, get_pool
from transformer_engine.pytorch.attention.context_parallel import shard_sequence

B, S, H, HKV, D = 2, 16, 8, 4, 8  # S = 16: 2 tokens per chunk at CP = 4; HKV = 4 splits over 4 ranks (a2a)
TOL = dict(atol=1e-5, rtol=1e-5)
COMM_TYPES = ("all_gather", "p2p", "a2a")


@pytest.fixture(scope="module", autouse=True)
def _stop_pools():
    yield
    close_pools()


@pytest.fixture(params=[2, 4], ids=["cp2", "cp4"])
def ranks(request):
    return get_pool(request.param)


_GROUPS = {}


def _group(pairs: bool):
    """WORLD, or (pairs) groups {0, 2} and {1, 3} of a 4-rank world: group ranks != global ranks."""
    if not pairs:
        return dist.group.WORLD
    if "pairs" not in _GROUPS:  # new_group is collective: every rank creates both, in the same order
        made = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _GROUPS["pairs"] = made[dist.get_rank() % 2]
    return _GROUPS["pairs"]


def _hierarchy():
    """"a2a+p2p" over a 4-rank world: a2a groups {0, 1} and {2, 3} (A = 2 consecutive ranks), p2p groups {0, 2}, {1, 3}:
    rank r = p A + a is the global rank."""
    if "hierarchy" not in _GROUPS:
        a2a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["hierarchy"] = [a2a[dist.get_rank() // 2], _group(pairs=True)]
    return _GROUPS["hierarchy"]


def _inputs(fmt: str, d_v: int = D):
    """Full q, k, v, dO in ``fmt`` (the same on every rank)."""
    torch.manual_seed(1234)
    tensors = [torch.randn(B, S, H, D), torch.randn(B, S, HKV, D), torch.randn(B, S, HKV, d_v), torch.randn(B, S, H * d_v)]
    if fmt == "sbhd":
        tensors = [t.transpose(0, 1).contiguous() for t in tensors]
    return tensors


def _run(module, q, k, v, dout, checkpointed=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, checkpoint_core_attention=checkpointed)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_dpa(comm_type, fmt, mask, window=None, softmax_type="vanilla", pairs=False, checkpointed=False, d_v=D):
    """One rank of a CP call against single-process attention; returns nothing (asserts)."""
    group = _hierarchy() if comm_type == "a2a+p2p" else _group(pairs)
    size, rank = (dist.get_world_size(), dist.get_rank()) if comm_type == "a2a+p2p" else (dist.get_world_size(group), dist.get_rank(group))
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                  softmax_type=softmax_type)
    ref, cp = te.DotProductAttention(H, (D, d_v), **kwargs), te.DotProductAttention(H, (D, d_v), **kwargs)
    if softmax_type == "learnable":
        for module in (ref, cp):
            module.softmax_offset.data.copy_(torch.linspace(-1.0, 1.0, H))
    cp.set_context_parallel_group(group, None, None, comm_type)
    full = _inputs(fmt, d_v)
    expected = _run(ref, *full)
    seq_dim = 0 if fmt == "sbhd" else 1
    local = [shard_sequence(t, seq_dim, size, rank) for t in full]
    actual = _run(cp, *local, checkpointed=checkpointed)
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, shard_sequence(want, seq_dim, size, rank), **TOL, msg=lambda m: f"{name}: {m}")
    if softmax_type == "learnable":  # each rank owns H/P heads' offsets: the CP gradients sum to the full one
        dist.all_reduce(cp.softmax_offset.grad, group=group)
        torch.testing.assert_close(cp.softmax_offset.grad, ref.softmax_offset.grad, **TOL)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_dpa_matches_single_process(ranks, comm_type, mask, fmt):
    ranks.run(check_dpa, comm_type, fmt, mask)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask, window", [("causal", None), ("no_mask", None), ("causal", (3, 0)), ("no_mask", (2, 3))])
def test_hierarchical_a2a_p2p(mask, window, fmt):
    """"a2a+p2p" at CP 4 = 2 (a2a) x 2 (p2p), global ranks 2 p + a: the a2a groups' tokens form the p2p layout."""
    get_pool(4).run(check_dpa, "a2a+p2p", fmt, mask, window)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("mask, window", [("causal", (3, 0)), ("no_mask", (2, 3)), ("no_mask", (0, 1))])
def test_sliding_window(ranks, comm_type, mask, window):
    """Windows narrower than a chunk (0, 1): some p2p blocks hide every key from some queries (lse_b = -inf)."""
    ranks.run(check_dpa, comm_type, "bshd", mask, window)


def check_p2p_dropout(mask: str):
    """"p2p" with attention dropout: repeatable under torch.manual_seed, not the output without dropout, and its
    backward is the derivative of its forward with the same masks (directional central differences of
    <dO, out> along random directions of q, k, v; float32 ring math, eps = 1e-2: agreement to ~1e-3 relative,
    while a backward with other masks or without them is off by O(1))."""
    group = dist.group.WORLD
    size, rank = dist.get_world_size(), dist.get_rank()
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HKV, attention_dropout=0.5, qkv_format="bshd", attn_mask_type=mask)
    dpa.set_context_parallel_group(group, None, None, "p2p")
    q, k, v, dout = (shard_sequence(t, 1, size, rank) for t in _inputs("bshd"))

    def f(q, k, v):
        torch.manual_seed(77 + rank)  # the masks: the same draws on every evaluation
        return dpa(q, k, v)

    out, dq, dk, dv = _run_with(f, q, k, v, dout)
    assert torch.equal(f(q, k, v), out)  # repeatable
    dpa.attention_dropout = 0.0
    assert not torch.allclose(f(q, k, v), out)
    dpa.attention_dropout = 0.5
    generator = torch.Generator().manual_seed(5 + rank)
    eps = 1e-2
    for i, grad in enumerate((dq, dk, dv)):
        direction = torch.randn(grad.shape, generator=generator)
        args = [q, k, v]

        def along(sign):
            moved = list(args)
            moved[i] = args[i] + sign * eps * direction
            return (f(*moved) * dout).sum()

        numeric = (along(1.0) - along(-1.0)) / (2 * eps)
        analytic = (grad * direction).sum()
        dist.all_reduce(numeric, group=group)  # the whole sequence's <dO, out>: k and v reach every rank's queries
        dist.all_reduce(analytic, group=group)
        torch.testing.assert_close(analytic, numeric, rtol=2e-3, atol=2e-3)


def _run_with(f, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = f(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_p2p_dropout(ranks, mask):
    ranks.run(check_p2p_dropout, mask)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_value_head_size_differs(ranks, comm_type):
    """d_v != d_qk (MLA-style heads)."""
    ranks.run(check_dpa, comm_type, "sbhd", "causal", None, "vanilla", False, False, 12)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_a2a_softmax_offset(ranks, softmax_type):
    ranks.run(check_dpa, "a2a", "sbhd", "causal", None, softmax_type)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_subgroups_and_checkpointing(comm_type):
    """CP = 2 inside a 4-rank world (groups {0, 2}, {1, 3}: the ring addresses global ranks), recomputed."""
    get_pool(4).run(check_dpa, comm_type, "bshd", "causal", None, "vanilla", True, True)


def check_transformer_layer(comm_type):
    """A TransformerLayer (GQA, RoPE, causal, sbhd) with set_context_parallel_group vs the whole sequence."""
    group, hidden, heads = _hierarchy() if comm_type == "a2a+p2p" else dist.group.WORLD, 32, 8
    size, rank = dist.get_world_size(), dist.get_rank()
    layers = []
    for _ in range(2):
        torch.manual_seed(7)
        layers.append(te.TransformerLayer(hidden, 64, heads, num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0))
    ref, cp = layers
    cp.set_context_parallel_group(group, list(range(size)), None, comm_type)
    rope = te.RotaryPositionEmbedding(hidden // heads)(S)
    torch.manual_seed(8)
    x, dy = torch.randn(S, B, hidden), torch.randn(S, B, hidden)
    x_ref, x_cp = x.clone().requires_grad_(), shard_sequence(x, 0, size, rank).requires_grad_()
    y_ref, y_cp = ref(x_ref, rotary_pos_emb=rope), cp(x_cp, rotary_pos_emb=rope)
    y_ref.backward(dy)
    y_cp.backward(shard_sequence(dy, 0, size, rank))
    torch.testing.assert_close(y_cp, shard_sequence(y_ref.detach(), 0, size, rank), **TOL)
    torch.testing.assert_close(x_cp.grad, shard_sequence(x_ref.grad, 0, size, rank), **TOL)
    for (name, p_ref), p_cp in zip(ref.named_parameters(), cp.parameters()):  # weight grads: partial sums over ranks
        dist.all_reduce(p_cp.grad)
        torch.testing.assert_close(p_cp.grad, p_ref.grad, atol=1e-4, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_transformer_layer(ranks, comm_type):
    ranks.run(check_transformer_layer, comm_type)


def test_transformer_layer_hierarchical():
    """RoPE at the chunks of rank 2 p + a: MultiheadAttention takes the whole group's size and rank from the pair."""
    get_pool(4).run(check_transformer_layer, "a2a+p2p")


def check_errors():
    """Unsupported calls raise on every rank before any communication."""
    world, size = dist.group.WORLD, dist.get_world_size()
    q, kv = torch.randn(B, 4, H, D), torch.randn(B, 4, HKV, D)
    pad = torch.zeros(B, 1, 1, 4, dtype=torch.bool)

    def dpa(comm_type="p2p", **kwargs):
        kwargs = {"num_gqa_groups": HKV, "attention_dropout": 0.0, "qkv_format": "bshd", **kwargs}
        return te.DotProductAttention(H, D, cp_group=world, cp_comm_type=comm_type, **kwargs)

    cases = [
        (TypeError, "pair \\[a2a_group, p2p_group\\]", lambda: dpa("a2a+p2p")),
        (NotImplementedError, "windows with causal masks only", lambda: dpa("all_gather", qkv_format="thd", attn_mask_type="padding",
                                                                             window_size=(2, 2))(q[0], kv[0], kv[0], **_offsets([4 * size], [4 * size]))),
        (ValueError, "cu_seqlens_q_padded", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], cu_seqlens_q=_cu([4]), cu_seqlens_kv=_cu([4]))),
        (ValueError, "multiple of 2 \\* cp_size", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([3], [6]))),
        (ValueError, r"lie in \[0, padded length", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([9], [8]))),
        (ValueError, "holds 4 q tokens", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([16, 16], [16, 16]))),
        (NotImplementedError, "padding", lambda: dpa(attn_mask_type="padding")(q, kv, kv, attention_mask=pad)),
        (NotImplementedError, "post_scale_bias", lambda: dpa("all_gather")(q, kv, kv, core_attention_bias_type="post_scale_bias",
                                                                          core_attention_bias=torch.zeros(1, H, 4, 4 * size))),
        (ValueError, "core_attention_bias .* must be", lambda: dpa()(q, kv, kv, core_attention_bias_type="post_scale_bias",
                                                                    core_attention_bias=torch.zeros(1, H, 4, 4))),
        (NotImplementedError, "alibi", lambda: dpa()(q, kv, kv, core_attention_bias_type="alibi")),
        (NotImplementedError, "softmax_type", lambda: dpa("all_gather", softmax_type="off-by-one")(q, kv, kv)),
        (ValueError, "even", lambda: dpa()(q[:, :3], kv[:, :3], kv[:, :3])),
        (ValueError, "equal q and k", lambda: dpa()(q, kv[:, :2], kv[:, :2])),
    ]
    if dist.get_world_size() == 4:
        cases.append((ValueError, "divide by the a2a size", lambda: dpa("a2a", num_gqa_groups=2)(q, kv[:, :, :2], kv[:, :, :2])))
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_errors(ranks):
    ranks.run(check_errors)


def test_errors_without_process_group():
    with pytest.raises(ValueError, match="cp_comm_type='ring'"):
        te.DotProductAttention(H, D, cp_comm_type="ring")
    with pytest.raises(TypeError, match="ProcessGroup"):
        te.DotProductAttention(H, D, cp_group=object())
    with pytest.raises(ValueError, match="multiple of 2"):
        shard_sequence(torch.zeros(6), 0, 2, 0)


def test_no_group_is_plain_attention():
    """cp_group=None (the default) leaves the module as it was."""
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd")
    dpa.set_context_parallel_group(None, None, None, "all_gather")
    q, k, v, _ = _inputs("bshd")
    assert dpa(q, k, v).shape == (B, S, H * D)


def _cu(lengths) -> torch.Tensor:
    """int32 [b + 1] offsets of sequences of ``lengths``."""
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _offsets(real, padded) -> dict:
    """TE's four offset arguments of a packed batch (the same for q and kv)."""
    return dict(cu_seqlens_q=_cu(real), cu_seqlens_kv=_cu(real), cu_seqlens_q_padded=_cu(padded), cu_seqlens_kv_padded=_cu(padded))


def _thd_rows(padded, size: int, rank: int) -> torch.Tensor:
    """The rows of a packed batch rank ``rank`` holds (TE's thd_get_partitioned_indices): per sequence, chunks rank and
    2P-1-rank of its 2P."""
    rows, start = [], 0
    for length in padded:
        chunk = length // (2 * size)
        rows += list(range(start + rank * chunk, start + (rank + 1) * chunk))
        rows += list(range(start + (2 * size - 1 - rank) * chunk, start + (2 * size - rank) * chunk))
        start += length
    return torch.tensor(rows, dtype=torch.int64)


THD_LENGTHS = (5, 0, 16, 11)  # real tokens per sequence; one empty sequence, one that fills its padded length


def check_thd(comm_type, mask, window=None):
    """Packed sequences with padding between them ("thd", TE's global offsets): each rank's output and gradients
    equal its rows of single-process attention over the packed batch; padding rows get 0, as TE gives them."""
    group = _hierarchy() if comm_type == "a2a+p2p" else dist.group.WORLD
    size, rank = dist.get_world_size(), dist.get_rank()
    padded = [-(-n // (2 * size)) * 2 * size for n in THD_LENGTHS]
    offsets = _offsets(THD_LENGTHS, padded)
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format="thd", attn_mask_type=mask, window_size=window)
    ref, cp = te.DotProductAttention(H, D, **kwargs), te.DotProductAttention(H, D, **kwargs)
    cp.set_context_parallel_group(group, None, None, comm_type)
    torch.manual_seed(99)
    total = sum(padded)
    full = [torch.randn(total, H, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D), torch.randn(total, H * D)]

    def run(module, q, k, v, dout):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = module(q, k, v, **offsets)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad]

    expected = run(ref, *full)
    rows = _thd_rows(padded, size, rank)
    actual = run(cp, *(t[rows] for t in full))
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want[rows], **TOL, msg=lambda m: f"{name}: {m}")
    real = torch.cat([torch.arange(p) < n for n, p in zip(THD_LENGTHS, padded)])[rows]
    assert not actual[0][~real].any() and not actual[1][~real].any() and not actual[2][~real].any()


@pytest.mark.parametrize("mask, window", [("padding_causal", None), ("padding", None), ("padding_causal", (3, 0))])
def test_thd_hierarchical(mask, window):
    """"a2a+p2p" at 2 x 2: the a2a group's tokens of every sequence, reordered into the coarse p2p layout."""
    get_pool(4).run(check_thd, "a2a+p2p", mask, window)


@pytest.mark.parametrize("mask, window", [("padding_causal", None), ("padding", None), ("causal", None), ("padding_causal", (3, 0)),
                                          ("padding", (2, 1))])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_thd_matches_single_process(ranks, comm_type, mask, window):
    if comm_type == "all_gather" and "causal" not in mask and window is not None:
        pytest.skip("all_gather takes windows with causal masks only (test_errors checks the refusal)")
    ranks.run(check_thd, comm_type, mask, window)


def _tp_cp_groups():
    """Tensor parallelism over {0, 1} and {2, 3}, context parallelism over {0, 2} and {1, 3} (4 ranks)."""
    if "tp_cp" not in _GROUPS:
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["tp_cp"] = tp[dist.get_rank() // 2], _group(pairs=True)
    return _GROUPS["tp_cp"]


def check_tensor_and_context_parallel(comm_type, sequence_parallel, recipe):
    """A TransformerLayer split two ways, heads and weights over a TP group (with or without sequence parallelism)
    and the sequence over a CP group, against the single-process layer on the whole sequence: outputs, input
    gradients, and weight gradients (summed over the CP group, gathered over the TP group). With delayed scaling
    (two steps: the second casts with scales from the first's amaxes, MAX-reduced over all ranks, the default
    group) the FP8 casts equal the single process's, so only summation orders differ (TP's tolerance)."""
    from tests.pytorch.parallel._tp import assert_close, delayed_fp8_tolerance, fp8_context
    from transformer_engine.pytorch.parallel import shard_state_dict
    from transformer_engine.pytorch.parallel.tensor_parallel import full_tensor

    tp_group, cp_group = _tp_cp_groups()
    cp_size, cp_rank, tp_rank = 2, dist.get_rank(cp_group), dist.get_rank(tp_group)
    hidden, heads = 32, 8
    kwargs = dict(num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    torch.manual_seed(7)
    ref = te.TransformerLayer(hidden, 64, heads, **kwargs)
    layer = te.TransformerLayer(hidden, 64, heads, set_parallel_mode=True, tp_group=tp_group, tp_size=2,
                                sequence_parallel=sequence_parallel, **kwargs)
    layer.load_state_dict(shard_state_dict(layer, ref.state_dict(), tp_group))
    layer.set_context_parallel_group(cp_group, None, None, comm_type)
    rope = te.RotaryPositionEmbedding(hidden // heads)(S)
    torch.manual_seed(8)
    x, dy = torch.randn(S, B, hidden), torch.randn(S, B, hidden)

    def local(t):  # this rank's rows: its CP chunks, then (sequence parallelism) its TP half of them
        t = shard_sequence(t, 0, cp_size, cp_rank)
        return t.chunk(2, dim=0)[tp_rank] if sequence_parallel else t

    tol = delayed_fp8_tolerance() if recipe else TOL
    for step in range(2 if recipe else 1):
        for module in (ref, layer):
            module.zero_grad(set_to_none=True)
        x_ref, x_local = x.clone().requires_grad_(), local(x).requires_grad_()
        with fp8_context(recipe):
            y_ref, y = ref(x_ref, rotary_pos_emb=rope), layer(x_local, rotary_pos_emb=rope)
        y_ref.backward(dy)
        y.backward(local(dy))
        assert_close(y, local(y_ref.detach()), tol, f"output, step {step}")
        assert_close(x_local.grad, local(x_ref.grad), tol, f"input gradient, step {step}")
        ref_grads = dict(ref.named_parameters())
        for name, param in layer.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            assert_close(full_tensor(grad, param, tp_group), ref_grads[name].grad, tol if recipe else dict(atol=1e-4, rtol=1e-5),
                         f"{name}, step {step}")


@pytest.mark.parametrize("recipe", [None, "delayed"], ids=["bf16", "fp8-delayed"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_tensor_and_context_parallel_together(comm_type, sequence_parallel, recipe):
    get_pool(4).run(check_tensor_and_context_parallel, comm_type, sequence_parallel, recipe)


def check_bias(bias_type, bias_shape, mask):
    """"p2p" with an attention bias: each rank's bias holds its query rows (its chunks) and every key column; outputs,
    dQ / dK / dV and dBias (this rank's rows, summed over broadcast dims) equal the single process's."""
    group = dist.group.WORLD
    size, rank = dist.get_world_size(), dist.get_rank()
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format="bshd", attn_mask_type=mask)
    ref, cp = te.DotProductAttention(H, D, **kwargs), te.DotProductAttention(H, D, **kwargs)
    cp.set_context_parallel_group(group, None, None, "p2p")
    q, k, v, dout = _inputs("bshd")
    bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(3))
    bias_local = shard_sequence(bias, 2, size, rank) if bias_shape[2] > 1 else bias

    def run(module, q, k, v, bias, dout):
        q, k, v, bias = (t.detach().clone().requires_grad_() for t in (q, k, v, bias))
        out = module(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad, bias.grad]

    expected = run(ref, q, k, v, bias, dout)
    actual = run(cp, *(shard_sequence(t, 1, size, rank) for t in (q, k, v)), bias_local, shard_sequence(dout, 1, size, rank))
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, shard_sequence(want, 1, size, rank), **TOL, msg=lambda m: f"{name}: {m}")
    dbias = actual[4]
    if bias_shape[2] == 1:  # a bias broadcast over the queries collects every rank's rows
        dist.all_reduce(dbias, group=group)
        torch.testing.assert_close(dbias, expected[4], **TOL)
    else:
        torch.testing.assert_close(dbias, shard_sequence(expected[4], 2, size, rank), **TOL)


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("bias_type, bias_shape", [("post_scale_bias", (1, H, S, S)), ("pre_scale_bias", (B, 1, S, S)),
                                                    ("post_scale_bias", (1, H, 1, S))], ids=["post-1hss", "pre-b1ss", "post-1h1s"])
def test_p2p_attention_bias(ranks, bias_type, bias_shape, mask):
    ranks.run(check_bias, bias_type, bias_shape, mask)


def test_thd_offsets_are_read_once_per_set_of_tensors(monkeypatch):
    """Every layer of a step passes the same offset tensors: one host read (a device synchronization on the GPU) and
    one PackedSequences, with its index tensors, for all of them; offsets changed in place, or another call shape,
    are read and checked again."""
    from transformer_engine.pytorch.attention import context_parallel_packed as packed_module

    reads = []
    read = packed_module._lengths
    monkeypatch.setattr(packed_module, "_lengths", lambda cu: reads.append(cu) or read(cu))
    cu, cu_padded = torch.tensor([0, 6, 14], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)

    def from_offsets(tokens=8):
        return packed_module.PackedSequences.from_offsets(cu, cu, cu_padded, cu_padded, bottom_right=False, size=2,
                                                          tokens_q=tokens, tokens_kv=tokens, name="test")

    first = from_offsets()
    assert from_offsets() is first and len(reads) == 4
    call = first.whole_call(causal=True, window=(-1, 0), device="cpu")  # and the thd calls it builds, once
    assert from_offsets().whole_call(causal=True, window=(-1, 0), device="cpu") is call
    cu[2] = 13  # in place: a new version, read again
    assert from_offsets().lengths_q == (6, 7) and len(reads) == 8
    with pytest.raises(ValueError, match="holds 4 q tokens"):
        from_offsets(tokens=4)
