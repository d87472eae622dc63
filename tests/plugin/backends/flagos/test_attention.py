"""flagos flash attention (Triton) against the reference backend.

Without a GPU the kernels run in Triton's interpreter (see conftest.py) with 16 x 16 blocks, so the
small sequence lengths below (17..40, primes included) cross several blocks and exercise the masked
edge blocks, the unmasked inner blocks and the partial last block. The oracle is the reference
backend run in float32 on the same (fp16 / bf16-valued) inputs.

Tolerances, relative to the oracle's norm (and max-abs relative to its largest entry): the kernel
rounds P to the input dtype before P V / P^T dO (as FlashAttention-2 does) and rounds its outputs,
so errors are a few units of the dtype's epsilon (fp16 2^-11, bf16 2^-8); measured ~3e-4 (fp16)
and ~7e-3 (bf16, whose interpreter casts truncate). The bounds leave about 4x margin.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.utils import rel_err
from transformer_engine.plugin.backends.flagos import attention as flagos
from transformer_engine.plugin.backends.reference import attention as reference
from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.core import BackendImplKind, Capabilities, OpManager, OpRegistry
from transformer_engine.plugin.backends._registration import impls_from_modules

NORM_TOL = {torch.float16: 2e-3, torch.bfloat16: 2.5e-2}
MAX_TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: lengths per sequence (bshd: every sequence has the first length)."""

    seqlens_q: tuple
    seqlens_kv: tuple
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    mask_type: str = "no_mask"
    window: tuple = (-1, -1)
    qkv_format: str = "bshd"

    def config(self) -> AttentionConfig:
        return AttentionConfig(
            softmax_scale=self.head_dim**-0.5, mask_type=self.mask_type, window_size=self.window, qkv_format=self.qkv_format
        )


def _inputs(case: Case, device: str):
    """q, k, v and cu_seqlens (thd) with fresh random values."""
    d, h, h_kv = case.head_dim, case.heads, case.kv_heads
    if case.qkv_format == "bshd":
        b, s_q, s_kv = len(case.seqlens_q), case.seqlens_q[0], case.seqlens_kv[0]
        shapes = ((b, s_q, h, d), (b, s_kv, h_kv, d), (b, s_kv, h_kv, d))
        cu = (None, None)
    else:
        shapes = ((sum(case.seqlens_q), h, d), (sum(case.seqlens_kv), h_kv, d), (sum(case.seqlens_kv), h_kv, d))
        cu = tuple(_cu_seqlens(lengths, device) for lengths in (case.seqlens_q, case.seqlens_kv))
    q, k, v = (torch.randn(shape, device=device).to(case.dtype) for shape in shapes)
    return q, k, v, cu


def _cu_seqlens(lengths, device) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int32, device=device).cumsum(0).to(torch.int32)


def _assert_close(actual, expected, dtype, what):
    norm = rel_err(expected, actual)
    peak = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert norm <= NORM_TOL[dtype] and peak <= MAX_TOL[dtype], f"{what}: relative error {norm:.2e}, max {peak:.2e}"


