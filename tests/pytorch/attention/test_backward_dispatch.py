"""DotProductAttention's backward reaches the backend that ran its forward, through ``ops.fused_attn_bwd`` alone.

The forward's context is opaque and backend-specific: every implementation of ``fused_attn_bwd`` declines (its
``supports`` predicate) a context its own forward did not make, so the dispatcher passes the call on until the
forward's backend takes it, whatever policy is in force when the backward runs (strict mode included, where a
declined call is not an error). A fake vendor backend, registered in the default manager for one test, records
which implementation ran; the flagos kernels (Triton's interpreter on a CPU) are the real case.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.plugin import get_default_manager
from transformer_engine.plugin.backends.reference import attention as reference
from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.core import BackendImplKind, Capabilities, OpImpl, Reject, with_preference, with_strict_mode

H, D = 2, 16
FAKE_ID = "vendor.tefltestattn"


@dataclass(frozen=True)
class _FakeCtx:
    """The fake backend's own context: the reference context inside, for the math."""

    inner: object


def _fake_impls(calls: list):
    """fused_attn_fwd / fused_attn_bwd of a vendor backend that wraps the reference math and logs its calls."""

    def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                       cu_seqlens_q=None, cu_seqlens_kv=None):
        calls.append("fwd")
        out, ctx = reference.fused_attn_fwd(q, k, v, config, attn_mask, attn_bias, softmax_offset, alibi_slopes, cu_seqlens_q,
                                            cu_seqlens_kv)
        return out, _FakeCtx(ctx)

    def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                       cu_seqlens_q=None, cu_seqlens_kv=None):
        calls.append("bwd")
        return reference.fused_attn_bwd(dout, q, k, v, out, ctx.inner, config, attn_mask, attn_bias, softmax_offset,
                                        alibi_slopes, cu_seqlens_q, cu_seqlens_kv)

    def supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                     cu_seqlens_q=None, cu_seqlens_kv=None):
        return True if isinstance(ctx, _FakeCtx) else Reject("ctx was not made by the test backend")

    common = dict(impl_id=FAKE_ID, kind=BackendImplKind.VENDOR, vendor="tefltestattn")
    return [OpImpl(op_name="fused_attn_fwd", fn=fused_attn_fwd, **common),
            OpImpl(op_name="fused_attn_bwd", fn=fused_attn_bwd, supports=supports_bwd, **common)]


@pytest.fixture
def fake_backend():
    """The fake backend registered in the default manager for one test; the list of its calls."""
    manager = get_default_manager()
    manager.ensure_initialized()
    calls: list = []
    manager.registry.register_many(_fake_impls(calls))
    try:
        yield calls
    finally:
        manager.registry.unregister_backend(FAKE_ID)


def _inputs(dtype=torch.float32, s=6):
    return [randn(1, s, H, D, dtype=dtype).requires_grad_(requires_grad=True) for _ in range(3)]


@contextlib.contextmanager
def _policy(prefer: str, strict: bool = False):
    """The scoped policy: ``prefer`` first, strict (no fallback after an error) or not."""
    with with_preference(prefer), with_strict_mode(strict):
        yield


def _grads(dpa, inputs, forward_policy, backward_policy):
    """(out, dq, dk, dv) with the forward run under ``forward_policy`` and the backward under ``backward_policy``
    (each a (prefer, strict) pair)."""
    with _policy(*forward_policy):
        out = dpa(*inputs)
    with _policy(*backward_policy):
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    return (out, *grads)


@pytest.mark.parametrize("strict", [False, True])
def test_backward_runs_on_the_forwards_backend_whatever_the_policy_prefers(fake_backend, strict):
    """Forward on the fake (prefer="vendor"), backward under prefer="reference": the reference (and flagos) decline the
    fake's context, so the fake runs the backward, also in strict mode."""
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    inputs = _inputs()
    got = _grads(dpa, inputs, ("vendor", False), ("reference", strict))
    assert fake_backend == ["fwd", "bwd"], "the backward must run on the backend that made the forward's context"
    want = _grads(dpa, inputs, ("reference", False), ("reference", False))  # the fake runs the reference math
    assert fake_backend == ["fwd", "bwd"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("strict", [False, True])
def test_another_backends_context_is_passed_over_by_the_first_candidate(fake_backend, strict):
    """The converse: the backward of a reference forward under prefer="vendor" passes over the fake (first in that
    order), which declines the reference's context, and runs on the reference."""
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    inputs = _inputs()
    got = _grads(dpa, inputs, ("reference", False), ("vendor", strict))
    assert fake_backend == []
    want = _grads(dpa, inputs, ("reference", False), ("reference", False))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _interpreted_flagos_attention():
    """The flagos attention module when its kernels run in Triton's interpreter here (the root conftest imports them
    so on a machine without a GPU), else None."""
    try:
        from transformer_engine.plugin.backends.flagos import attention as flagos
    except Exception:  # noqa: BLE001 - no triton, or the kernels failed to load: nothing to test
        return None
    return flagos if flagos.INTERPRET else None


@pytest.fixture
def flagos_on_cpu(monkeypatch):
    """The flagos attention kernels registered in the default manager for CPU tensors (Triton's interpreter), whatever
    TRITON_INTERPRET said when the manager registered its backends."""
    flagos = _interpreted_flagos_attention()
    if flagos is None:
        pytest.skip("the flagos kernels were not imported for Triton's interpreter (needs triton, no GPU)")
    from transformer_engine.plugin.backends._registration import impls_from_modules

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton also reads it when a kernel launches
    manager = get_default_manager()
    manager.ensure_initialized()
    impl_id = "flagos.tefltestcpu"
    manager.registry.register_many(impls_from_modules([flagos], impl_id, BackendImplKind.DEFAULT, Capabilities(device_types={"cpu"})))
    try:
        yield impl_id
    finally:
        manager.registry.unregister_backend(impl_id)


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("strict", [False, True])
def test_flagos_forward_gets_the_flagos_backward_under_a_reference_policy(flagos_on_cpu, strict):
    """fp16 causal attention runs on flagos; its backward under prefer="reference" still runs the flagos kernels (the
    reference declines the FlashAttnCtx): the same gradients, bit for bit, as a backward under prefer="flagos"."""
    dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    inputs = _inputs(torch.float16, s=17)
    q, k, v = (t.detach() for t in inputs)
    with _policy("flagos"):
        decisions = get_default_manager().explain("fused_attn_fwd", q, k, v, AttentionConfig(softmax_scale=D**-0.5, mask_type="causal"))
    assert [d.kind for d in decisions if d.status == "selected"] == ["flagos"]
    got = _grads(dpa, inputs, ("flagos", False), ("reference", strict))
    want = _grads(dpa, inputs, ("flagos", False), ("flagos", False))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    reference_grads = _grads(dpa, inputs, ("reference", False), ("reference", False))
    assert any(not torch.equal(g, r) for g, r in zip(got[1:], reference_grads[1:])), "the flagos kernels should round differently"
