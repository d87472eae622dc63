"""The TE_FL_* loader: every variable, every token form, every kind of bad value (warns, never raises)."""

import logging

import pytest

from transformer_engine.plugin.core import EnvConfig, PolicyConfigWarning, load_env
from transformer_engine.plugin.core.config import parse_per_op, parse_token


def test_empty_environment_gives_the_documented_defaults():
    cfg = load_env({})
    assert cfg == EnvConfig()
    assert (cfg.prefer, cfg.strict, cfg.allow_vendors, cfg.deny_vendors) == ("flagos", False, None, frozenset())
    assert (cfg.per_op, cfg.plugin_modules, cfg.log_level) == ((), (), logging.WARNING)


def test_load_env_reads_os_environ_when_given_nothing(monkeypatch):
    monkeypatch.setenv("TE_FL_PREFER", "reference")
    monkeypatch.setenv("TE_FL_STRICT", "1")
    cfg = load_env()
    assert cfg.prefer == "reference" and cfg.strict is True


# -- TE_FL_PREFER ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [("flagos", "flagos"), ("vendor", "vendor"), ("reference", "reference"), ("  VENDOR ", "vendor"), ("Reference", "reference"),
     ("", "flagos")],
)
def test_prefer_accepts_the_three_kinds_in_any_case(value, expected, recwarn):
    assert load_env({"TE_FL_PREFER": value}).prefer == expected
    assert not [w for w in recwarn if issubclass(w.category, PolicyConfigWarning)]


@pytest.mark.parametrize("value", ["default", "cuda", "flag_os", "vendor:cuda", "1"])
def test_prefer_bad_value_warns_naming_it_and_keeps_flagos(value):
    with pytest.warns(PolicyConfigWarning, match="TE_FL_PREFER") as record:
        cfg = load_env({"TE_FL_PREFER": value})
    assert cfg.prefer == "flagos"
    assert repr(value) in str(record[0].message)


# -- TE_FL_STRICT ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " 1 "])
def test_strict_true_values(value):
    assert load_env({"TE_FL_STRICT": value}).strict is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_strict_false_values(value, recwarn):
    assert load_env({"TE_FL_STRICT": value}).strict is False
    assert not [w for w in recwarn if issubclass(w.category, PolicyConfigWarning)]


@pytest.mark.parametrize("value", ["2", "maybe", "strict"])
def test_strict_bad_value_warns_and_means_fallback(value):
    with pytest.warns(PolicyConfigWarning, match=f"TE_FL_STRICT={value!r}"):
        assert load_env({"TE_FL_STRICT": value}).strict is False


# -- vendor lists ------------------------------------------------------------------------------
def test_vendor_lists_are_lower_cased_and_trimmed():
    cfg = load_env({"TE_FL_ALLOW_VENDORS": " CUDA, MetaX ,,", "TE_FL_DENY_VENDORS": "Hygon,KUNLUNXIN"})
    assert cfg.allow_vendors == frozenset({"cuda", "metax"})
    assert cfg.deny_vendors == frozenset({"hygon", "kunlunxin"})


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_allow_list_means_every_vendor(value):
    assert load_env({"TE_FL_ALLOW_VENDORS": value}).allow_vendors is None


@pytest.mark.parametrize("value", [",", " , ,"])
def test_allow_list_naming_no_vendor_warns_instead_of_denying_every_vendor(value):
    with pytest.warns(PolicyConfigWarning, match="TE_FL_ALLOW_VENDORS"):
        assert load_env({"TE_FL_ALLOW_VENDORS": value}).allow_vendors is None


# -- TE_FL_PER_OP ------------------------------------------------------------------------------
def test_per_op_parses_every_token_form_sorted_by_op():
    text = " relu = flagos ; gemm=vendor:CUDA|impl:Vendor.My_X|reference ;dgelu=VENDOR|Reference"
    assert load_env({"TE_FL_PER_OP": text}).per_op == (
        ("dgelu", ("vendor", "reference")),
        ("gemm", ("vendor:cuda", "impl:Vendor.My_X", "reference")),
        ("relu", ("flagos",)),
    )


def test_per_op_keeps_a_final_only_marker_in_any_case():
    assert parse_per_op("gemm=vendor:cuda|ONLY") == (("gemm", ("vendor:cuda", "only")),)