def _check_against_reference(case: Case, device: str, layout=None):
    """fwd output and dq, dk, dv of flagos vs the reference in float32 on the same values."""
    q, k, v, (cu_q, cu_kv) = _inputs(case, device)
    if layout is not None:
        q, k, v = (layout(t) for t in (q, k, v))
    config = case.config()
    out, ctx = flagos.fused_attn_fwd(q, k, v, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    dout = torch.randn_like(out)
    dq, dk, dv, dbias, doffset = flagos.fused_attn_bwd(dout, q, k, v, out, ctx, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
    ref_out, ref_ctx = reference.fused_attn_fwd(q32, k32, v32, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    ref = reference.fused_attn_bwd(dout32, q32, k32, v32, ref_out, ref_ctx, config, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert out.dtype == case.dtype and out.shape == q.shape and dbias is None and doffset is None
    for name, actual, expected in (("out", out, ref_out), ("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
        _assert_close(actual, expected, case.dtype, f"{name} of {case}")
    return q, out, dq


CPU_CASES = [
    # causal top-left, one multi-block square problem
    Case((37,), (37,), 2, 2, 32, torch.float16, "causal"),
    # no mask, GQA (2 kv heads, 2 query heads each), s_q != s_kv, bf16
    Case((23,), (40,), 4, 2, 16, torch.bfloat16),
    # bottom-right causal with s_q > s_kv: the first 23 rows see no key (O = 0, dQ = 0)
    Case((40,), (17,), 2, 1, 16, torch.float16, "causal_bottom_right"),
    # bottom-right causal with s_q < s_kv, MQA, bf16
    Case((17,), (40,), 2, 1, 16, torch.bfloat16, "causal_bottom_right"),
    # sliding window on both sides, narrower than a block
    Case((33,), (29,), 2, 2, 16, torch.float16, "no_mask", (5, 2)),
    # causal + left window (the usual sliding-window decoder), bf16, head dim 64
    Case((40,), (40,), 1, 1, 64, torch.bfloat16, "causal", (7, -1)),
    # packed sequences of different lengths, causal, MQA
    Case((17, 23), (17, 23), 2, 1, 16, torch.float16, "causal", qkv_format="thd"),
]

# Band-edge sweeps: packed sequences whose offsets s_kv - s_q (14, -2, 14, 15, -2, 31, -9) put the
# band's edges at every phase of a 16-wide block, where an off-by-one in the split between masked
# and unmasked blocks would show.
_SWEEP_Q, _SWEEP_KV = (33, 40, 18, 25, 37, 9, 40), (47, 38, 32, 40, 35, 40, 31)
CPU_CASES += [
    Case(_SWEEP_Q, _SWEEP_KV, 1, 1, 16, torch.float16, "causal_bottom_right", qkv_format="thd"),
    Case(_SWEEP_Q, _SWEEP_KV, 1, 1, 16, torch.float16, "no_mask", (20, 3), "thd"),
    Case(_SWEEP_Q, _SWEEP_KV, 1, 1, 16, torch.float16, "causal", (19, -1), "thd"),
]


@pytest.mark.parametrize("case", CPU_CASES,
                         ids=lambda c: f"{c.qkv_format}-{c.mask_type}-w{c.window}-{c.dtype}-d{c.head_dim}-h{c.heads}:{c.kv_heads}")
def test_matches_reference(case, device):
    _check_against_reference(case, device)


def test_sbhd_view_runs_without_copies(device):
    """q, k, v as bshd views of [s, b, h, d] tensors: out keeps that memory layout."""
    case = Case((29, 29), (29, 29), 2, 1, 16, torch.float16, "causal")
    q, out, dq = _check_against_reference(case, device, layout=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))
    assert out.stride() == q.stride() and dq.stride() == q.stride()


def test_thd_rows_outside_sequences_are_zero(device):
    """Rows past cu_seqlens[-1] belong to no sequence: output and gradients there are 0."""
    case = Case((17,), (17,), 2, 2, 16, torch.float16, "causal", qkv_format="thd")
    q, k, v, (cu_q, cu_kv) = _inputs(case, device)
    q, k, v = (torch.cat([t, torch.randn_like(t[:3])]) for t in (q, k, v))
    out, ctx = flagos.fused_attn_fwd(q, k, v, case.config(), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    dq, dk, dv, _, _ = flagos.fused_attn_bwd(torch.randn_like(out), q, k, v, out, ctx, case.config(), cu_seqlens_q=cu_q,
                                             cu_seqlens_kv=cu_kv)
    for t in (out, dq, dk, dv):
        assert t[17:].abs().max() == 0
        assert t[:17].abs().max() > 0


# -- what the kernel declines -------------------------------------------------------------------
def _small_qkv(device, d=64, dtype=torch.bfloat16):
    """q [2, 8, 4, d], k and v [2, 8, 2, d]: predicates only, no kernel runs."""
    q = torch.randn(2, 8, 4, d, device=device).to(dtype)
    return (q,) + tuple(torch.randn(2, 8, 2, d, device=device).to(dtype) for _ in range(2))


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(config=dict(dropout_p=0.1)), "dropout"),
        (dict(config=dict(softmax_type="learnable"), softmax_offset=(4,)), "softmax_offset"),
        (dict(config=dict(softmax_type="off-by-one")), "softmax_type"),
        (dict(config=dict(bias_type="post_scale_bias"), attn_bias=(1, 4, 8, 8)), "attn_bias"),
        (dict(config=dict(bias_type="alibi"), alibi_slopes=(4,)), "alibi_slopes"),
        (dict(attn_mask=(2, 1, 8, 8)), "attn_mask"),
        (dict(dtype=torch.float32), "float16"),
        (dict(d=96), "head dims"),
        (dict(d=256), "head dims"),
    ],
)
def test_supports_declines_unimplemented_features(change, words, device):
    q, k, v = _small_qkv(device, change.get("d", 64), change.get("dtype", torch.bfloat16))
    config = AttentionConfig(softmax_scale=0.125, **change.get("config", {}))
    names = ("attn_mask", "attn_bias", "softmax_offset", "alibi_slopes")
    extras = {name: torch.zeros(change[name], device=device) for name in names if name in change}
    verdict = flagos.SUPPORTS["fused_attn_fwd"](q, k, v, config, **extras)
    assert not verdict and words in verdict.reason
    with pytest.raises(NotImplementedError, match=words):
        flagos.fused_attn_fwd(q, k, v, config, **extras)


def test_supports_accepts_and_rejects_layouts(device):
    q, k, v = _small_qkv(device)
    supports = flagos.SUPPORTS["fused_attn_fwd"]
    config = AttentionConfig(softmax_scale=0.125, mask_type="causal")
    assert supports(q, k, v, config) is True
    assert "q and k the same head dim" in supports(q, k[..., :32], v[..., :32], config).reason
    assert "d_qk == d_v" in supports(q, k, v[..., :32], config).reason
    assert "multiple" in supports(q, k[:, :, :1].expand(2, 8, 3, 64), v[:, :, :1].expand(2, 8, 3, 64), config).reason
    thd = dataclasses.replace(config, qkv_format="thd")
    assert "cu_seqlens" in supports(q[0], k[0], v[0], thd).reason
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    assert "cu_seqlens" in supports(q, k, v, config, cu_seqlens_q=cu, cu_seqlens_kv=cu).reason
    with pytest.raises(ValueError, match="3-D"):
        flagos.fused_attn_fwd(q, k, v, thd, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    many = torch.zeros(16385, dtype=torch.int32, device=device)  # 16384 sequences x 4 heads > 65535 grid rows
    assert "grid" in supports(q[0], k[0], v[0], thd, cu_seqlens_q=many, cu_seqlens_kv=many).reason
    assert not flagos.SUPPORTS["fused_attn_bwd"](q, q, k, v, q, object(), config)
    with pytest.raises(TypeError, match="FlashAttnCtx"):
        flagos.fused_attn_bwd(q, q, k, v, q, object(), config)


@pytest.mark.parametrize("shapes, fmt, cu", [
    (((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64)), "thd", False),  # 4-D for thd
    (((2, 8, 4, 64), (2, 8, 2, 32), (2, 8, 2, 32)), "bshd", False),  # k's head dim
    (((2, 8, 3, 64), (2, 8, 2, 64), (2, 8, 2, 64)), "bshd", False),  # 3 query heads over 2 kv heads
    (((2, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)), "bshd", False),  # batch
    (((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64)), "bshd", True),  # cu_seqlens for bshd
    (((8, 4, 64), (8, 2, 64), (8, 2, 64)), "thd", False),  # no cu_seqlens for thd
])
def test_layout_errors_are_the_catalogs_and_the_references(shapes, fmt, cu, device):
    """One layout check for every backend (the catalog's): flagos declines with its reason and raises it as the
    reference does, word for word."""
    from transformer_engine.plugin.catalog.attention import attention_layout_error

    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16, device=device) for shape in shapes)
    config = AttentionConfig(softmax_scale=0.125, qkv_format=fmt)
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32, device=device)
    offsets = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens) if cu else {}
    error = attention_layout_error(q, k, v, config, **offsets)
    assert error
    assert flagos.SUPPORTS["fused_attn_fwd"](q, k, v, config, **offsets).reason == error
    for backend in (flagos, reference):
        with pytest.raises(ValueError) as raised:
            backend.fused_attn_fwd(q, k, v, config, **offsets)
        assert str(raised.value) == error


