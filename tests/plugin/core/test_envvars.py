"""The variable registry: one declaration per TE_FL_* variable; mistakes are named once, at the user's code."""

import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import transformer_engine
from transformer_engine.plugin.core import OpManager, OpRegistry, PolicyConfigWarning, load_env
from transformer_engine.plugin.core.envvars import VARIABLES, check_environment, closest, config_warning, describe, lookup, read

REPO = Path(__file__).resolve().parents[3]
PACKAGE_DIR = str(Path(transformer_engine.__file__).resolve().parent)


def _config_warnings(record):
    return [w for w in record if issubclass(w.category, PolicyConfigWarning)]


def _outside_the_package(w) -> bool:
    return not str(Path(w.filename).resolve()).startswith(PACKAGE_DIR)


# -- the registry ------------------------------------------------------------------------------
def test_every_variable_read_in_the_library_is_declared():
    source = "\n".join(p.read_text() for p in Path(PACKAGE_DIR).rglob("*.py"))
    plugin_attributes = {"TE_FL_PLUGIN_API_VERSION", "TE_FL_MEASURED_PER_OP"}  # read off a plugin, not the environment
    used = set(re.findall(r"\b(?:TE_FL|TEFL)_[A-Z0-9_]+\b", source)) - plugin_attributes - {"TE_FL_STRCT"}  # a docstring example
    declared = {v.name for v in VARIABLES} | {a for v in VARIABLES for a in v.aliases}
    assert used <= declared, used - declared


def test_only_the_registry_reads_te_fl_variables_in_plugin_core():
    core = Path(PACKAGE_DIR) / "plugin" / "core"
    for path in core.glob("*.py"):
        if path.name != "envvars.py":
            text = path.read_text()
            assert 'environ.get("TE_FL' not in text and 'getenv("TE_FL' not in text and '"TEFL_LOG_LEVEL" in' not in text, path


def test_registry_entries_have_a_description_and_unique_names():
    names = [v.name for v in VARIABLES] + [a for v in VARIABLES for a in v.aliases]
    assert len(names) == len(set(names))
    assert all(v.description and v.name.startswith("TE_FL_") for v in VARIABLES)


def test_read_refuses_an_undeclared_name():
    with pytest.raises(KeyError):
        read("TE_FL_NOT_DECLARED", {})


# -- unknown variables -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, guess",
    [("TE_FL_STRCT", "TE_FL_STRICT"), ("TE_FL_PREFERS", "TE_FL_PREFER"), ("TEFL_STRICT", "TE_FL_STRICT"),
     ("TE_FL_DENY_VENDOR", "TE_FL_DENY_VENDORS"), ("TEFL_LOGLEVEL", "TE_FL_LOG_LEVEL")],
)
def test_unknown_variable_warns_naming_the_closest_known_one(name, guess):
    assert closest(name) == guess
    with pytest.warns(PolicyConfigWarning) as record:
        load_env({name: "1"})
    assert [str(w.message) for w in _config_warnings(record)] == [
        f"TE-FL: unknown environment variable {name} is ignored; did you mean {guess}?"
    ]


def test_unknown_variable_without_a_close_match_lists_the_known_ones():
    with pytest.warns(PolicyConfigWarning,
                      match=r"unknown environment variable TE_FL_ZZZZZZZZZZZZZZZ is ignored; known variables: TE_FL_PREFER, "):
        check_environment({"TE_FL_ZZZZZZZZZZZZZZZ": "1"})


def test_unknown_variable_warns_once_per_process(recwarn):
    for _ in range(3):
        load_env({"TE_FL_STRCT": "1"})
    assert len(_config_warnings(recwarn)) == 1


def test_known_variables_and_other_namespaces_do_not_warn(recwarn):
    env = {v.name: "" for v in VARIABLES}
    env.update({"NVTE_FLASH_ATTN": "1", "TEFLON": "x", "PATH": "/bin"})
    assert check_environment(env) == []
    assert not _config_warnings(recwarn)