def test_per_op_later_entry_for_the_same_op_wins():
    assert parse_per_op("relu=flagos;relu=reference") == (("relu", ("reference",)),)


def test_per_op_empty_parts_are_skipped_silently(recwarn):
    assert parse_per_op(";; relu=vendor ;") == (("relu", ("vendor",)),)
    assert not [w for w in recwarn if issubclass(w.category, PolicyConfigWarning)]


@pytest.mark.parametrize(
    "entry, reason",
    [
        ("gemm", "expected op=token"),
        ("1gemm=flagos", "is not an op name"),
        ("gem m=flagos", "is not an op name"),
        ("gemm=", "no valid token"),
        ("gemm=default", "no valid token"),
        ("gemm=only", "no valid token"),
    ],
)
def test_per_op_bad_entry_warns_and_is_dropped_while_good_ones_stay(entry, reason):
    with pytest.warns(PolicyConfigWarning) as record:
        parsed = parse_per_op(f"{entry};relu=reference")
    assert parsed == (("relu", ("reference",)),)
    assert any(reason in str(w.message) and repr(entry) in str(w.message) for w in record)


def test_per_op_unknown_token_is_dropped_and_the_rest_kept():
    with pytest.warns(PolicyConfigWarning, match="'default'"):
        assert parse_per_op("gemm=default|vendor:cuda") == (("gemm", ("vendor:cuda",)),)


def test_per_op_only_in_the_middle_is_an_unknown_token():
    with pytest.warns(PolicyConfigWarning, match="'only'"):
        assert parse_per_op("gemm=only|reference") == (("gemm", ("reference",)),)


# -- tokens ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "token, expected",
    [
        ("flagos", "flagos"),
        (" Vendor ", "vendor"),
        ("REFERENCE", "reference"),
        ("vendor:CUDA", "vendor:cuda"),
        ("Vendor: Metax ", "vendor:metax"),
        ("impl:vendor.CUDA", "impl:vendor.CUDA"),
        ("IMPL: reference.torch", "impl:reference.torch"),
    ],
)
def test_parse_token_valid_forms(token, expected):
    assert parse_token(token) == expected


@pytest.mark.parametrize("token", ["default", "cuda", "vendor:", "impl:", "", "flagos|vendor", "kind:vendor"])
def test_parse_token_invalid_forms_warn_and_give_none(token):
    with pytest.warns(PolicyConfigWarning, match="valid tokens are"):
        assert parse_token(token) is None


# -- plugin modules and log level --------------------------------------------------------------
def test_plugin_modules_comma_list():
    assert load_env({"TE_FL_PLUGIN_MODULES": " pkg_a , pkg.b,, c "}).plugin_modules == ("pkg_a", "pkg.b", "c")


@pytest.mark.parametrize("name, level",
                         [("debug", logging.DEBUG), ("INFO", logging.INFO), (" Error ", logging.ERROR), ("", logging.WARNING)])
def test_log_level_names(name, level):
    assert load_env({"TE_FL_LOG_LEVEL": name}).log_level == level


@pytest.mark.parametrize("name", ["LOUD", "5", "warn"])
def test_log_level_bad_value_warns_and_keeps_warning(name):
    with pytest.warns(PolicyConfigWarning, match=f"ignoring TE_FL_LOG_LEVEL={name!r}: expected one of"):
        assert load_env({"TE_FL_LOG_LEVEL": name}).log_level == logging.WARNING


def test_every_bad_value_at_once_warns_per_variable_and_never_raises():
    env = {
        "TE_FL_PREFER": "fast",
        "TE_FL_STRICT": "sometimes",
        "TE_FL_PER_OP": "=;gemm|x;relu=nope",
        "TE_FL_LOG_LEVEL": "chatty",
        "TE_FL_ALLOW_VENDORS": ",",
        "TE_FL_PLUGIN_MODULES": ",,",
    }
    with pytest.warns(PolicyConfigWarning) as record:
        cfg = load_env(env)
    text = "\n".join(str(w.message) for w in record)
    for name in ("TE_FL_PREFER", "TE_FL_STRICT", "TE_FL_PER_OP", "TE_FL_LOG_LEVEL"):
        assert name in text
    assert (cfg.prefer, cfg.strict, cfg.per_op, cfg.plugin_modules) == ("flagos", False, (), ())
