"""Plugins written the way upstream TE-FL's examples are load and run unchanged.

The fixture plugin (_upstream_style_plugin.py) registers upstream signatures; these tests load it
through TE_FL_PLUGIN_MODULES and through an entry point, and check that the ops (and a module) run
through it, match the reference backend, and decline what it cannot serve with a reason.
"""

import importlib
import warnings

import torch

import transformer_engine.pytorch as te
from transformer_engine.plugin import ops
from transformer_engine.plugin.compat import UpstreamCompatWarning
from transformer_engine.plugin.core import (
    OpManager,
    get_default_manager,
    reset_default_manager,
    reset_global_policy,
)

IMPL = "vendor.upstreamstyle"


def _load(monkeypatch, **env):
    """Reload the default manager with the fixture plugin listed in TE_FL_PLUGIN_MODULES (and ``env``)."""
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "_upstream_style_plugin")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reset_global_policy()
    reset_default_manager()
    plugin = importlib.import_module("_upstream_style_plugin")
    plugin.CALLS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_default_manager().ensure_initialized()
    return plugin, caught


def _reference(op, *args, **kwargs):
    return get_default_manager().call_impl(op, "reference.torch", *args, **kwargs)


def test_env_module_registers_adapted_ops_and_warns_about_missing_one(monkeypatch):
    plugin, caught = _load(monkeypatch)
    registry = get_default_manager().registry
    assert {op for op in ("rmsnorm_fwd", "gelu", "dgelu") if registry.get_implementation(op, IMPL)} == {"rmsnorm_fwd", "gelu", "dgelu"}
    messages = [str(w.message) for w in caught if issubclass(w.category, UpstreamCompatWarning)]
    assert len(messages) == 1 and "get_cudnn_version" in messages[0] and "no equivalent" in messages[0]
    record = [r for r in get_default_manager().plugin_records if r.source == "env"]
    assert record[0].ok and record[0].impl_ids == [IMPL]


def test_ops_run_through_plugin_and_match_reference(monkeypatch):
    plugin, _ = _load(monkeypatch, TE_FL_PREFER="vendor")
    x, w, dy = torch.randn(5, 24), torch.randn(24), torch.randn(5, 24)
    y, rstd, scale_inv, amax = ops.rmsnorm_fwd(x, w, 1e-5)
    ref = _reference("rmsnorm_fwd", x, w, 1e-5)
    torch.testing.assert_close(y, ref[0], rtol=1e-5, atol=1e-6)  # fp32 math on both sides
    torch.testing.assert_close(rstd, ref[1], rtol=1e-5, atol=1e-6)
    assert scale_inv is None and amax is None
    torch.testing.assert_close(ops.gelu(x), _reference("gelu", x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.dgelu(dy, x), _reference("dgelu", dy, x), rtol=1e-5, atol=1e-6)
    assert plugin.CALLS == {"rmsnorm_fwd": 1, "gelu": 1, "dgelu": 1}


def test_module_runs_through_plugin(monkeypatch):
    plugin, _ = _load(monkeypatch, TE_FL_PER_OP="rmsnorm_fwd=vendor:upstreamstyle")
    torch.manual_seed(0)
    norm = te.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 32)
    y = norm(x)
    assert plugin.CALLS["rmsnorm_fwd"] >= 1
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_declines_with_reason(monkeypatch):
    plugin, _ = _load(monkeypatch, TE_FL_PREFER="vendor")
    x, w = torch.randn(4, 8), torch.randn(8)
    # zero_centered_gamma would be swallowed by the plugin's **kwargs: declined, reference serves it
    decision = {d.impl_id: d for d in get_default_manager().explain("rmsnorm_fwd", x, w, 1e-5, zero_centered_gamma=True)}[IMPL]
    assert decision.status == "rejected" and "zero_centered_gamma" in decision.reason
    y = ops.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma=True)[0]
    torch.testing.assert_close(y, _reference("rmsnorm_fwd", x, w, 1e-5, zero_centered_gamma=True)[0])
    # FP8 output: declined
    fp8 = get_default_manager().explain("rmsnorm_fwd", x, w, 1e-5, zero_centered_gamma=False, fp8_scale=torch.ones(1),
                                        fp8_dtype=torch.float8_e4m3fn)
    assert "FP8 output" in {d.impl_id: d for d in fp8}[IMPL].reason
    # supported_dtypes={"float32", "bfloat16"}: float64 goes elsewhere
    f64 = {d.impl_id: d for d in get_default_manager().explain("gelu", x.double())}[IMPL]
    assert f64.status == "rejected" and "float64" in f64.reason
    assert plugin.CALLS["rmsnorm_fwd"] == 0


def test_entry_point(monkeypatch, tmp_path):
    info = tmp_path / "upstream_style_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: upstream-style-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[te_fl.plugin]\nupstreamstyle = _upstream_style_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TE_FL_PER_OP", "gelu=vendor:upstreamstyle")
    reset_global_policy()
    plugin = importlib.import_module("_upstream_style_plugin")
    plugin.CALLS.clear()
    manager = OpManager(load_builtins=True, discover=True)
    x = torch.randn(7)
    torch.testing.assert_close(manager.call("gelu", x), manager.call_impl("gelu", "reference.torch", x))
    assert plugin.CALLS["gelu"] == 1
    records = [r for r in manager.plugin_records if r.source == "entry_point"]
    assert [(r.name, r.ok) for r in records] == [("upstreamstyle", True)]