# -- the log level variable --------------------------------------------------------------------
def test_te_fl_log_level_is_the_primary_name(recwarn):
    cfg = load_env({"TE_FL_LOG_LEVEL": "debug"})
    assert (cfg.log_level, cfg.log_level_set) == (logging.DEBUG, True)
    assert not _config_warnings(recwarn)


def test_tefl_log_level_is_a_deprecated_alias_that_still_works():
    with pytest.warns(PolicyConfigWarning) as record:
        cfg = load_env({"TEFL_LOG_LEVEL": "INFO"})
    assert (cfg.log_level, cfg.log_level_set) == (logging.INFO, True)
    assert [str(w.message) for w in record] == [
        "TE-FL: TEFL_LOG_LEVEL is deprecated; rename it to TE_FL_LOG_LEVEL (its value 'INFO' is used)"
    ]


def test_primary_log_level_wins_over_a_different_alias():
    with pytest.warns(PolicyConfigWarning) as record:
        cfg = load_env({"TE_FL_LOG_LEVEL": "ERROR", "TEFL_LOG_LEVEL": "DEBUG"})
    assert cfg.log_level == logging.ERROR
    assert [str(w.message) for w in record] == [
        "TE-FL: both TE_FL_LOG_LEVEL='ERROR' and its deprecated alias TEFL_LOG_LEVEL='DEBUG' are set; TEFL_LOG_LEVEL is ignored"
    ]


def test_bad_log_level_names_the_variable_that_was_set():
    with pytest.warns(PolicyConfigWarning, match=r"ignoring TE_FL_LOG_LEVEL='loud': expected one of"):
        cfg = load_env({"TE_FL_LOG_LEVEL": "loud"})
    assert (cfg.log_level, cfg.log_level_set) == (logging.WARNING, False)


def test_lookup_reports_which_name_was_set():
    assert lookup("TE_FL_LOG_LEVEL", {}) == (None, None)
    assert lookup("TE_FL_LOG_LEVEL", {"TE_FL_LOG_LEVEL": "INFO"}) == ("INFO", "TE_FL_LOG_LEVEL")


def _run(code: str, **env):
    full = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300,
                          cwd=str(REPO))


_INIT = """
import logging
import transformer_engine.pytorch
logger = logging.getLogger("transformer_engine.plugin")
print("after import:", len(logger.handlers), len(logging.getLogger().handlers), logger.level)
from transformer_engine.plugin.core import get_default_manager
get_default_manager().ensure_initialized()
print("after init:", len(logger.handlers), logger.level)
"""


@pytest.mark.parametrize("name", ["TE_FL_LOG_LEVEL", "TEFL_LOG_LEVEL"])
def test_a_log_level_gets_a_handler_so_messages_appear(name):
    result = _run(_INIT, **{name: "INFO"})
    assert result.returncode == 0, result.stderr
    assert "after import: 0 0 0" in result.stdout  # importing configures nothing
    assert f"after init: 1 {logging.INFO}" in result.stdout
    assert "INFO transformer_engine.plugin: TE-FL dispatch ready:" in result.stderr


def test_without_a_log_level_logging_is_left_alone():
    result = _run(_INIT)
    assert result.returncode == 0, result.stderr
    assert "after import: 0 0 0" in result.stdout and "after init: 0 0" in result.stdout
    assert "dispatch ready" not in result.stderr


def test_an_application_handler_is_not_doubled():
    code = "import logging\nlogging.basicConfig(format='APP %(message)s')\n" + _INIT
    result = _run(code, TE_FL_LOG_LEVEL="INFO")
    assert result.returncode == 0, result.stderr
    assert f"after init: 0 {logging.INFO}" in result.stdout
    assert result.stderr.count("TE-FL dispatch ready") == 1 and "APP TE-FL dispatch ready" in result.stderr


