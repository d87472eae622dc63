"""The upstream TE-FL API surface: example-script names, OpImpl fields, variables and the op adapters."""

import warnings

import pytest
import torch

from transformer_engine.plugin.compat import porting_table
from transformer_engine.plugin.core import (
    BackendImplKind,
    OpImpl,
    OpManager,
    OpRegistry,
    PolicyConfigWarning,
    SelectionPolicy,
    get_manager,
    get_registry,
    load_env,
    set_global_policy,
)
from transformer_engine.plugin.core.devices import register_capability_probe


def _manager(*impls):
    registry = OpRegistry()
    for impl in impls:
        registry.register_impl(impl)
    return OpManager(registry, load_builtins=True, discover=False)


def _vendor(op, fn, **fields):
    return OpImpl(op_name=op, impl_id="vendor.up", kind=BackendImplKind.VENDOR, vendor="up", fn=fn, priority=200, **fields)


def test_intree_example_structure():
    """Upstream's example_intree.py: OpRegistry + register_impl + OpManager(registry) + set_global_policy + call."""
    def my_rmsnorm_fwd(input, weight, eps=1e-5, **kwargs):
        variance = input.pow(2).mean(-1, keepdim=True)
        return input * torch.rsqrt(variance + eps) * weight, torch.rsqrt(variance + eps)

    my_rmsnorm_fwd._is_available = lambda: True
    registry = OpRegistry()
    registry.register_impl(_vendor("rmsnorm_fwd", my_rmsnorm_fwd))
    manager = OpManager(registry)
    set_global_policy(SelectionPolicy(prefer="vendor"))
    x, w = torch.randn(2, 4, 8), torch.ones(8)
    y, rstd, _, _ = manager.call("rmsnorm_fwd", x, w, eps=1e-5)
    assert y.shape == (2, 4, 8) and rstd.shape == (8,)
    assert manager.select("rmsnorm_fwd", x, w, 1e-5).impl_id == "vendor.up"


def test_get_manager_call_returns_upstream_result(monkeypatch):
    """Upstream's example_outtree.py: get_manager().call returns the upstream function's own result."""
    def my_rmsnorm_fwd(input, weight, eps=1e-5, **kwargs):
        rsigma = torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + eps)
        return input * rsigma * weight, rsigma

    get_registry().register_impl(_vendor("rmsnorm_fwd", my_rmsnorm_fwd))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        set_global_policy(SelectionPolicy(prefer="vendor"))
    output, rsigma = get_manager().call("rmsnorm_fwd", torch.randn(2, 4, 8), torch.ones(8), eps=1e-5)
    assert output.shape == (2, 4, 8) and rsigma.shape == (2, 4, 1)


def test_is_available_false_passes_impl_over():
    def relu(input, quantizer):
        raise AssertionError("must not run")

    relu._is_available = lambda: False
    manager = _manager(_vendor("relu", relu))
    x = torch.randn(3)
    decision = {d.impl_id: d for d in manager.explain("relu", x)}["vendor.up"]
    assert decision.status == "rejected" and "_is_available" in decision.reason
    torch.testing.assert_close(manager.call("relu", x), torch.relu(x))


def test_min_arch_is_honoured():
    register_capability_probe("cpu", lambda index: (8, 0))
    try:
        impl = _vendor("relu", lambda input, quantizer: input.clamp_min(0), min_arch="sm_90")
        assert impl.capabilities.min_compute_capability == (9, 0)
        manager = _manager(impl)
        decision = {d.impl_id: d for d in manager.explain("relu", torch.randn(2))}["vendor.up"]
        assert decision.status == "rejected" and "9.0" in decision.reason
    finally:
        register_capability_probe("cpu", lambda index: None)


