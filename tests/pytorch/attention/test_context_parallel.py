"""Context parallelism (``cp_group``): every rank's output and dQ / dK / dV equal its part of single-process
attention on the whole sequence, for each implemented ``cp_comm_type``, at CP = 2 and 4: on gloo (CPU, float32)
and, ``gpu``-marked, on NCCL (rank r on GPU r, bfloat16 inputs and parameters, so that the GPU attention kernels
run: cuDNN / flash through the vendor backend, the flagos Triton kernels for packed "thd" batches).

Every rank builds the same full q, k, v, dO, runs the plain module on them (the oracle), then the
context-parallel module on its load-balanced part (chunks r and 2P-1-r of 2P, ``shard_sequence``) and
compares with the oracle's part. The check functions create modules and tensors on the rank's device
(``_ranks.device()``: the CPU under gloo, GPU r under nccl) in the :class:`Precision` they are passed
(the tolerances are derived where ``FP32`` and ``BF16`` are defined).

GPU variants (ids ``nccl2`` / ``nccl4``, as in tests/pytorch/parallel; skipped with fewer GPUs than ranks):
test_dpa_matches_single_process, test_transformer_layer (CP 2 and 4), test_hierarchical_a2a_p2p and
test_tensor_and_context_parallel_together (4 ranks), test_thd_matches_single_process and test_p2p_dropout (CP 2).
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import close_pools, device, get_pool
from tests.pytorch.parallel._tp import ZERO_GRAD_FLOOR, assert_close
from transformer_engine.pytorch.attention.context_parallel import shard_sequence

B, S, H, HKV, D = 2, 16, 8, 4, 8  # S = 16: 2 tokens per chunk at CP = 4; HKV = 4 splits over 4 ranks (a2a)
COMM_TYPES = ("all_gather", "p2p", "a2a")


class Precision(NamedTuple):
    """The dtype of a check's inputs and module parameters, and its tolerances against the single process.

    Attributes:
        dtype: inputs (q, k, v, dO, x, dy) and module parameters.
        tol: outputs, dQ / dK / dV and input gradients (elementwise atol / rtol).
        wgrad: parameter gradients summed over the ranks: elementwise atol / rtol, or {"rel_err": ...} norm-wise
            (``tests.pytorch.parallel._tp.assert_close``).
    """

    dtype: torch.dtype
    tol: Dict[str, float]
    wgrad: Dict[str, float]


# float32 (CPU, gloo): both sides compute from identical inputs in float32; only the order of the softmax sums (the
# ring's log-sum-exp merge, the per-chunk calls) and of the dK / dV sums over ranks differ, a few ulp of O(1) values
# (~1e-6), so atol = rtol = 1e-5; parameter gradients sum over every token (and the ranks' partial sums): atol 1e-4.
FP32 = Precision(torch.float32, dict(atol=1e-5, rtol=1e-5), dict(atol=1e-4, rtol=1e-5))
# bfloat16 (GPU, nccl): 8 significant bits, so each rounding to bf16 moves a value by up to u = 2^-9 (~2e-3)
# relative. Both sides start from the same bf16 inputs and accumulate in float32 inside their kernels, but round to
# bf16 at different points: the single-GPU module once, from one softmax over every key; "all_gather" per query chunk
# (a call over a key prefix, another tiling); "a2a" after a kernel over H/P heads; the ring ("p2p", "a2a+p2p") merges
# the per-block outputs by their log-sum-exps and rounds the merged O. The gradients go through each side's rounded O
# (D_i = sum_d dO_id O_id), sum the key / query blocks in another order, sum dK / dV over the 2 query heads of each kv
# head (GQA) and exchange or reduce-scatter them in bf16: a few u relative to the O(1) terms, so elements near 0 need
# the absolute part as the large ones need the relative part. NVIDIA TE's own CP tests
# (tests/pytorch/attention/run_attention_with_cp.py) compare bf16 outputs and dQ / dK / dV with atol = rtol = 2.5e-2,
# and 3.5e-2 with GQA (num_gqa_groups < num_heads), which every case here has (8 heads, 4 kv heads): 3.5e-2 (~18 u).
# Parameter gradients sum over all S B tokens, on the CP side as per-rank partial sums each rounded to bf16: with
# cancellation an element's relative error is unbounded, so they are compared norm-wise, to the same 3.5e-2, and a
# gradient that is analytically zero (the key bias) against a floor of the layer's gradient norms (_wgrad_floor).
BF16 = Precision(torch.bfloat16, dict(atol=3.5e-2, rtol=3.5e-2), dict(rel_err=3.5e-2))


@pytest.fixture(scope="module", autouse=True)
def _stop_pools():
    yield
    close_pools()


def _pools(*world_sizes, nccl=()):
    """Pools for the ``ranks`` fixture, (backend, world size): gloo at ``world_sizes`` (ids cp2 / cp4, the CPU ids as
    they were), then nccl at ``nccl``, ``gpu``-marked (ids nccl2 / nccl4, as tests/pytorch/parallel/conftest.py)."""
    gloo = [pytest.param(("gloo", n), id=f"cp{n}") for n in world_sizes]
    return gloo + [pytest.param(("nccl", n), id=f"nccl{n}", marks=pytest.mark.gpu) for n in nccl]


def _pools_with(world_size, values, ids=None):
    """(pool, value) pairs for a test whose CPU ids name no pool: every value on the gloo pool of ``world_size``
    ranks under its own id, then on the nccl pool (``gpu``-marked) under "<id>-nccl<world_size>";
    parametrize "ranks, <name>" with ``indirect=["ranks"]``."""
    ids = ids or [str(v) for v in values]
    gloo = [pytest.param(("gloo", world_size), v, id=i) for v, i in zip(values, ids)]
    nccl = [pytest.param(("nccl", world_size), v, id=f"{i}-nccl{world_size}", marks=pytest.mark.gpu) for v, i in zip(values, ids)]
    return gloo + nccl


@pytest.fixture(params=_pools(2, 4))
def ranks(request):
    """A pool of 2 or 4 ranks on gloo; a test with GPU variants parametrizes it (indirect) with nccl pools too, which
    need as many GPUs as ranks and are skipped otherwise."""
    backend, world_size = request.param
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"nccl with {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}")
    return get_pool(world_size, backend)


def _precision(pool) -> Precision:
    """bfloat16 on GPUs (nccl), float32 on the CPU (gloo)."""
    return BF16 if pool.backend == "nccl" else FP32


def _timeout(pool) -> float:
    """Seconds a call on ``pool`` may take: a GPU call's first run compiles Triton kernels (the flagos attention kernels
    autotune ~17 launch configurations per mask / window variant), which may take longer than the CPU's 90 s."""
    return 300.0 if pool.backend == "nccl" else 90.0