# -- where and how often warnings appear -------------------------------------------------------
def test_config_warning_points_at_the_caller_outside_the_package():
    with pytest.warns(PolicyConfigWarning) as record:
        config_warning("TE-FL: a test message")
    (w,) = record
    assert w.filename == __file__ and _outside_the_package(w)


def test_config_warning_is_issued_once_per_process(recwarn):
    assert config_warning("TE-FL: once") is True
    assert config_warning("TE-FL: once") is False
    assert [str(w.message) for w in recwarn] == ["TE-FL: once"]


def test_prefer_bogus_warns_once_at_the_users_code(monkeypatch):
    monkeypatch.setenv("TE_FL_PREFER", "bogus")
    manager = OpManager(OpRegistry(), load_builtins=False, discover=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        manager.ensure_initialized()
        from transformer_engine.plugin.core import get_policy

        assert get_policy().prefer == "flagos"
        load_env()
    found = _config_warnings(record)
    assert [str(w.message) for w in found] == ["TE-FL: ignoring TE_FL_PREFER='bogus': expected flagos, vendor or reference"]
    assert found[0].filename == __file__


def test_prefer_bogus_warns_once_in_a_fresh_process_at_the_script_line(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(
        "import torch\nimport transformer_engine.pytorch as te\n"
        "layer = te.Linear(4, 4)\n"
        "out = layer(torch.randn(2, 4))  # first op call\n"
        "out = layer(torch.randn(2, 4))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                            env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", ""), "TE_FL_PREFER": "bogus", "TE_FL_STRCT": "1"})
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert err.count("TE_FL_PREFER='bogus'") == 1
    assert f"{script}:4: PolicyConfigWarning: TE-FL: ignoring TE_FL_PREFER='bogus'" in err
    assert f"{script}:4: PolicyConfigWarning: TE-FL: unknown environment variable TE_FL_STRCT is ignored; did you mean TE_FL_STRICT?" in err
    assert "transformer_engine/" not in err


# -- vendor lists naming a kind ----------------------------------------------------------------
def _vendor_manager(vendor="acme"):
    from transformer_engine.plugin.core import BackendImplKind, OpImpl

    manager = OpManager(OpRegistry(), load_builtins=False, discover=False)
    manager.registry.register(OpImpl(op_name="relu", impl_id=f"vendor.{vendor}", kind=BackendImplKind.VENDOR,
                                     fn=lambda x: None, vendor=vendor))
    return manager


