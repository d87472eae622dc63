"""``te-fl info``: the report's content, its JSON form, plain text without rich, and the command line."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_engine import __version__
from transformer_engine.cli import info as info_module
from transformer_engine.cli import main
from transformer_engine.plugin.core import get_default_manager, list_specs, reset_global_policy
from transformer_engine.plugin.core.discovery import BUILTIN_BACKENDS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")  # rich tables: one line per row, so rows can be searched
    for name in ("TE_FL_PREFER", "TE_FL_STRICT", "TE_FL_PER_OP", "TE_FL_ALLOW_VENDORS", "TE_FL_DENY_VENDORS"):
        monkeypatch.delenv(name, raising=False)
    reset_global_policy()
    yield
    reset_global_policy()


def _info_json(capsys, *extra):
    assert main(["info", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_has_every_section(capsys):
    info = _info_json(capsys)
    assert set(info) == {"versions", "devices", "recipes", "jax", "backends", "policy", "settings", "dispatch"}
    versions = info["versions"]
    assert versions["te_fl"] == __version__ and versions["python"] == platform.python_version()
    torch = pytest.importorskip("torch")
    assert versions["torch"] == torch.__version__
    assert info["devices"][0]["type"] == "cpu"
    cuda = [d for d in info["devices"] if d["type"] == "cuda"]
    assert len(cuda) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert all(d["name"] and d["compute_capability"].count(".") == 1 for d in cuda)


def test_json_recipes_answer_with_a_reason(capsys):
    recipes = _info_json(capsys)["recipes"]
    assert [r["recipe"].split(" ")[0] for r in recipes] == ["FP8", "MXFP8", "FP8", "NVFP4"]
    for r in recipes:
        assert isinstance(r["available"], bool) and isinstance(r["reason"], str)
        assert r["available"] or r["reason"], f"{r['recipe']} is unavailable without a reason"


def test_json_backends_are_the_manager_records(capsys):
    backends = _info_json(capsys)["backends"]
    manager = get_default_manager()
    assert [b["name"] for b in backends] == [r.name for r in manager.plugin_records]
    assert [b["name"] for b in backends if b["source"] == "builtin"] == list(BUILTIN_BACKENDS)
    for b in backends:
        assert b["ok"] is (b["error"] is None)


def test_json_dispatch_table_matches_describe(capsys):
    info = _info_json(capsys)
    manager = get_default_manager()
    expected = {"cpu"} | ({"cuda"} if any(d["type"] == "cuda" for d in info["devices"]) else set())
    assert set(info["dispatch"]) == expected
    cpu = info["dispatch"]["cpu"]
    assert set(cpu) == {spec.name for spec in list_specs()}
    for op, decisions in manager.describe("cpu").items():
        chosen = next((d.impl_id for d in decisions if d.status == "selected"), None)
        assert cpu[op]["selected"] == chosen
        assert [(c["impl_id"], c["status"], c["reason"]) for c in cpu[op]["candidates"]] == [
            (d.impl_id, d.status, d.reason) for d in decisions
        ]


def test_json_policy_follows_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("TE_FL_PREFER", "reference")
    monkeypatch.setenv("TE_FL_STRICT", "1")
    monkeypatch.setenv("TE_FL_PER_OP", "gemm=vendor:CUDA")
    monkeypatch.setenv("TE_FL_DENY_VENDORS", "Acme")
    reset_global_policy()
    policy = _info_json(capsys)["policy"]
    assert policy["prefer"] == "reference" and policy["strict"] is True
    assert policy["per_op"] == {"gemm": ["vendor:cuda"]}
    assert policy["allow_vendors"] is None and policy["deny_vendors"] == ["acme"]
    assert policy["environment"]["TE_FL_PER_OP"] == "gemm=vendor:CUDA"


def test_settings_list_every_declared_variable_and_the_policy_only_te_fl_ones(capsys, monkeypatch):
    from transformer_engine.common.env import VARIABLES

    monkeypatch.setenv("TE_FL_PER_OP", "gemm=reference")
    monkeypatch.setenv("NVTE_NVFP4_4OVER6_ERR_MODE", "MSE")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reset_global_policy()
    info = _info_json(capsys, "--op", "gemm")
    settings = {row["name"]: row for row in info["settings"]}
    assert [row["name"] for row in info["settings"]][: len(VARIABLES)] == [v.name for v in VARIABLES]
    assert settings["NVTE_NVFP4_4OVER6_ERR_MODE"]["value"] == "MSE" and settings["TRITON_INTERPRET"]["value"] == "0"
    assert settings["NVTE_NVFP4_4OVER6"]["value"] is None and settings["NVTE_NVFP4_4OVER6"]["default"] == "none"
    environment = info["policy"]["environment"]
    assert environment["TE_FL_PER_OP"] == "gemm=reference"
    assert all(name.startswith(("TE_FL_", "TEFL_")) for name in environment), environment
    assert main(["info", "--op", "gemm"]) == 0
    out = capsys.readouterr().out
    for var in VARIABLES:
        assert var.name in out
    assert "[cli only]" in next(line for line in out.splitlines() if "XDG_CACHE_HOME" in line)


def test_op_filter_and_unknown_op(capsys):
    info = _info_json(capsys, "--op", "gemm", "--op", "relu")
    assert set(info["dispatch"]["cpu"]) == {"gemm", "relu"}
    assert main(["info", "--op", "gelo"]) == 2
    assert "unknown op 'gelo'; did you mean gelu" in capsys.readouterr().err


def test_text_report_shows_every_section(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for title in ("TE-FL", "Devices", "FP8 recipes", "JAX", "Backends and plugins", "Policy", "Dispatch on cpu"):
        assert title in out
    assert __version__ in out and platform.python_version() in out
    cpu = _describe_chosen("cpu")
    for op in ("gemm", "layernorm_fwd"):
        assert op in out and (cpu[op] or "nothing (no implementation)") in out


def _describe_chosen(device):
    return {op: next((d.impl_id for d in rows if d.status == "selected"), None) for op,
            rows in get_default_manager().describe(device).items()}


def test_plain_text_without_rich(capsys, monkeypatch):
    for name in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)  # makes "from rich... import" raise ImportError
    assert main(["info", "--op", "gemm"]) == 0
    out = capsys.readouterr().out
    assert "┃" not in out and "│" not in out
    lines = out.splitlines()
    assert "Dispatch on cpu" in lines
    row = next(line for line in lines if line.strip().startswith("gemm "))
    assert (_describe_chosen("cpu")["gemm"] or "nothing") in row


def test_recipes_unavailable_when_the_pytorch_package_cannot_be_imported(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    recipes = _info_json(capsys)["recipes"]
    assert len(recipes) == 4
    for r in recipes:
        assert r["available"] is False and r["reason"].startswith("transformer_engine.pytorch cannot be imported (ModuleNotFoundError")
    assert main(["info"]) == 0
    assert "unavailable: transformer_engine.pytorch cannot be imported (ModuleNotFoundError" in capsys.readouterr().out


def test_main_without_a_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "choose a command: info" in capsys.readouterr().err


def test_main_version_and_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"TE-FL {__version__}"
    with pytest.raises(SystemExit) as done:
        main(["info", "--help"])
    assert done.value.code == 0 and "--json" in capsys.readouterr().out


def test_python_dash_m_runs_the_same_command():
    result = subprocess.run(
        [sys.executable, "-m", "transformer_engine", "info", "--json", "--op", "gemm"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["versions"]["te_fl"] == __version__ and list(info["dispatch"]["cpu"]) == ["gemm"]


def test_jax_section_says_how_attention_runs(capsys):
    """Where JAX is installed the report names the platform it compiles for and the attention path there (einsum on a
    CPU; cuDNN for what ``cudnn_gap`` accepts on a GPU, with the FP8 compile-time flag)."""
    jax = pytest.importorskip("jax")
    info = _info_json(capsys)["jax"]
    assert info["version"] == jax.__version__ and info["backend"] == jax.default_backend()
    if info["backend"] == "cpu":
        assert info["attention"] == "einsum path (the cpu backend has no cuDNN)"
    else:
        assert "cudnn_gap" in info["attention"] and "xla_gpu_enable_triton_gemm" in info["fp8_compile"]
    assert info_module._jax_rows(None) == [("jax", "not installed")]
