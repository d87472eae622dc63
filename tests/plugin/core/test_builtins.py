"""What the core gets from outside it: the built-in backends (the bootstrap hook) and measured per-op orders.

The core names no in-tree backend and carries no measurement: the list of built-in backends comes from
``transformer_engine.plugin.builtin`` (or a provider set with ``set_builtin_provider``), and a backend
declares the ops it was measured faster at in its ``TE_FL_MEASURED_PER_OP``, stored with its impls.
"""

import textwrap
from pathlib import Path

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl
from transformer_engine.plugin import builtin
from transformer_engine.plugin.core import EnvConfig, OpManager, OpRegistry, SelectionPolicy, policy_context
from transformer_engine.plugin.core import discovery
from transformer_engine.plugin.core.discovery import (
    builtin_provider,
    load_builtin_backends,
    load_hook,
    measured_per_op,
    set_builtin_provider,
)
from transformer_engine.plugin.core.types import ArgKey

CORE = Path(discovery.__file__).resolve().parent
X = FakeTensor()


class _Module:
    """A stand-in for a plugin module: attributes only."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _plugin(*impls, **attrs) -> _Module:
    def register(registry):
        registry.register_many(impls)

    return _Module(register=register, **attrs)


def _order(manager, op="relu"):
    return [i.impl_id for i in manager.rank(op, ArgKey("cpu", None, "float32"))[0]]


@pytest.fixture
def provider():
    """Restores the process-wide built-in provider after a test that sets one."""
    previous = set_builtin_provider(None)
    yield
    set_builtin_provider(previous)


def _write_backend(root: Path, name: str, impl_id: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(f'''
        from transformer_engine.plugin.core import OpImpl

        def relu(x):
            return "{impl_id}"

        def register(registry):
            registry.register(OpImpl("relu", "{impl_id}", "{impl_id.split('.')[0]}", relu, vendor="x"))
    '''))


# -- the core names no backend -------------------------------------------------------------------
def test_the_core_names_no_in_tree_backend_and_carries_no_measurement():
    for path in CORE.glob("*.py"):
        source = path.read_text()
        assert "plugin.backends" not in source, path.name
        assert "fused_attn" not in source and "H200" not in source, path.name


# -- the bootstrap hook --------------------------------------------------------------------------
def test_the_builtin_backends_come_from_the_bootstrap_hook(provider):
    assert builtin_provider() is builtin.builtin_backends
    assert discovery.BUILTIN_BACKENDS == builtin.BUILTIN_BACKENDS  # the name the core used to define
    with pytest.raises(AttributeError):
        discovery.NO_SUCH_NAME  # noqa: B018


def test_te_fl_skip_cuda_skips_the_cuda_backend():
    assert builtin.builtin_backends(EnvConfig()) == tuple((name, None) for name in builtin.BUILTIN_BACKENDS)
    skipped = dict(builtin.builtin_backends(EnvConfig(skip_cuda=True)))
    assert skipped == {name: ("TE_FL_SKIP_CUDA=1" if name == builtin.CUDA_BACKEND else None) for name in builtin.BUILTIN_BACKENDS}


def test_a_provider_lists_what_is_loaded_and_skipped(site):
    _write_backend(site, "tefl_test_builtin_a", "flagos.a")
    seen = []

    def provider(cfg):
        seen.append(cfg)
        return [("tefl_test_builtin_a", None), ("tefl_test_builtin_b", "not wanted here")]

    registry, cfg = OpRegistry(), EnvConfig()
    records = load_builtin_backends(registry, cfg, provider)
    assert seen == [cfg]
    assert [(r.name, r.source, r.ok, r.error) for r in records] == [
        ("tefl_test_builtin_a", "builtin", True, None),
        ("tefl_test_builtin_b", "builtin", False, "skipped: not wanted here"),
    ]
    assert registry.impl_ids() == ["flagos.a"]


def test_set_builtin_provider_serves_new_managers(site, provider):
    _write_backend(site, "tefl_test_builtin_c", "vendor.c")
    assert set_builtin_provider(lambda cfg: [("tefl_test_builtin_c", None)]) is None
    manager = OpManager(OpRegistry(), discover=False)
    assert manager.call("relu", X) == "vendor.c"
    assert [(r.name, r.ok) for r in manager.plugin_records] == [("tefl_test_builtin_c", True)]


def test_a_broken_provider_is_recorded_never_raised(provider):
    def broken(cfg):
        raise ImportError("no builtin module in this host")

    set_builtin_provider(broken)
    manager = OpManager(OpRegistry(), discover=False)
    manager.ensure_initialized()
    [record] = manager.plugin_records
    assert (record.name, record.source, record.ok) == ("transformer_engine.plugin.builtin", "builtin", False)
    assert record.error == "ImportError: no builtin module in this host"


# -- measured per-op orders ----------------------------------------------------------------------
def _flagos_and_reference() -> OpRegistry:
    registry = OpRegistry()
    registry.register_many([make_impl("flagos.triton"), make_impl("reference.torch")])
    return registry


def test_a_backend_declares_a_measured_order_with_its_impls():
    registry, other = _flagos_and_reference(), _flagos_and_reference()
    record = load_hook(registry, _plugin(make_impl("vendor.acme"), TE_FL_MEASURED_PER_OP={"relu": "vendor"}), "acme", "env")
    assert record.ok
    assert dict(measured_per_op(registry)) == {"relu": ("vendor",)} and dict(measured_per_op(other)) == {}
    manager = OpManager(registry, load_builtins=False, discover=False)
    assert _order(manager) == ["vendor.acme", "flagos.triton", "reference.torch"]
    assert manager.call("relu", X) == "vendor.acme"
    # the user's settings replace the measurement
    with policy_context(SelectionPolicy(per_op_order={"relu": "flagos"})):
        assert manager.call("relu", X) == "flagos.triton"
    with policy_context(SelectionPolicy(prefer="reference")):
        assert manager.call("relu", X) == "reference.torch"
    manager.reload()  # the registry is cleared: its orders go with its impls
    assert dict(measured_per_op(registry)) == {}


def test_a_later_declaration_of_an_op_wins():
    registry = _flagos_and_reference()
    assert load_hook(registry, _plugin(make_impl("vendor.a"), TE_FL_MEASURED_PER_OP={"relu": "vendor", "gelu": "vendor"}), "a", "env").ok
    assert load_hook(registry, _plugin(make_impl("vendor.b"), TE_FL_MEASURED_PER_OP={"relu": "reference"}), "b", "env").ok
    assert dict(measured_per_op(registry)) == {"relu": ("reference",), "gelu": ("vendor",)}


def test_a_bad_declaration_fails_the_plugin_and_registers_nothing():
    registry = _flagos_and_reference()
    epoch = registry.epoch
    record = load_hook(registry, _plugin(make_impl("vendor.a"), TE_FL_MEASURED_PER_OP={"relu": "vendor|only"}), "exclusive", "env")
    assert not record.ok and record.error.startswith("ValueError: plugin 'exclusive': TE_FL_MEASURED_PER_OP: ")
    record = load_hook(registry, _plugin(make_impl("vendor.a"), TE_FL_MEASURED_PER_OP=["relu"]), "list", "env")
    assert not record.ok and record.error.startswith("TypeError: plugin 'list': TE_FL_MEASURED_PER_OP: ")
    assert registry.epoch == epoch and dict(measured_per_op(registry)) == {}


def test_a_plugin_whose_impls_are_refused_leaves_no_order():
    def wrong_signature(y):
        return y

    registry = _flagos_and_reference()
    plugin = _plugin(make_impl("vendor.a", wrong_signature), TE_FL_MEASURED_PER_OP={"relu": "vendor"})
    assert not load_hook(registry, plugin, "refused", "env").ok
    assert dict(measured_per_op(registry)) == {}


def test_the_builtin_cuda_backend_puts_the_vendor_first_for_attention_and_activations(provider, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("TE_FL_SKIP_CUDA", raising=False)
    monkeypatch.setattr(builtin, "BUILTIN_BACKENDS", (builtin.CUDA_BACKEND,))  # the cuda backend alone suffices
    manager = OpManager(OpRegistry(), discover=False)
    manager.ensure_initialized()
    vendor_first = {op: ("vendor",) for op in ("fused_attn_fwd", "fused_attn_bwd", "gelu", "dgelu", "silu", "dsilu")}
    assert dict(measured_per_op(manager.registry)) == vendor_first
    assert SelectionPolicy().order_for("fused_attn_fwd", measured_per_op(manager.registry))[0][0] == "vendor"
    monkeypatch.setenv("TE_FL_SKIP_CUDA", "1")
    manager.reload()
    manager.ensure_initialized()
    assert dict(measured_per_op(manager.registry)) == {}