def _wgrad_floor(module: torch.nn.Module) -> float:
    """The norm a parameter gradient's error is measured against at least (norm-wise, on GPUs): ZERO_GRAD_FLOOR of the
    module's median gradient norm, as tests/pytorch/parallel/_tp.compare_grads (an analytically zero gradient, the key
    bias's, is pure rounding noise)."""
    return ZERO_GRAD_FLOOR * torch.stack([p.grad.double().norm() for p in module.parameters()]).median().item()


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


def _inputs(fmt: str, d_v: int = D, dtype: torch.dtype = torch.float32):
    """Full q, k, v, dO in ``fmt`` (the same on every rank: drawn in float32 on the CPU), on this rank's device in
    ``dtype``."""
    torch.manual_seed(1234)
    tensors = [torch.randn(B, S, H, D), torch.randn(B, S, HKV, D), torch.randn(B, S, HKV, d_v), torch.randn(B, S, H * d_v)]
    if fmt == "sbhd":
        tensors = [t.transpose(0, 1).contiguous() for t in tensors]
    return [t.to(device=device(), dtype=dtype) for t in tensors]


def _run(module, q, k, v, dout, checkpointed=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, checkpoint_core_attention=checkpointed)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_dpa(precision: Precision, comm_type, fmt, mask, window=None, softmax_type="vanilla", pairs=False, checkpointed=False,
              d_v=D):
    """One rank of a CP call against single-process attention; returns nothing (asserts)."""
    group = _hierarchy() if comm_type == "a2a+p2p" else _group(pairs)
    size, rank = (dist.get_world_size(), dist.get_rank()) if comm_type == "a2a+p2p" else (dist.get_world_size(group), dist.get_rank(group))
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                  softmax_type=softmax_type)
    ref, cp = (te.DotProductAttention(H, (D, d_v), **kwargs).to(device()) for _ in range(2))
    if softmax_type == "learnable":
        for module in (ref, cp):
            module.softmax_offset.data.copy_(torch.linspace(-1.0, 1.0, H))
    cp.set_context_parallel_group(group, None, None, comm_type)
    full = _inputs(fmt, d_v, precision.dtype)
    expected = _run(ref, *full)
    seq_dim = 0 if fmt == "sbhd" else 1
    local = [shard_sequence(t, seq_dim, size, rank) for t in full]
    actual = _run(cp, *local, checkpointed=checkpointed)
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, shard_sequence(want, seq_dim, size, rank), **precision.tol, msg=lambda m: f"{name}: {m}")
    if softmax_type == "learnable":  # each rank owns H/P heads' offsets: the CP gradients sum to the full one
        dist.all_reduce(cp.softmax_offset.grad, group=group)
        torch.testing.assert_close(cp.softmax_offset.grad, ref.softmax_offset.grad, **precision.tol)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("ranks", _pools(2, 4, nccl=(2, 4)), indirect=True)
