"""transformer_engine.common.env: every environment variable the package reads is declared once and read there.

The bottom layer (pure Python, no torch): common.recipe reads NVIDIA TE's NVTE_* defaults through it, the
plugin's loader its TE_FL_* variables (plugin/core/envvars.py and config.py re-export the same objects).
"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import transformer_engine
from transformer_engine.common import env
from transformer_engine.common.env import (
    OWN_VARIABLES,
    RECIPE_VARIABLES,
    THIRD_PARTY_VARIABLES,
    TYPES,
    VARIABLES,
    PolicyConfigWarning,
    declared,
    describe,
    read_bool,
    read_choice,
    read_flag,
    read_switch,
    triton_interpret,
)
from transformer_engine.common.recipe import Float8BlockScaling, Float8CurrentScaling, NVFP4BlockScaling

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(transformer_engine.__file__).resolve().parent

#: files of the package that may touch os.environ themselves, and why (everything else reads through common/env.py)
ENVIRON_EXCEPTIONS = {
    "common/env.py": "the readers themselves",
    "cli/bench.py": "copies the whole environment for the benchmark subprocesses it starts (reads no variable)",
}
_ENVIRON = re.compile(r"\bos\.(?:environ|getenv|putenv|unsetenv)\b|\bgetenv\(|\bfrom os import\b[^\n]*\b(?:environ|getenv)\b")
_READ_CALL = re.compile(r"(?<![.\w])(read_switch|read_flag|read_choice|read_bool|read_env|read|lookup)\(\s*\"([A-Z][A-Z0-9_]*)\"")
_READER_TYPE = {"read_switch": "switch", "read_flag": "flag", "read_choice": "choice", "read_bool": "bool"}


def _sources():
    return {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}


# -- layering ----------------------------------------------------------------------------------
def test_import_loads_neither_torch_nor_the_plugin():
    code = (
        "import sys, transformer_engine.common.env, transformer_engine.common.recipe as r; r.NVFP4BlockScaling(); "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformer_engine.plugin', 'triton'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_plugin_modules_re_export_the_same_objects():
    from transformer_engine.plugin.core import PolicyConfigWarning as core_warning
    from transformer_engine.plugin.core import config, envvars

    assert envvars.VARIABLES is OWN_VARIABLES and envvars.EnvVar is env.EnvVar
    for name in ("lookup", "read", "closest", "closest_name", "check_environment", "config_warning", "describe", "reset_warnings"):
        assert getattr(envvars, name) is getattr(env, name), name
    assert config.read_flag is read_flag and config.triton_interpret is triton_interpret
    assert core_warning is PolicyConfigWarning is envvars.PolicyConfigWarning is config.PolicyConfigWarning


# -- the declarations --------------------------------------------------------------------------
def test_declarations_are_complete_and_unique():
    names = [v.name for v in VARIABLES] + [a for v in VARIABLES for a in v.aliases]
    assert len(names) == len(set(names))
    assert VARIABLES == OWN_VARIABLES + RECIPE_VARIABLES + THIRD_PARTY_VARIABLES
    assert all(v.name.startswith("TE_FL_") for v in OWN_VARIABLES)
    assert all(v.name.startswith("NVTE_") for v in RECIPE_VARIABLES)
    for var in VARIABLES:
        assert var.description and var.default and var.type in TYPES, var
        assert var.scope in ("library", "cli", "tests", "benchmarks"), var
        assert bool(var.choices) is (var.type == "choice"), var


def test_recipe_choices_default_to_one_of_their_choices():
    for var in RECIPE_VARIABLES:
        if var.type == "choice" and var.name != "NVTE_BACKWARD_OVERRIDE":  # unset: backward_override=None
            assert var.default in var.choices, var


def test_every_read_in_the_package_names_a_declared_variable_of_its_type():
    reads = [(path, reader, name) for path, text in _sources().items() for reader, name in _READ_CALL.findall(text)]
    assert {name for _, _, name in reads} >= {v.name for v in RECIPE_VARIABLES}, "an NVTE_* declaration nobody reads"
    for path, reader, name in reads:
        var = declared(name)  # KeyError: read but not declared
        assert _READER_TYPE.get(reader, var.type) == var.type, (path, reader, name, var.type)


def test_every_nvte_variable_the_package_reads_is_declared():
    used = set()
    for text in _sources().values():
        used |= {name for _, name in _READ_CALL.findall(text) if name.startswith("NVTE_")}
    assert used == {v.name for v in RECIPE_VARIABLES}


def test_only_the_loader_touches_the_environment():
    found = {path for path, text in _sources().items() if _ENVIRON.search(text)}
    assert found <= set(ENVIRON_EXCEPTIONS), sorted(found - set(ENVIRON_EXCEPTIONS))
    assert "common/env.py" in found  # the pattern still finds what it looks for


def test_bench_copies_the_environment_and_reads_no_variable_from_it():
    lines = [line.strip() for line in _sources()["cli/bench.py"].splitlines() if _ENVIRON.search(line)]
    assert lines == ["env = dict(os.environ)"]


# -- the readers -------------------------------------------------------------------------------
def test_readers_refuse_an_undeclared_name_or_another_type():
    with pytest.raises(KeyError):
        read_switch("NVTE_NOT_DECLARED", {})
    with pytest.raises(TypeError, match="NVTE_NVFP4_4OVER6 is declared as a choice variable, not a switch one"):
        read_switch("NVTE_NVFP4_4OVER6", {})
    with pytest.raises(TypeError):
        read_flag("NVTE_NVFP4_DISABLE_RHT", {})
    with pytest.raises(TypeError):
        read_choice("TE_FL_STRICT", {})


@pytest.mark.parametrize("value, on", [("1", True), (None, False), ("0", False), ("", False), ("true", False), ("yes", False),
                                       (" 1", False), ("2", False)])
def test_a_switch_is_on_exactly_for_1_as_in_nvidia_te(value, on, recwarn):
    environ = {} if value is None else {"NVTE_NVFP4_DISABLE_RHT": value}
    assert read_switch("NVTE_NVFP4_DISABLE_RHT", environ) is on
    assert not recwarn.list


@pytest.mark.parametrize("value, on", [("1", True), ("TRUE", True), ("yes", True), (" on ", True), ("0", False), ("off", False),
                                       ("", False), (None, False)])
def test_a_flag_reads_te_fl_spellings(value, on, recwarn):
    environ = {} if value is None else {"TE_FL_FP8_EMULATION": value}
    assert read_flag("TE_FL_FP8_EMULATION", environ) is on
    assert not [w for w in recwarn if issubclass(w.category, PolicyConfigWarning)]


def test_a_flag_with_another_value_warns_once_and_is_off():
    env.reset_warnings()
    with pytest.warns(PolicyConfigWarning, match=r"ignoring TE_FL_FP8_EMULATION='maybe': expected 1 or 0"):
        assert read_flag("TE_FL_FP8_EMULATION", {"TE_FL_FP8_EMULATION": "maybe"}) is False
    env.reset_warnings()


def test_a_choice_is_its_value_or_the_declared_default():
    assert read_choice("NVTE_NVFP4_4OVER6", {}) == "none"
    assert read_choice("NVTE_NVFP4_4OVER6_E4M3_USE_256", {}) == "all"
    assert read_choice("NVTE_NVFP4_4OVER6_ERR_MODE", {}) == "MAE"
    assert read_choice("NVTE_BACKWARD_OVERRIDE", {}) is None  # no default value: unset
    assert read_choice("TE_FL_LOG_LEVEL", {}) is None  # default in words
    assert read_choice("NVTE_NVFP4_4OVER6", {"NVTE_NVFP4_4OVER6": "bogus"}) == "bogus"  # the caller checks it


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("On", True), ("YES", True), ("y", True), ("0", False),
                                       ("", False), (" 1", False), ("2", False), (None, False)])
def test_triton_interpret_follows_tritons_rule(value, on):
    environ = {} if value is None else {"TRITON_INTERPRET": value}
    assert triton_interpret(environ) is on
    assert read_bool("TRITON_INTERPRET", environ) is on


@pytest.mark.parametrize("value", ["1", "true", "On", "y", "0", "", "2", None])  # " 1": on for Triton 3.4 only (it strips)
def test_triton_interpret_agrees_with_the_installed_triton(value, monkeypatch):
    knobs = pytest.importorskip("triton.knobs", reason="Triton < 3.4 reads TRITON_INTERPRET == '1' (a subset of the rule)")
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpret() is bool(knobs.runtime.interpret)


# -- the recipes' environment defaults: NVIDIA TE's rules, unchanged ---------------------------
def test_recipe_switches_are_on_only_for_1(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "true")
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "yes")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Float8BlockScaling().use_f32_scales is False
        assert Float8CurrentScaling().use_power_2_scales is False
        assert NVFP4BlockScaling().disable_stochastic_rounding is True
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert Float8BlockScaling().use_f32_scales is True


def test_recipe_choices_come_from_the_environment_and_are_checked_by_the_recipe(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "weights")
    monkeypatch.setenv("NVTE_NVFP4_4OVER6_ERR_MODE", "MSE")
    recipe = NVFP4BlockScaling()
    assert (recipe.nvfp4_4over6, recipe.nvfp4_4over6_err_mode, recipe.nvfp4_4over6_e4m3_use_256) == ("weights", "MSE", "all")
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "")
    with pytest.raises(ValueError, match="nvfp4_4over6"):
        NVFP4BlockScaling()
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "")
    monkeypatch.delenv("NVTE_NVFP4_4OVER6")
    assert NVFP4BlockScaling().backward_override is None


# -- te-fl info --------------------------------------------------------------------------------
def test_describe_lists_te_fl_first_then_the_recipe_and_third_party_variables():
    rows = describe({"NVTE_NVFP4_DISABLE_RHT": "1", "TRITON_INTERPRET": "1", "TE_FL_STRCT": "1", "NVTE_OTHER": "x"})
    names = [row["name"] for row in rows]
    assert names == [v.name for v in VARIABLES] + ["TE_FL_STRCT"]  # NVTE_OTHER: NVIDIA TE's, not checked here
    by_name = {row["name"]: row for row in rows}
    assert by_name["NVTE_NVFP4_DISABLE_RHT"]["value"] == "1" and by_name["NVTE_NVFP4_DISABLE_RHT"]["type"] == "switch"
    assert by_name["TRITON_INTERPRET"]["value"] == "1" and by_name["NVTE_NVFP4_4OVER6"]["value"] is None