def test_int64_offsets_are_declined_and_run_by_the_reference(device):
    """The kernels read int32 offsets: int64 ones are a case for another backend (not a layout error)."""
    case = Case((5, 3), (5, 3), 2, 2, 16, torch.float16, "causal", qkv_format="thd")
    q, k, v, (cu_q, cu_kv) = _inputs(case, device)
    verdict = flagos.SUPPORTS["fused_attn_fwd"](q, k, v, case.config(), cu_seqlens_q=cu_q.long(), cu_seqlens_kv=cu_kv.long())
    assert not verdict and "int32" in verdict.reason
    with pytest.raises(NotImplementedError, match="int32"):
        flagos.fused_attn_fwd(q, k, v, case.config(), cu_seqlens_q=cu_q.long(), cu_seqlens_kv=cu_kv.long())
    out, _ = reference.fused_attn_fwd(q, k, v, case.config(), cu_seqlens_q=cu_q.long(), cu_seqlens_kv=cu_kv.long())
    assert out.shape == q.shape


def test_autotune_pruning_predicate(monkeypatch):
    """Configs whose fp32 accumulators exceed the register budget or whose tiles exceed shared memory go."""
    import triton

    def config(m, n, warps, stages):
        return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)

    from transformer_engine.plugin.backends.flagos import _attention_tuning as tuning

    dkdv, fwd, h100 = tuning._DKDV_FOOTPRINT, tuning._FWD_FOOTPRINT, 227 * 1024
    assert dkdv.fits(config(32, 128, 4, 3), 32, h100) and not dkdv.fits(config(32, 128, 4, 3), 128, h100)
    assert dkdv.fits(config(32, 128, 8, 3), 128, h100)
    assert fwd.fits(config(128, 64, 8, 3), 128, h100) and not fwd.fits(config(128, 64, 8, 3), 128, 99 * 1024)
    monkeypatch.setattr(tuning, "_shared_memory_bytes", lambda index: 99 * 1024)
    prune = fwd.pruner()["early_config_prune"]
    candidates = [config(64, 64, 4, 2), config(128, 128, 8, 4)]
    assert prune(candidates, {"Q": torch.empty(1)}, HEAD_DIM=128) == candidates[:1]
    assert prune(candidates[1:], {"Q": torch.empty(1)}, HEAD_DIM=128) == candidates[1:]  # none fits: keep the last


