"""Plugin discovery: a real entry point of an installed package, TE_FL_PLUGIN_MODULES, broken plugins, hooks."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl, relu_impl
from transformer_engine.plugin.core import ENTRY_POINT_GROUP, OpManager, OpRegistry
from transformer_engine.plugin.builtin import BUILTIN_BACKENDS
from transformer_engine.plugin.core.discovery import load_builtin_backends, load_hook, load_plugins

REPO = Path(__file__).resolve().parents[3]
X = FakeTensor()

_PLUGIN_SOURCE = '''
"""A tiny out-of-tree TE-FL plugin: relu on vendor {vendor!r}."""
from transformer_engine.plugin.core import OpImpl, BackendImplKind

LOADS = []


def relu(x):
    return "{impl_id}"


def register(registry):
    LOADS.append(1)
    registry.register(OpImpl(op_name="relu", impl_id="{impl_id}", kind=BackendImplKind.VENDOR,
                             fn=relu, vendor="{vendor}", priority={priority}))
'''


def _write_module(root: Path, name: str, source: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(source))


def _install_distribution(root: Path, dist: str, entry_points: dict) -> None:
    """What ``pip install`` leaves behind: ``<dist>-<version>.dist-info`` with METADATA and entry_points.txt."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def _manager() -> OpManager:
    return OpManager(OpRegistry(), load_builtins=False, discover=True)


def _records(manager):
    return {r.name: r for r in manager.plugin_records}


# -- entry points ------------------------------------------------------------------------------
def test_entry_point_plugin_is_discovered_and_wins_by_priority(site):
    _write_module(site, "tefl_test_ep_plugin", _PLUGIN_SOURCE.format(vendor="EPVendor", impl_id="vendor.ep", priority=100))
    _install_distribution(site, "tefl_test_ep_plugin", {"acme": "tefl_test_ep_plugin"})
    manager = _manager()
    manager.registry.register(make_impl("reference.torch"))
    assert manager.plugin_records == []  # lazy: nothing is loaded before the first use
    assert manager.call("relu", X) == "vendor.ep"
    record = _records(manager)["acme"]
    assert (record.source, record.ok, record.error, record.impl_ids, record.ops) == ("entry_point", True, None, ["vendor.ep"], 1)
    assert manager.registry.get_implementation("relu", "vendor.ep").vendor == "epvendor"


def test_entry_point_to_a_callable_hook(site):
    _write_module(
        site,
        "tefl_test_ep_callable",
        '''
        from transformer_engine.plugin.core import OpImpl

        def relu(x):
            return "flagos.ephook"

        def install(registry):
            registry.register(OpImpl("relu", "flagos.ephook", "flagos", relu, priority=200))
        ''',
    )
    _install_distribution(site, "tefl_test_ep_callable", {"hook": "tefl_test_ep_callable:install"})
    assert _manager().call("relu", X) == "flagos.ephook"


def test_entry_point_whose_import_raises_is_recorded_and_the_others_still_load(site):
    _write_module(site, "tefl_test_ep_broken", 'raise RuntimeError("vendor library missing")\n')
    _write_module(site, "tefl_test_ep_good", _PLUGIN_SOURCE.format(vendor="good", impl_id="vendor.good", priority=100))
    _install_distribution(site, "tefl_test_ep_broken", {"broken": "tefl_test_ep_broken"})
    _install_distribution(site, "tefl_test_ep_good", {"good": "tefl_test_ep_good"})
    manager = _manager()
    assert manager.call("relu", X) == "vendor.good"
    records = _records(manager)
    assert records["broken"].ok is False and records["broken"].source == "entry_point"
    assert records["broken"].error == "RuntimeError: vendor library missing"
    assert records["good"].ok is True