def test_dpa_matches_single_process(ranks, comm_type, mask, fmt):
    ranks.run(check_dpa, _precision(ranks), comm_type, fmt, mask, timeout=_timeout(ranks))


@pytest.mark.parametrize("ranks, fmt", _pools_with(4, ["bshd", "sbhd"]), indirect=["ranks"])
@pytest.mark.parametrize("mask, window", [("causal", None), ("no_mask", None), ("causal", (3, 0)), ("no_mask", (2, 3))])
def test_hierarchical_a2a_p2p(ranks, mask, window, fmt):
    """"a2a+p2p" at CP 4 = 2 (a2a) x 2 (p2p), global ranks 2 p + a: the a2a groups' tokens form the p2p layout."""
    ranks.run(check_dpa, _precision(ranks), "a2a+p2p", fmt, mask, window, timeout=_timeout(ranks))


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("mask, window", [("causal", (3, 0)), ("no_mask", (2, 3)), ("no_mask", (0, 1))])
def test_sliding_window(ranks, comm_type, mask, window):
    """Windows narrower than a chunk (0, 1): some p2p blocks hide every key from some queries (lse_b = -inf)."""
    ranks.run(check_dpa, FP32, comm_type, "bshd", mask, window)


def check_dropout(mask: str, comm_type: str = "p2p"):
    """``comm_type`` ("p2p"; "all_gather", whose causal second chunk runs as two blocks) with attention dropout: repeatable under
    torch.manual_seed, not the output without dropout, and its
    backward is the derivative of its forward with the same masks (directional central differences of
    <dO, out> along random directions of q, k, v; float32 ring math, eps = 1e-2: agreement to ~1e-3 relative,
    while a backward with other masks or without them is off by O(1)).

    float32 on GPUs too: central differences need float32 inputs and outputs (bf16's spacing near 1 is 2^-7 ~ 8e-3,
    so q + 1e-2 d would round by up to 40% of the step, and the output's rounding noise, divided by 2 eps, would swamp
    the difference). On GPUs the masks come from the CUDA generator and the backward replays its state."""
    group = dist.group.WORLD
    size, rank = dist.get_world_size(), dist.get_rank()
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HKV, attention_dropout=0.5, qkv_format="bshd", attn_mask_type=mask).to(device())
    dpa.set_context_parallel_group(group, None, None, comm_type)
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
        direction = torch.randn(grad.shape, generator=generator).to(grad.device)
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
@pytest.mark.parametrize("ranks", _pools(2, 4, nccl=(2,)), indirect=True)
def test_p2p_dropout(ranks, mask):
    ranks.run(check_dropout, mask, timeout=_timeout(ranks))