def test_declines_cpu_without_interpreter(monkeypatch):
    q, k, v = _small_qkv("cpu")
    monkeypatch.setattr(flagos, "INTERPRET", False)
    verdict = flagos.SUPPORTS["fused_attn_fwd"](q, k, v, AttentionConfig(softmax_scale=0.125))
    assert not verdict and "TRITON_INTERPRET" in verdict.reason


def test_dispatch_passes_declined_calls_to_reference(device):
    """Through a manager: an attn_mask call is declined by flagos and served by the reference."""
    registry = OpRegistry()
    caps = Capabilities(device_types={device})
    registry.register_many(impls_from_modules([flagos], "flagos.triton", BackendImplKind.DEFAULT, caps))
    registry.register_many(impls_from_modules([reference], "reference.torch", BackendImplKind.REFERENCE, caps))
    manager = OpManager(registry, load_builtins=False, discover=False)
    q, k, v = (torch.randn(1, 5, 2, 16, device=device).to(torch.float16) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool, device=device)
    (out, ctx), impl = manager.call_traced("fused_attn_fwd", q, k, v, AttentionConfig(softmax_scale=0.25), attn_mask=mask)
    assert impl.impl_id == "reference.torch" and out.shape == q.shape
    decisions = manager.explain("fused_attn_fwd", q, k, v, AttentionConfig(softmax_scale=0.25), attn_mask=mask)
    assert any("attn_mask" in (d.reason or "") for d in decisions)


# -- GPU: real shapes, compiled and autotuned kernels -------------------------------------------
GPU_CASES = [
    Case((1024, 1024), (1024, 1024), 16, 4, 128, torch.bfloat16, "causal"),
    Case((777,), (1031,), 8, 8, 64, torch.float16),
    Case((1000,), (1000,), 8, 2, 128, torch.bfloat16, "causal", (255, -1)),
    Case((300, 1024, 77), (300, 1024, 77), 8, 1, 128, torch.bfloat16, "causal", qkv_format="thd"),
    Case((512,), (2048,), 4, 4, 32, torch.float16, "causal_bottom_right"),
    Case((256,), (256,), 4, 4, 16, torch.bfloat16, "no_mask", (31, 31)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.qkv_format}-{c.mask_type}-w{c.window}-{c.dtype}-d{c.head_dim}")
def test_matches_reference_gpu(case):
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_sbhd_view_gpu():
    case = Case((512, 512), (512, 512), 8, 8, 128, torch.bfloat16, "causal")
    q, out, _ = _check_against_reference(case, "cuda", layout=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))
    assert out.stride() == q.stride()