def test_entry_point_discovery_in_a_fresh_process(tmp_path):
    _write_module(tmp_path, "tefl_test_ep_proc", _PLUGIN_SOURCE.format(vendor="proc", impl_id="vendor.proc", priority=100))
    _install_distribution(tmp_path, "tefl_test_ep_proc", {"proc": "tefl_test_ep_proc"})
    code = textwrap.dedent(
        """
        from transformer_engine.plugin.core import OpManager
        manager = OpManager(load_builtins=False)
        print(manager.call("relu", None), [(r.name, r.source, r.ok) for r in manager.plugin_records])
        """
    )
    env = {"PYTHONPATH": f"{tmp_path}{__import__('os').pathsep}{REPO}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "vendor.proc [('proc', 'entry_point', True)]"


# -- TE_FL_PLUGIN_MODULES ----------------------------------------------------------------------
def test_env_modules_load_after_entry_points_and_failures_are_recorded(site, monkeypatch):
    _write_module(site, "tefl_test_env_ok", _PLUGIN_SOURCE.format(vendor="envv", impl_id="vendor.env", priority=100))
    _write_module(site, "tefl_test_env_raises", 'raise ImportError("needs libfoo.so")\n')
    _write_module(site, "tefl_test_ep_first", _PLUGIN_SOURCE.format(vendor="epv", impl_id="vendor.epfirst", priority=90))
    _install_distribution(site, "tefl_test_ep_first", {"first": "tefl_test_ep_first"})
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "tefl_test_env_ok, tefl_test_env_raises,tefl_test_env_missing")
    manager = _manager()
    assert manager.call("relu", X) == "vendor.env"  # priority 100 beats the entry point's 90
    names = [(r.name, r.source, r.ok) for r in manager.plugin_records]
    assert names == [
        ("first", "entry_point", True),
        ("tefl_test_env_ok", "env", True),
        ("tefl_test_env_raises", "env", False),
        ("tefl_test_env_missing", "env", False),
    ]
    records = _records(manager)
    assert records["tefl_test_env_raises"].error == "ImportError: needs libfoo.so"
    assert records["tefl_test_env_missing"].error.startswith("ModuleNotFoundError: No module named 'tefl_test_env_missing'")


def test_discovery_runs_once_per_manager(site, monkeypatch):
    _write_module(site, "tefl_test_env_once", _PLUGIN_SOURCE.format(vendor="once", impl_id="vendor.once", priority=100))
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "tefl_test_env_once")
    manager = _manager()
    for _ in range(3):
        manager.call("relu", X)
    manager.call("relu", FakeTensor(dtype="bfloat16"))
    assert sys.modules["tefl_test_env_once"].LOADS == [1]


def test_discover_false_loads_no_plugin(site, monkeypatch):
    _write_module(site, "tefl_test_env_off", _PLUGIN_SOURCE.format(vendor="off", impl_id="vendor.off", priority=100))
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "tefl_test_env_off")
    manager = OpManager(OpRegistry(), load_builtins=False, discover=False)
    manager.registry.register(make_impl("reference.torch"))
    assert manager.call("relu", X) == "reference.torch"
    assert "tefl_test_env_off" not in sys.modules