@pytest.mark.parametrize("odd", [1, 7, 33])
def test_layernorm_softmax_amax_gemm_adapters(odd):
    def ln_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
        mu = input.mean(-1)
        rsigma = torch.rsqrt(input.var(-1, unbiased=False) + eps)
        g = weight + 1 if zero_centered_gamma else weight
        return (input - mu[..., None]) * rsigma[..., None] * g + bias, mu, rsigma

    def sm_fwd(input, scale):
        return torch.softmax(input * scale, -1)

    def amax(input, amax):
        amax.copy_(input.abs().max().reshape(1))

    def gemm(A, transA, B, transB, D, quantizer, output_dtype, bias, bias_type, gelu, gelu_in, grad,
             workspace, workspace_size, accumulate, use_split_accumulator):
        a = A.t() if transA else A
        b = B.t() if transB else B
        out = b @ a  # column-major TE: row-major D = op(B) @ op(A)
        return (out if bias is None else out + bias), None, None, None

    manager = _manager(_vendor("layernorm_fwd", ln_fwd), _vendor("scaled_softmax_forward", sm_fwd),
                       _vendor("compute_amax", amax), _vendor("generic_gemm", gemm))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = lambda op, *a, **k: manager.call_impl(op, "reference.torch", *a, **k)  # noqa: E731
        from transformer_engine.plugin.core import with_preference
        with with_preference("vendor"):
            x, w, b = torch.randn(odd, 16), torch.randn(16), torch.randn(16)
            for got, want in zip(manager.call("layernorm_fwd", x, w, b, 1e-5, zero_centered_gamma=True),
                                 ref("layernorm_fwd", x, w, b, 1e-5, zero_centered_gamma=True)):
                if want is None:
                    assert got is None
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(manager.call("scaled_softmax_forward", x, 0.5), ref("scaled_softmax_forward", x, 0.5))
            torch.testing.assert_close(manager.call("compute_amax", x), ref("compute_amax", x))
            a, m = torch.randn(odd, 16), torch.randn(5, 16)
            for kwargs in ({"trans_b": True}, {"trans_b": True, "bias": torch.randn(5)}):
                torch.testing.assert_close(manager.call("gemm", a, m, **kwargs), ref("gemm", a, m, **kwargs), rtol=1e-5, atol=1e-5)
            dy = torch.randn(odd, 5)  # wgrad: dW = dy^T @ x; dgrad: dx = dy @ W
            torch.testing.assert_close(manager.call("gemm", dy, a, trans_a=True), ref("gemm", dy, a, trans_a=True), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(manager.call("gemm", dy, m), ref("gemm", dy, m), rtol=1e-5, atol=1e-5)
            assert manager.select("gemm", a, m, trans_b=True).impl_id == "vendor.up"
            fp8 = {d.impl_id: d for d in manager.explain("gemm", a, m, None, torch.ones(1), torch.ones(1))}["vendor.up"]
            assert fp8.status == "rejected" and "FP8" in fp8.reason


def test_prefer_vendor_and_skip_cuda(monkeypatch):
    monkeypatch.setenv("TE_FL_PREFER_VENDOR", "1")
    assert load_env().prefer == "vendor"
    monkeypatch.setenv("TE_FL_PREFER", "reference")
    with pytest.warns(PolicyConfigWarning, match="TE_FL_PREFER_VENDOR"):
        assert load_env().prefer == "reference"
    monkeypatch.setenv("TE_FL_SKIP_CUDA", "1")
    manager = OpManager(discover=False)
    manager.ensure_initialized()
    cuda = [r for r in manager.plugin_records if r.name.endswith("vendor.cuda")]
    assert cuda[0].error == "skipped: TE_FL_SKIP_CUDA=1"
    assert not any(i.startswith("vendor.cuda") for i in manager.registry.impl_ids())


def test_porting_table_covers_adapted_and_missing():
    rows = {r["upstream"]: r for r in porting_table()}
    assert rows["rmsnorm_fwd"]["status"] == "adapted" and rows["generic_gemm"]["ours"] == "gemm"
    assert rows["multi_tensor_scale"]["status"] == "same"
    assert rows["get_cudnn_version"]["status"] == "missing" and rows["get_cudnn_version"]["note"]