@pytest.mark.parametrize("ranks", _pools(2, 4), indirect=True)
def test_all_gather_dropout(ranks):
    """The causal all_gather chunks after the first run as two blocks (keys before them, their diagonal): their
    dropout masks come back in backward from the blocks' own state."""
    ranks.run(check_dropout, "causal", "all_gather", timeout=_timeout(ranks))


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_value_head_size_differs(ranks, comm_type):
    """d_v != d_qk (MLA-style heads)."""
    ranks.run(check_dpa, FP32, comm_type, "sbhd", "causal", None, "vanilla", pairs=False, checkpointed=False, d_v=12)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_a2a_softmax_offset(ranks, softmax_type):
    ranks.run(check_dpa, FP32, "a2a", "sbhd", "causal", None, softmax_type)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_subgroups_and_checkpointing(comm_type):
    """CP = 2 inside a 4-rank world (groups {0, 2}, {1, 3}: the ring addresses global ranks), recomputed."""
    get_pool(4).run(check_dpa, FP32, comm_type, "bshd", "causal", None, "vanilla", pairs=True, checkpointed=True)


def _layer_inputs(hidden: int, dtype: torch.dtype):
    """x and dy [S, B, hidden] (the same on every rank: drawn in float32 on the CPU), on this rank's device in ``dtype``."""
    torch.manual_seed(8)
    x, dy = torch.randn(S, B, hidden), torch.randn(S, B, hidden)
    return x.to(device=device(), dtype=dtype), dy.to(device=device(), dtype=dtype)


def check_transformer_layer(precision: Precision, comm_type):
    """A TransformerLayer (GQA, RoPE, causal, sbhd; head dim 64 / 8 = 8, which the GPUs' cuDNN / flash kernels take)
    with set_context_parallel_group vs the whole sequence."""
    group, hidden, heads = _hierarchy() if comm_type == "a2a+p2p" else dist.group.WORLD, 64, 8
    size, rank = dist.get_world_size(), dist.get_rank()
    layers = []
    for _ in range(2):
        torch.manual_seed(7)
        layers.append(te.TransformerLayer(hidden, 64, heads, num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0,
                                          params_dtype=precision.dtype, device=device()))
    ref, cp = layers
    cp.set_context_parallel_group(group, list(range(size)), None, comm_type)
    rope = te.RotaryPositionEmbedding(hidden // heads).to(device())(S)
    x, dy = _layer_inputs(hidden, precision.dtype)
    x_ref, x_cp = x.clone().requires_grad_(), shard_sequence(x, 0, size, rank).requires_grad_()
    y_ref, y_cp = ref(x_ref, rotary_pos_emb=rope), cp(x_cp, rotary_pos_emb=rope)
    y_ref.backward(dy)
    y_cp.backward(shard_sequence(dy, 0, size, rank))
    torch.testing.assert_close(y_cp, shard_sequence(y_ref.detach(), 0, size, rank), **precision.tol)
    torch.testing.assert_close(x_cp.grad, shard_sequence(x_ref.grad, 0, size, rank), **precision.tol)
    floor = _wgrad_floor(ref)
    for (name, p_ref), p_cp in zip(ref.named_parameters(), cp.parameters()):  # weight grads: partial sums over ranks
        grad = p_cp.grad.to(torch.float32, copy=True)  # summed in float32: no rounding of the sum to bf16
        dist.all_reduce(grad)
        assert_close(grad, p_ref.grad.float(), precision.wgrad, name, floor)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("ranks", _pools(2, 4, nccl=(2, 4)), indirect=True)
def test_transformer_layer(ranks, comm_type):
    ranks.run(check_transformer_layer, _precision(ranks), comm_type, timeout=_timeout(ranks))


def test_transformer_layer_hierarchical():
    """RoPE at the chunks of rank 2 p + a: MultiheadAttention takes the whole group's size and rank from the pair."""
    get_pool(4).run(check_transformer_layer, FP32, "a2a+p2p")


def check_errors():
    """Unsupported calls raise on every rank before any communication."""
    world, size, dev = dist.group.WORLD, dist.get_world_size(), device()
    q, kv = torch.randn(B, 4, H, D, device=dev), torch.randn(B, 4, HKV, D, device=dev)
    pad = torch.zeros(B, 1, 1, 4, dtype=torch.bool, device=dev)

    def dpa(comm_type="p2p", **kwargs):
        kwargs = {"num_gqa_groups": HKV, "attention_dropout": 0.0, "qkv_format": "bshd", **kwargs}
        return te.DotProductAttention(H, D, cp_group=world, cp_comm_type=comm_type, **kwargs)

    cases = [
        (TypeError, "pair \\[a2a_group, p2p_group\\]", lambda: dpa("a2a+p2p")),
        (NotImplementedError, "windows with causal masks only", lambda: dpa("all_gather", qkv_format="thd", attn_mask_type="padding",
                                                                             window_size=(2, 2))(q[0], kv[0], kv[0],
                                                                                                 **_offsets([4 * size], [4 * size], dev))),
        (ValueError, "cu_seqlens_q_padded", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], cu_seqlens_q=_cu([4], dev),
                                                                         cu_seqlens_kv=_cu([4], dev))),
        (ValueError, "multiple of 2 \\* cp_size", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([3], [6], dev))),
        (ValueError, r"lie in \[0, padded length", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([9], [8], dev))),
        (ValueError, "holds 4 q tokens", lambda: dpa(qkv_format="thd")(q[0], kv[0], kv[0], **_offsets([16, 16], [16, 16], dev))),
        (NotImplementedError, "padding", lambda: dpa(attn_mask_type="padding")(q, kv, kv, attention_mask=pad)),
        (NotImplementedError, "post_scale_bias", lambda: dpa("all_gather")(q, kv, kv, core_attention_bias_type="post_scale_bias",
                                                                          core_attention_bias=torch.zeros(1, H, 4, 4 * size, device=dev))),
        (ValueError, "core_attention_bias .* must be", lambda: dpa()(q, kv, kv, core_attention_bias_type="post_scale_bias",
                                                                    core_attention_bias=torch.zeros(1, H, 4, 4, device=dev))),
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