def _init_with_registered_vendor(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    manager = _vendor_manager()  # no builtins, no discovery: initialising keeps the impl registered above
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        manager.ensure_initialized()
    return _config_warnings(record)


def test_deny_vendors_naming_a_kind_warns_naming_vendors_and_the_way_to_exclude_a_kind(monkeypatch):
    found = _init_with_registered_vendor(monkeypatch, TE_FL_DENY_VENDORS="reference")
    assert [str(w.message) for w in found] == [
        "TE-FL: TE_FL_DENY_VENDORS names 'reference', a backend kind, not a vendor, so it denies nothing "
        "(vendors registered here: acme). No variable denies a whole kind: TE_FL_PREFER picks the kind tried "
        "first, and TE_FL_PER_OP='<op>=flagos|vendor|only' keeps an op on the kinds it lists."
    ]
    assert _outside_the_package(found[0])


def test_allow_vendors_naming_a_kind_warns(monkeypatch):
    found = _init_with_registered_vendor(monkeypatch, TE_FL_ALLOW_VENDORS="flagos")
    assert len(found) == 1
    assert str(found[0].message).startswith("TE-FL: TE_FL_ALLOW_VENDORS names 'flagos', a backend kind, not a vendor, "
                                            "so it allows no vendor by that name")


def test_near_miss_of_a_registered_vendor_warns_but_an_absent_vendor_is_silent(monkeypatch):
    found = _init_with_registered_vendor(monkeypatch, TE_FL_DENY_VENDORS="acmee,kunlunxin")
    assert [str(w.message) for w in found] == [
        "TE-FL: TE_FL_DENY_VENDORS names unknown vendor 'acmee'; did you mean 'acme'? (vendors registered here: acme)"
    ]


def test_per_op_unknown_op_warns_with_a_suggestion(monkeypatch):
    monkeypatch.setenv("TE_FL_PER_OP", "gelo=reference")
    manager = OpManager(OpRegistry(), load_builtins=False, discover=False)
    with pytest.warns(UserWarning, match=r"TE_FL_PER_OP names unknown op 'gelo'; it is ignored; did you mean 'gelu'\?") as record:
        manager.ensure_initialized()
    assert all(_outside_the_package(w) for w in record)


# -- plugins named in the environment ----------------------------------------------------------
def test_env_plugin_that_fails_to_import_warns_at_warning_with_the_reason_and_the_traceback_hint(monkeypatch, caplog):
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "tefl_test_no_such_module")
    manager = OpManager(OpRegistry(), load_builtins=False, discover=True)
    with caplog.at_level(logging.DEBUG, logger="transformer_engine.plugin"):
        manager.ensure_initialized()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        "TE-FL: TE_FL_PLUGIN_MODULES plugin tefl_test_no_such_module failed to import, so its ops will not run: "
        "ModuleNotFoundError: No module named 'tefl_test_no_such_module'. Set TE_FL_LOG_LEVEL=DEBUG to log the "
        "traceback; `te-fl info` lists every plugin's status"
    ]
    assert any(r.levelno == logging.DEBUG and "Traceback" in r.getMessage() for r in caplog.records)


def test_env_plugin_whose_hook_raises_warns_with_the_hint(monkeypatch, caplog, tmp_path):
    (tmp_path / "tefl_test_bad_hook.py").write_text("def register(registry):\n    raise RuntimeError('no device')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TE_FL_PLUGIN_MODULES", "tefl_test_bad_hook")
    with caplog.at_level(logging.WARNING, logger="transformer_engine.plugin"):
        OpManager(OpRegistry(), load_builtins=False, discover=True).ensure_initialized()
    assert [r.getMessage() for r in caplog.records] == [
        "TE-FL: TE_FL_PLUGIN_MODULES plugin tefl_test_bad_hook failed to register, so its ops will not run: "
        "RuntimeError: no device. Set TE_FL_LOG_LEVEL=DEBUG to log the traceback; `te-fl info` lists every plugin's status"
    ]


# -- te-fl info --------------------------------------------------------------------------------
def test_describe_lists_every_declared_variable_then_the_unknown_ones():
    rows = describe({"TE_FL_STRICT": "1", "TEFL_LOG_LEVEL": "INFO", "TE_FL_STRCT": "1"})
    by_name = {row["name"]: row for row in rows}
    assert [row["name"] for row in rows[: len(VARIABLES)]] == [v.name for v in VARIABLES]
    assert by_name["TE_FL_STRICT"]["value"] == "1" and by_name["TE_FL_PREFER"]["value"] is None
    assert by_name["TE_FL_LOG_LEVEL"]["set_as"] == "TEFL_LOG_LEVEL" and by_name["TE_FL_LOG_LEVEL"]["value"] == "INFO"
    assert by_name["TE_FL_STRCT"]["description"] == "unknown, ignored (did you mean TE_FL_STRICT?)"


def test_te_fl_info_shows_the_settings_from_the_registry(monkeypatch, capsys):
    from transformer_engine.cli import main

    monkeypatch.setenv("COLUMNS", "500")
    monkeypatch.setenv("TE_FL_STRICT", "1")
    monkeypatch.setenv("TE_FL_STRCT", "1")
    with pytest.warns(PolicyConfigWarning, match="TE_FL_STRCT"):
        assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "Settings (environment)" in out
    for var in VARIABLES:
        assert var.name in out
    assert "unknown, ignored (did you mean TE_FL_STRICT?)" in out
