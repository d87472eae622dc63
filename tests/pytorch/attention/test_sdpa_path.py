"""DotProductAttention runs a call as PyTorch's SDPA (its own autograd node, no ``_FusedAttnFunc``) exactly when SDPA
expresses it (no bias, window, extra mask or softmax offset; square when causal) and the policy's first choices for
``fused_attn_fwd`` and ``fused_attn_bwd`` declare themselves SDPA's kernels (``OpImpl.aten_dtypes``, as vendor.cuda's
do on CUDA); a test backend declares the reference attention so on the CPU. Either path gives the same results."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import autograd_node_names, dtype_tols, randn
from transformer_engine.plugin import BackendImplKind, Capabilities, OpImpl, get_default_manager
from transformer_engine.plugin.backends.reference import attention as reference
from transformer_engine.plugin.core import with_preference

TEST_ID = "vendor.test_sdpa"
H, D = 4, 16


@pytest.fixture
def sdpa_attention():
    """The reference attention ops registered ahead of the reference backend, declared as SDPA's kernels for the CPU."""
    manager = get_default_manager()
    manager.ensure_initialized()
    impls = [OpImpl(name, TEST_ID, BackendImplKind.VENDOR, getattr(reference, name), vendor="test_sdpa",
                    capabilities=Capabilities(device_types=frozenset({"cpu"})), supports=reference.SUPPORTS.get(name),
                    aten_dtypes=frozenset({"float32", "bfloat16"}))
             for name in ("fused_attn_fwd", "fused_attn_bwd")]
    manager.registry.register_many(impls)
    yield impls
    for impl in impls:
        manager.registry.unregister(impl.op_name, TEST_ID)


def _step(dpa, q, k, v, dy, **kwargs):
    """(out, dq, dk, dv, autograd node names)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dpa(*leaves, **kwargs)
    out.backward(dy)
    return (out.detach(), *(t.grad for t in leaves)), autograd_node_names(out)


def _uses_function(names: set) -> bool:
    return "_FusedAttnFuncBackward" in names


def _inputs(s_q=6, s_kv=6, heads_kv=H, dtype=torch.float32, fmt="sbhd"):
    shape = (lambda s, h: (s, 2, h, D)) if fmt == "sbhd" else (lambda s, h: (2, s, h, D))
    q, k, v = randn(*shape(s_q, H), dtype=dtype), randn(*shape(s_kv, heads_kv), dtype=dtype), randn(*shape(s_kv, heads_kv), dtype=dtype)
    return q, k, v, randn(*shape(s_q, H)[:-2], H * D, dtype=dtype)


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("heads_kv, dtype", [(H, torch.float32), (2, torch.float32), (H, torch.bfloat16)])
def test_sdpa_path_equals_the_function(sdpa_attention, mask_type, fmt, heads_kv, dtype):
    q, k, v, dy = _inputs(heads_kv=heads_kv, dtype=dtype, fmt=fmt)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=heads_kv, qkv_format=fmt, attn_mask_type=mask_type)
    got, names = _step(dpa, q, k, v, dy)
    assert not _uses_function(names)
    for impl in sdpa_attention:
        get_default_manager().registry.unregister(impl.op_name, TEST_ID)
    want, names = _step(dpa, q, k, v, dy)
    get_default_manager().registry.register_many(sdpa_attention)
    assert _uses_function(names)
    # two bf16 computations against each other: PyTorch's CPU kernel rounds P to bf16 before P V, the reference keeps
    # float32, so an output near 0 differs by some ulps of the (O(1)) values summed into it
    tols = dtype_tols(dtype) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tols)


@pytest.mark.parametrize("case", ["non_square_causal", "padding_mask", "window", "bias", "backward_not_sdpa"])
def test_what_sdpa_does_not_express_keeps_the_function(sdpa_attention, case):
    s_kv = 8 if case == "non_square_causal" else 6
    q, k, v, dy = _inputs(s_kv=s_kv)
    kwargs, module_kwargs = {}, {}
    if case == "padding_mask":
        module_kwargs["attn_mask_type"] = "padding"
        kwargs["attention_mask"] = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    elif case == "window":
        module_kwargs.update(attn_mask_type="causal", window_size=(2, 0))
    elif case == "bias":
        kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=randn(1, H, 6, 6))
    elif case == "backward_not_sdpa":
        get_default_manager().registry.unregister("fused_attn_bwd", TEST_ID)
    try:
        _, names = _step(te.DotProductAttention(H, D, **module_kwargs), q, k, v, dy, **kwargs)
    finally:
        if case == "backward_not_sdpa":
            get_default_manager().registry.register(sdpa_attention[1])
    assert _uses_function(names)


def test_reference_backend_keeps_the_function():
    q, k, v, dy = _inputs()
    _, names = _step(te.DotProductAttention(H, D), q, k, v, dy)
    assert _uses_function(names)


def test_sdpa_path_in_a_transformer_layer_with_checkpointed_attention(sdpa_attention):
    """te.TransformerLayer (bf16, no dropout) with its core attention recomputed in backward: SDPA's node, the same
    gradients as without recomputation."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    x, dy = randn(6, 2, 32), randn(6, 2, 32)
    grads = []
    for recompute in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = layer(xi, checkpoint_core_attention=recompute)
        assert "ScaledDotProductFlashAttentionForCpuBackward0" in autograd_node_names(out) or recompute
        out.backward(dy)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **dtype_tols(torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads_kv", [H, 2])
def test_cuda_policy_runs_sdpa(heads_kv):
    """Under the default CUDA policy a causal bf16 call runs as SDPA's node (vendor.cuda's kernels are SDPA's); it agrees
    with the reference backend's Function (``with_preference("reference")``) to bf16 tolerances."""
    torch.manual_seed(0)
    q, k, v, dy = (t.cuda() for t in _inputs(s_q=128, s_kv=128, heads_kv=heads_kv, dtype=torch.bfloat16))
    dpa = te.DotProductAttention(H, D, num_gqa_groups=heads_kv)
    got, names = _step(dpa, q, k, v, dy)
    assert not _uses_function(names) and any(name.startswith("ScaledDotProduct") for name in names), names
    with with_preference("reference"):
        want, names = _step(dpa, q, k, v, dy)
    assert _uses_function(names)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)