def _cu(lengths, dev=None) -> torch.Tensor:
    """int32 [b + 1] offsets of sequences of ``lengths`` (on ``dev``, default the CPU)."""
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)


def _offsets(real, padded, dev=None) -> dict:
    """TE's four offset arguments of a packed batch (the same for q and kv), on ``dev`` (default the CPU)."""
    return dict(cu_seqlens_q=_cu(real, dev), cu_seqlens_kv=_cu(real, dev), cu_seqlens_q_padded=_cu(padded, dev),
                cu_seqlens_kv_padded=_cu(padded, dev))


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
# Head dim of the GPU variants: the vendor's SDPA kernels take no "thd" and the flagos Triton kernels head dims 16, 32,
# 64, 128 only, so at D = 8 the GPUs would run the reference backend's plain PyTorch instead of a GPU kernel.
THD_GPU_HEAD_DIM = 16


def check_thd(precision: Precision, comm_type, mask, window=None, d=D):
    """Packed sequences with padding between them ("thd", TE's global offsets): each rank's output and gradients
    equal its rows of single-process attention over the packed batch; padding rows get 0, as TE gives them."""
    group = _hierarchy() if comm_type == "a2a+p2p" else dist.group.WORLD
    size, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    padded = [-(-n // (2 * size)) * 2 * size for n in THD_LENGTHS]
    offsets = _offsets(THD_LENGTHS, padded, dev)
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format="thd", attn_mask_type=mask, window_size=window)
    ref, cp = (te.DotProductAttention(H, d, **kwargs).to(dev) for _ in range(2))
    cp.set_context_parallel_group(group, None, None, comm_type)
    torch.manual_seed(99)
    total = sum(padded)
    full = [torch.randn(total, H, d), torch.randn(total, HKV, d), torch.randn(total, HKV, d), torch.randn(total, H * d)]
    full = [t.to(device=dev, dtype=precision.dtype) for t in full]

    def run(module, q, k, v, dout):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = module(q, k, v, **offsets)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad]

    expected = run(ref, *full)
    rows = _thd_rows(padded, size, rank).to(dev)
    actual = run(cp, *(t[rows] for t in full))
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want[rows], **precision.tol, msg=lambda m: f"{name}: {m}")
    real = torch.cat([torch.arange(p) < n for n, p in zip(THD_LENGTHS, padded)]).to(dev)[rows]
    assert not actual[0][~real].any() and not actual[1][~real].any() and not actual[2][~real].any()