# -- the hook contract -------------------------------------------------------------------------
class _Module:
    """A stand-in for a plugin module: attributes only."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _hook_registering(*impls, raise_after=False):
    def hook(registry):
        for impl in impls:
            registry.register(impl)
        if raise_after:
            raise RuntimeError("hook broke halfway")

    return hook


def test_te_fl_register_is_preferred_over_register():
    registry = OpRegistry()
    plugin = _Module(te_fl_register=_hook_registering(make_impl("vendor.a")), register=_hook_registering(make_impl("vendor.b")))
    assert load_hook(registry, plugin, "p", "env").ok
    assert registry.impl_ids() == ["vendor.a"]


def test_a_class_with_a_static_register_is_a_plugin():
    class Plugin:
        register = staticmethod(_hook_registering(make_impl("vendor.cls")))

    registry = OpRegistry()
    assert load_hook(registry, Plugin, "cls", "env").ok and registry.impl_ids() == ["vendor.cls"]


def test_an_object_without_a_hook_is_recorded_as_failed():
    record = load_hook(OpRegistry(), _Module(other=1), "nohook", "env")
    assert not record.ok and record.error == "TypeError: plugin 'nohook' is neither callable nor has te_fl_register/register"


def test_a_hook_that_raises_registers_nothing():
    registry = OpRegistry()
    record = load_hook(registry, _hook_registering(make_impl("vendor.a"), make_impl("vendor.b"), raise_after=True), "half", "env")
    assert record.error == "RuntimeError: hook broke halfway" and registry.list_operators() == [] and registry.epoch == 0


def test_a_hook_with_one_bad_impl_registers_nothing():
    def bad(x, y):
        return x

    registry = OpRegistry()
    record = load_hook(registry, _hook_registering(make_impl("vendor.a"), make_impl("vendor.b", bad)), "bad", "env")
    assert not record.ok and record.error.startswith("RegistrationError:") and "signature" in record.error
    assert registry.list_operators() == []


def test_a_hook_may_override_an_impl_and_query_the_registry():
    registry = OpRegistry()
    registry.register(make_impl("reference.torch", relu_impl("builtin")))
    seen = []

    def hook(reg):
        seen.append([i.impl_id for i in reg.get_implementations("relu")])
        reg.register(make_impl("reference.torch", relu_impl("patched")), override=True)
        reg.register_many([make_impl("vendor.more")])

    record = load_hook(registry, hook, "patcher", "entry_point")
    assert record.ok and record.ops == 2 and record.impl_ids == ["reference.torch", "vendor.more"]
    assert seen == [["reference.torch"]]
    assert registry.get_implementation("relu", "reference.torch").fn(None) == "patched"


def test_a_hook_with_a_good_override_and_a_bad_plain_impl_changes_nothing():
    registry = OpRegistry()
    registry.register(make_impl("reference.torch", relu_impl("builtin")))
    registry.register(make_impl("vendor.taken", relu_impl("taken")))

    def hook(reg):
        reg.register(make_impl("reference.torch", relu_impl("patched")), override=True)
        reg.register(make_impl("vendor.new"))
        reg.register(make_impl("vendor.taken", relu_impl("conflict")))  # no override: refused

    record = load_hook(registry, hook, "mixed", "env")
    assert not record.ok and "already has a different impl 'vendor.taken'" in record.error
    assert registry.get_implementation("relu", "reference.torch").fn(None) == "builtin"
    assert registry.get_implementation("relu", "vendor.new") is None


def test_a_hook_with_a_good_plain_impl_and_a_bad_override_changes_nothing():
    def bad(y):
        return y

    registry = OpRegistry()

    def hook(reg):
        reg.register(make_impl("vendor.new"))
        reg.register(make_impl("reference.torch", bad), override=True)  # wrong signature: refused

    record = load_hook(registry, hook, "mixed", "env")
    assert not record.ok and "signature" in record.error
    assert registry.list_operators() == [] and registry.epoch == 0


def test_loading_the_same_plugin_twice_is_harmless():
    registry = OpRegistry()
    fn = relu_impl("vendor.twice")
    hook = _hook_registering(make_impl("vendor.twice", fn))
    assert load_hook(registry, hook, "twice", "env").ok
    epoch = registry.epoch
    assert load_hook(registry, hook, "twice", "entry_point").ok
    assert registry.epoch == epoch


@pytest.mark.parametrize("version, ok", [("1.0", True), ("1.7", True), ((1, 2), True), ("2.0", False), ((0, 9), False)])
def test_plugin_api_version_is_checked(version, ok):
    plugin = _Module(register=_hook_registering(make_impl("vendor.v")), TE_FL_PLUGIN_API_VERSION=version)
    record = load_hook(OpRegistry(), plugin, "versioned", "env")
    assert record.ok is ok
    if not ok:
        assert f"targets plugin API {version}" in record.error


def test_load_plugins_with_explicit_modules_and_no_entry_points(site):
    _write_module(site, "tefl_test_explicit", _PLUGIN_SOURCE.format(vendor="ex", impl_id="vendor.ex", priority=100))
    registry = OpRegistry()
    records = load_plugins(registry, ("tefl_test_explicit",))
    assert [(r.name, r.ok) for r in records] == [("tefl_test_explicit", True)]
    assert registry.impl_ids() == ["vendor.ex"]


def test_builtin_backends_never_raise_and_are_recorded():
    registry = OpRegistry()
    records = load_builtin_backends(registry)
    assert [r.name for r in records] == list(BUILTIN_BACKENDS)
    assert all(r.source == "builtin" and (r.ok or r.error) for r in records)

