"""vendor.cuda attention blocks (PyTorch's cuDNN and FlashAttention-2 SDPA kernels).

On CPU: what the SUPPORTS predicate declines and why, and which kernel runs a block. On a GPU, for each kernel, bf16 against the reference
backend's float32
math on the same inputs: the block's O and lse, blocks over split keys merged and their backward shares summed
(against the reference fused attention, GQA, both head dims the ring meets), the causal diagonal block, and the
dropout identity sum(dV * V) = sum(dO * O) with the forward's mask regenerated. Tolerance: bf16 keeps 8 bits, so
O(1) outputs differ by ~4e-3 per rounding; the kernel rounds P before P V and its outputs once more, the merge
rescales them: atol 2e-2 on outputs, 4x that on gradients (sums of products of rounded terms), as the fused
attention tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.plugin.backends.reference.test_attention_block import check_split_keys
from tests.utils import randn
from transformer_engine.plugin.backends.reference import attention_block as reference
from transformer_engine.plugin.backends.vendor.cuda import attention_block as blocks
from transformer_engine.plugin.catalog.attention import AttentionConfig

CONFIG = AttentionConfig(softmax_scale=0.125)


def _qkv(s_q=64, s_kv=64, h=8, h_kv=2, d=64, dtype=torch.bfloat16, device="cpu"):
    return (randn(2, s_q, h, d, dtype=dtype, device=device), randn(2, s_kv, h_kv, d, dtype=dtype, device=device),
            randn(2, s_kv, h_kv, d, dtype=dtype, device=device))


@pytest.mark.parametrize("config, kwargs, extra, reason", [
    (CONFIG, {}, {}, "not on a CUDA device"),
    (dataclasses.replace(CONFIG, window_size=(4, 0)), {}, {}, "no window"),
    (dataclasses.replace(CONFIG, bias_type="post_scale_bias"), {}, {}, "no bias"),
    (CONFIG, {}, dict(attn_mask=torch.zeros(64, 64, dtype=torch.bool)), "attn_mask"),
    (dataclasses.replace(CONFIG, mask_type="causal_bottom_right"), dict(s_kv=32), {}, "no key"),
    (CONFIG, dict(s_q=0), {}, "non-empty"),
])
def test_declines_with_the_reason(config, kwargs, extra, reason):
    q, k, v = _qkv(**kwargs)
    verdict = blocks._supports_fwd(q, k, v, config, **extra)
    assert not verdict and reason in verdict.reason


H100 = blocks._Device((9, 0), 91000)


@pytest.mark.parametrize("dtype, s_q, s_kv, mask_type, device, expected", [
    (torch.bfloat16, 64, 64, "causal", H100, "cudnn"),
    (torch.bfloat16, 32, 64, "causal", H100, "cudnn"),  # cuDNN's flag is top-left
    (torch.bfloat16, 32, 64, "causal_bottom_right", H100, "flash"),  # flash's is bottom-right
    (torch.bfloat16, 64, 64, "causal", blocks._Device((9, 0), 0), "flash"),  # no cuDNN
    (torch.bfloat16, 32, 64, "causal", blocks._Device((9, 0), 0), ""),  # flash cannot align it top-left
    (torch.float32, 64, 64, "no_mask", H100, ""),
])
def test_kernel_choice(dtype, s_q, s_kv, mask_type, device, expected):
    kernel, reason = blocks.block_kernel(blocks._Call(dtype, s_q, s_kv, 64, 64, mask_type, has_mask=False, has_bias=False), device)
    assert kernel == expected and bool(reason) == (not expected)


def test_backward_takes_only_its_own_ctx():
    q, k, v = _qkv(dtype=torch.float32)
    out, lse, ref_ctx = reference.attention_block_fwd(q, k, v, CONFIG)
    assert not blocks._supports_bwd(out, q, k, v, out, lse, ref_ctx, CONFIG)


GPU_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(params=["cudnn", "flash"])
def kernel(request, monkeypatch):
    """The blocks of the test on one kernel (skipped where it cannot run them)."""
    monkeypatch.setattr(blocks, "_BLOCK_KERNELS", tuple(k for k in blocks._BLOCK_KERNELS if k.name == request.param))
    blocks.block_kernel.cache_clear()
    yield request.param
    blocks.block_kernel.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_block_matches_reference_on_gpu(kernel, d, mask_type):
    q, k, v = _qkv(s_q=96, s_kv=96, d=d, device="cuda")
    config = dataclasses.replace(CONFIG, mask_type=mask_type)
    if not blocks._supports_fwd(q, k, v, config):
        pytest.skip(f"{kernel} cannot run it here: {blocks._supports_fwd(q, k, v, config).reason}")
    out, lse, ctx = blocks.attention_block_fwd(q, k, v, config)
    assert ctx.kernel == kernel
    ref_out, ref_lse, ref_ctx = reference.attention_block_fwd(q, k, v, config)
    torch.testing.assert_close(out.float(), ref_out.float(), **GPU_TOL)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)  # float32 sums of the same bf16 products
    dout = randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    got = blocks.attention_block_bwd(dout, q, k, v, out, lse, ctx, config)
    want = reference.attention_block_bwd(dout, q, k, v, out, lse, ref_ctx, config)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=8e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_split_keys_merge_to_the_whole_on_gpu(kernel, d):
    q, k, v = _qkv(s_q=80, s_kv=160, d=d, device="cuda")
    check_split_keys(blocks.attention_block_fwd, blocks.attention_block_bwd, q, k, v, CONFIG, cut=64, tol=dict(atol=8e-2, rtol=2e-2))


@pytest.mark.gpu
def test_dropout_backward_regenerates_the_forward_mask_on_gpu(kernel):
    q, k, v = _qkv(device="cuda")
    config = dataclasses.replace(CONFIG, dropout_p=0.3)
    out, lse, ctx = blocks.attention_block_fwd(q, k, v, config)
    dout = randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    _, _, dv, _ = blocks.attention_block_bwd(dout, q, k, v, out, lse, ctx, config)
    lhs, rhs = (dv.float() * v.float()).sum(), (dout.float() * out.float()).sum()
    torch.testing.assert_close(lhs, rhs, atol=0.5, rtol=2e-2)  # sums of 2 * 64 * 8 * 64 bf16 products