@pytest.mark.parametrize("mask, window", [("padding_causal", None), ("padding", None), ("padding_causal", (3, 0))])
def test_thd_hierarchical(mask, window):
    """"a2a+p2p" at 2 x 2: the a2a group's tokens of every sequence, reordered into the coarse p2p layout."""
    get_pool(4).run(check_thd, FP32, "a2a+p2p", mask, window)


@pytest.mark.parametrize("mask, window", [("padding_causal", None), ("padding", None), ("causal", None), ("padding_causal", (3, 0)),
                                          ("padding", (2, 1))])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("ranks", _pools(2, 4, nccl=(2,)), indirect=True)
def test_thd_matches_single_process(ranks, comm_type, mask, window):
    if comm_type == "all_gather" and "causal" not in mask and window is not None:
        pytest.skip("all_gather takes windows with causal masks only (test_errors checks the refusal)")
    head_dim = THD_GPU_HEAD_DIM if ranks.backend == "nccl" else D
    ranks.run(check_thd, _precision(ranks), comm_type, mask, window, head_dim, timeout=_timeout(ranks))


def _tp_cp_groups():
    """Tensor parallelism over {0, 1} and {2, 3}, context parallelism over {0, 2} and {1, 3} (4 ranks)."""
    if "tp_cp" not in _GROUPS:
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["tp_cp"] = tp[dist.get_rank() // 2], _group(pairs=True)
    return _GROUPS["tp_cp"]


# The GPU ring's attention differs from the single GPU's at the bf16 level, not in the last bits as a sharded GEMM's
# sum does (_tp.py): each block's O and dK / dV come out of FlashAttention-2 rounded to bf16 before the float32
# merge, the whole sequence's out of cuDNN in one piece. Under FP8 those dK (about 2^-8 apart, relative) reach the
# key projection's E5M2 dy cast (2 mantissa bits, steps of 2^-2 relative): some 2^-8 / 2^-2 = 1/64 of the elements
# flip by a step, a norm-wise error of about sqrt(1/64) 2^-2 = 2^-5 from that alone (measured 4.7e-2 on 4 H100s for
# the key weight's gradient). 2^-3 bounds it with room; a wrong scale or a missing block is an O(1) error.
RING_FP8_GPU_REL_ERR = 2.0**-3


def check_tensor_and_context_parallel(precision: Precision, comm_type, sequence_parallel, recipe):
    """A TransformerLayer split two ways, heads and weights over a TP group (with or without sequence parallelism)
    and the sequence over a CP group, against the single-process layer on the whole sequence: outputs, input
    gradients, and weight gradients (summed over the CP group, gathered over the TP group). With delayed scaling
    (two steps: the second casts with scales from the first's amaxes, MAX-reduced over all ranks, the default
    group) the FP8 casts equal the single process's, so only summation orders differ (TP's tolerance). Head dim
    64 / 8 = 8, which the GPUs' cuDNN / flash kernels take."""
    from tests.pytorch.parallel._tp import delayed_fp8_tolerance, fp8_context
    from transformer_engine.pytorch.parallel import shard_state_dict
    from transformer_engine.pytorch.parallel.tensor_parallel import full_tensor

    tp_group, cp_group = _tp_cp_groups()
    cp_size, cp_rank, tp_rank = 2, dist.get_rank(cp_group), dist.get_rank(tp_group)
    hidden, heads = 64, 8
    kwargs = dict(num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=precision.dtype, device=device())
    torch.manual_seed(7)
    ref = te.TransformerLayer(hidden, 64, heads, **kwargs)
    layer = te.TransformerLayer(hidden, 64, heads, set_parallel_mode=True, tp_group=tp_group, tp_size=2,
                                sequence_parallel=sequence_parallel, **kwargs)
    layer.load_state_dict(shard_state_dict(layer, ref.state_dict(), tp_group))
    layer.set_context_parallel_group(cp_group, None, None, comm_type)
    rope = te.RotaryPositionEmbedding(hidden // heads).to(device())(S)
    x, dy = _layer_inputs(hidden, precision.dtype)

    def local(t):  # this rank's rows: its CP chunks, then (sequence parallelism) its TP half of them
        t = shard_sequence(t, 0, cp_size, cp_rank)
        return t.chunk(2, dim=0)[tp_rank] if sequence_parallel else t

    tol = delayed_fp8_tolerance() if recipe else precision.tol
    if recipe and comm_type == "p2p":
        tol = dict(tol, rel_err_cuda=RING_FP8_GPU_REL_ERR)
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
        ref_grads, floor = dict(ref.named_parameters()), _wgrad_floor(ref)
        for name, param in layer.named_parameters():
            grad = param.grad.to(torch.float32, copy=True)  # summed in float32: no rounding of the sum to bf16
            dist.all_reduce(grad, group=cp_group)
            assert_close(full_tensor(grad, param, tp_group), ref_grads[name].grad.float(), tol if recipe else precision.wgrad,
                         f"{name}, step {step}", floor)


@pytest.mark.parametrize("ranks, recipe", _pools_with(4, [None, "delayed"], ["bf16", "fp8-delayed"]), indirect=["ranks"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_tensor_and_context_parallel_together(ranks, comm_type, sequence_parallel, recipe):
    """(On the CPU the "bf16" cases run float32, as every gloo case.)"""
    ranks.run(check_tensor_and_context_parallel, _precision(ranks), comm_type, sequence_parallel, recipe, timeout=_timeout(ranks))


def check_bias(precision: Precision, bias_type, bias_shape, mask):
    """"p2p" with an attention bias: each rank's bias holds its query rows (its chunks) and every key column; outputs,
    dQ / dK / dV and dBias (this rank's rows, summed over broadcast dims) equal the single process's."""
    group = dist.group.WORLD
    size, rank = dist.get_world_size(), dist.get_rank()
    kwargs = dict(num_gqa_groups=HKV, attention_dropout=0.0, qkv_format="bshd", attn_mask_type=mask)
    ref, cp = (te.DotProductAttention(H, D, **kwargs).to(device()) for _ in range(2))
    cp.set_context_parallel_group(group, None, None, "p2p")
    q, k, v, dout = _inputs("bshd", D, precision.dtype)
    bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(3)).to(device=device(), dtype=precision.dtype)
    bias_local = shard_sequence(bias, 2, size, rank) if bias_shape[2] > 1 else bias

    def run(module, q, k, v, bias, dout):
        q, k, v, bias = (t.detach().clone().requires_grad_() for t in (q, k, v, bias))
        out = module(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad, bias.grad]

    expected = run(ref, q, k, v, bias, dout)
    actual = run(cp, *(shard_sequence(t, 1, size, rank) for t in (q, k, v)), bias_local, shard_sequence(dout, 1, size, rank))
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, shard_sequence(want, 1, size, rank), **precision.tol, msg=lambda m: f"{name}: {m}")
    dbias = actual[4]
    if bias_shape[2] == 1:  # a bias broadcast over the queries collects every rank's rows
        dist.all_reduce(dbias, group=group)
        torch.testing.assert_close(dbias, expected[4], **precision.tol)
    else:
        torch.testing.assert_close(dbias, shard_sequence(expected[4], 2, size, rank), **precision.tol)


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("bias_type, bias_shape", [("post_scale_bias", (1, H, S, S)), ("pre_scale_bias", (B, 1, S, S)),
                                                    ("post_scale_bias", (1, H, 1, S))], ids=["post-1hss", "pre-b1ss", "post-1h1s"])
def test_p2p_attention_bias(ranks, bias_type, bias_shape, mask):
    ranks.run(check_bias, FP32, bias_type, bias_shape, mask)


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
    order, inverse = first.coarse_order(2, 2, 0, kv=False, device="cpu"), first.coarse_inverse(2, 2, 0, "cpu")  # "a2a+p2p"'s way back
    assert torch.equal(order[inverse], torch.arange(order.numel())) and first.coarse_inverse(2, 2, 0, "cpu") is inverse
    cu[2] = 13  # in place: a new version, read again
    assert from_offsets().lengths_q == (6, 7) and len(reads) == 8
    with pytest.raises(ValueError, match="holds 4 q tokens"):
        from_offsets(tokens=4)
