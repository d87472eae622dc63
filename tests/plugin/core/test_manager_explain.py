"""OpManager explanations and initialisation: explain / describe, TE_FL_PER_OP and TE_FL_LOG_LEVEL at first use."""

import logging

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl, make_manager, three_kinds
from transformer_engine.plugin.core import Capabilities, reset_global_policy

X = FakeTensor()


# -- explain / describe ------------------------------------------------------------------------
def test_explain_lists_selected_fallbacks_and_rejections():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme"),
        make_impl("reference.torch"),
    )
    decisions = manager.explain("relu", X)
    assert [(d.impl_id, d.kind, d.priority, d.status) for d in decisions] == [
        ("vendor.acme", "vendor", 100, "selected"),
        ("reference.torch", "reference", 50, "fallback"),
        ("flagos.triton", "flagos", 150, "rejected"),
    ]


def test_describe_gives_every_declared_op_a_row_list():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme", supports=lambda x: True),
        make_impl("reference.torch"),
    )
    from transformer_engine.plugin.core import list_specs

    table = manager.describe("cpu")
    assert set(table) == {spec.name for spec in list_specs()}
    assert table["gemm"] == []
    rows = {d.impl_id: d for d in table["relu"]}
    # without arguments a supports() predicate cannot be run: that candidate is conditional and the
    # next unconditional one is the selected one
    assert rows["vendor.acme"].status == "conditional" and "supports()" in rows["vendor.acme"].reason
    assert rows["reference.torch"].status == "selected"
    assert rows["flagos.triton"].status == "rejected" and "device 'cpu'" in rows["flagos.triton"].reason
    assert [d.status for d in manager.describe("cuda")["relu"]] == ["selected", "fallback", "fallback"]


def test_describe_by_dtype():
    manager = make_manager(make_impl("flagos.triton", capabilities=Capabilities(dtypes={"bfloat16"})), make_impl("reference.torch"))
    assert manager.describe("cpu", "bfloat16")["relu"][0].impl_id == "flagos.triton"
    assert manager.describe("cpu", "float32")["relu"][0].impl_id == "reference.torch"


# -- initialisation ----------------------------------------------------------------------------
def test_unknown_op_in_te_fl_per_op_is_reported_at_initialisation(monkeypatch):
    monkeypatch.setenv("TE_FL_PER_OP", "not_an_op=reference;relu=vendor")
    reset_global_policy()
    manager = make_manager(make_impl("vendor.acme"))
    with pytest.warns(UserWarning, match="TE_FL_PER_OP names unknown op 'not_an_op'"):
        assert manager.call("relu", X) == "vendor.acme"


@pytest.fixture
def plugin_logger():
    logger = logging.getLogger("transformer_engine.plugin")
    level = logger.level
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.setLevel(level)


def test_te_fl_log_level_sets_the_plugin_logger_level(monkeypatch, plugin_logger):
    make_manager().ensure_initialized()
    assert plugin_logger.level == logging.NOTSET  # unset: the application's logging config decides
    monkeypatch.setenv("TE_FL_LOG_LEVEL", "debug")
    make_manager().ensure_initialized()
    assert plugin_logger.level == logging.DEBUG


def test_te_fl_log_level_bad_value_warns_and_leaves_the_logger_alone(monkeypatch, plugin_logger):
    from transformer_engine.plugin.core import PolicyConfigWarning

    monkeypatch.setenv("TE_FL_LOG_LEVEL", "LOUD")
    with pytest.warns(PolicyConfigWarning, match=r"ignoring TE_FL_LOG_LEVEL='LOUD': expected one of"):
        make_manager().ensure_initialized()
    assert plugin_logger.level == logging.NOTSET


def test_package_level_explain_and_describe_use_the_default_manager(monkeypatch):
    import transformer_engine.plugin as plugin

    manager = three_kinds()
    monkeypatch.setattr(plugin, "get_default_manager", lambda: manager)
    assert plugin.explain("relu", X) == manager.explain("relu", X)
    assert plugin.describe("cpu")["relu"] == manager.describe("cpu")["relu"]
