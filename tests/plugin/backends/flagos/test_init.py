"""The flagos backend's registration: ids, kinds, capabilities, dispatch and the missing-triton path."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin.backends import flagos
from transformer_engine.plugin.backends import reference
from transformer_engine.plugin.backends.reference import activation as ref_activation
from transformer_engine.plugin.core import BackendImplKind, OpManager, OpRegistry

_FAMILY_OPS = {
    "activation": 26, "delayed_scaling": 3, "misc": 6, "normalization": 4, "optimizer": 3, "quantization": 8,
    "quantization_blockwise": 3, "quantization_grouped": 3, "rope": 2, "softmax": 8,
}  # fmt: skip


def _registry(monkeypatch, interpret: bool) -> OpRegistry:
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    registry = OpRegistry()
    flagos.register(registry)
    return registry


def test_registers_every_family_as_default_kind(monkeypatch):
    registry = _registry(monkeypatch, interpret=False)
    impls = [impl for op in registry.list_operators() for impl in registry.get_implementations(op)]
    assert {impl.impl_id for impl in impls} == {flagos.IMPL_ID}
    assert all(impl.kind is BackendImplKind.DEFAULT and impl.priority == 150 for impl in impls)
    for family, count in _FAMILY_OPS.items():
        names = getattr(flagos, family).__all__
        assert len(names) == count and all(registry.get_implementation(n, flagos.IMPL_ID) for n in names)
    assert registry.get_implementation("layernorm_fwd", flagos.IMPL_ID).supports is not None
    assert registry.get_implementation("gemm", flagos.IMPL_ID) is None  # not implemented here


@pytest.mark.parametrize("interpret, devices", [(False, {"cuda"}), (True, {"cuda", "cpu"})])
def test_device_capabilities(monkeypatch, interpret, devices):
    registry = _registry(monkeypatch, interpret)
    assert set(registry.get_implementation("gelu", flagos.IMPL_ID).capabilities.device_types) == devices


def test_dispatch_prefers_flagos_and_supports_falls_back(monkeypatch, device):
    registry = _registry(monkeypatch, interpret=device == "cpu")
    reference.register(registry)
    manager = OpManager(registry, load_builtins=False, discover=False)
    x = randn(3, 10, device=device)
    y, impl = manager.dispatcher("gelu").traced(x)
    assert impl.impl_id == flagos.IMPL_ID
    torch.testing.assert_close(y, ref_activation.gelu(x), rtol=1.3e-6, atol=1e-5)
    # packed sequences: flagos declines with a reason, the reference runs
    args = (randn(5, 2, 8, device=device), randn(5, 1, 1, 8, device=device), "thd", False, None,
            torch.tensor([0, 2, 5], dtype=torch.int32, device=device))  # fmt: skip
    out, impl = manager.dispatcher("fused_rope_forward").traced(*args)
    assert impl.impl_id == reference.IMPL_ID and out.shape == args[0].shape
    declined = [d for d in manager.explain("fused_rope_forward", *args) if d.impl_id == flagos.IMPL_ID]
    assert declined[0].status == "rejected" and "thd" in declined[0].reason


def test_import_without_triton_raises_import_error_and_discovery_records_it():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        try:
            import transformer_engine.plugin.backends.flagos
        except ImportError:
            pass
        else:
            raise SystemExit("flagos imported without triton")
        from transformer_engine.plugin.core import OpManager
        manager = OpManager(load_builtins=True, discover=False)
        manager.ensure_initialized()
        record = [r for r in manager.plugin_records if r.name.endswith("flagos")][0]
        assert not record.ok and "triton" in record.error, record
        assert "flagos.triton" not in manager.registry.impl_ids()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
