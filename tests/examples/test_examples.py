"""The examples under ``examples/`` run as written, and the out-of-tree plugin works once installed.

Each CPU-capable example runs in a fresh interpreter (``sys.executable examples/<name>.py``) at its
small default sizes; the test checks the exit code and the key lines of its output. The plugin
package is built offline into a temporary folder (pip without index or build isolation, or by hand
when pip cannot build it) and exercised in subprocesses whose ``PYTHONPATH`` points there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PLUGIN_SRC = EXAMPLES / "out_of_tree_plugin"
TIMEOUT_S = 300  # generous: the CI machine is shared; a normal run takes seconds
SQNR_FLOOR_DB = 20.0  # FP8 (E4M3 fwd / E5M2 bwd) of a small layer lands at 25-55 dB; 20 dB flags a real error


def _env(extra_path=(), **variables):
    """The environment of a child: the repo (and extras) importable, no inherited TE_FL_* settings.

    ``TRITON_INTERPRET`` is dropped too: a suite run with it set must not push the examples onto
    Triton's (slow) interpreter; they run on the machine's default backends, as a user's would.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TE_FL_", "TEFL_")) and k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(REPO)])
    env.update(variables)
    return env


def _run(args, env=None):
    """Run ``python args...`` from the repo root; return stdout, failing the test with stderr on error."""
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


# --- every other example (e.g. the tutorial): it runs at its defaults and prints its key lines ---
_DEDICATED = {"quickstart.py", "convert_model.py"}  # checked in detail below
# path under examples/ -> lines its output must contain (an example not listed must just exit 0)
_KEY_LINES = {
    "pytorch/transformer_layer_tutorial.py": (
        "high precision: max |difference| to the plain PyTorch layer",
        "FP8 (DelayedScaling): max |difference| to the plain PyTorch layer",
    ),
}
_OTHER_EXAMPLES = sorted(
    p.relative_to(EXAMPLES).as_posix()
    for p in EXAMPLES.rglob("*.py")
    if PLUGIN_SRC not in p.parents and p.relative_to(EXAMPLES).as_posix() not in _DEDICATED
)


@pytest.mark.parametrize("name", _OTHER_EXAMPLES)
def test_other_example_runs(name):
    out = _run([f"examples/{name}"])
    for line in _KEY_LINES.get(name, ()):
        assert line in out, out


# --- examples/quickstart.py -----------------------------------------------------------------------
def test_quickstart_runs_and_fp8_is_close_to_high_precision():
    out = _run(["examples/quickstart.py"])
    assert out.rstrip().endswith("quickstart done")
    sqnrs = [float(v) for v in re.findall(r"SQNR\s+([-\d.]+|inf) dB", out)]
    assert len(sqnrs) == 4, out  # output and input grad of two models
    assert min(sqnrs) >= SQNR_FLOOR_DB, out
    fwd_scales = re.findall(r'fp8_meta\["scaling_fwd"\]\.scale = \[([^\]]*)\]', out)
    bwd_scales = re.findall(r'fp8_meta\["scaling_bwd"\]\.scale = \[([^\]]*)\]', out)
    assert len(fwd_scales) == len(bwd_scales) == 4, out  # linear + qkv, proj, layernorm_mlp
    # after a delayed-scaling update the input scale is fp8_max / amax, no longer the initial 1
    assert all(float(s.split(",")[0]) != 1.0 for s in fwd_scales + bwd_scales), out


# --- examples/convert_model.py --------------------------------------------------------------------
def test_convert_model_runs_and_fp8_training_tracks_high_precision():
    out = _run(["examples/convert_model.py"])
    assert out.rstrip().endswith("convert_model done"), out
    assert re.search(r"^lm_head\s+kept: module_filter_fn$", out, re.M), out
    assert "converted 13 of 14 modules" in out  # 2 blocks x (2 norms + 4 linears) + ln_f
    max_diff = float(re.search(r"max \|converted - original\| = (\S+)", out).group(1))
    assert max_diff <= 1e-5
    gap = float(re.search(r"final loss gap FP8 vs high precision: (\S+)%", out).group(1))
    assert gap < 10.0


@pytest.fixture(scope="module")
def convert_model():
    spec = importlib.util.spec_from_file_location("_example_convert_model", EXAMPLES / "convert_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_convert_to_te_rules_and_same_output(convert_model):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.LayerNorm(48), nn.Linear(48, 32), nn.GELU(),
        nn.Sequential(nn.Linear(32, 16, bias=False), nn.Linear(16, 16), nn.Linear(16, 13)),  # 13: no FP8
        nn.LayerNorm(13, elementwise_affine=False),  # no weight: stays
    )
    x = torch.randn(7, 48)
    expected = model(x)
    report = convert_model.convert_to_te(model, module_filter_fn=lambda m, fqn: fqn != "3.1")
    assert report == {
        "0": "-> te.LayerNorm", "1": "-> te.Linear", "3.0": "-> te.Linear", "3.1": "kept: module_filter_fn",
        "3.2": "kept: shape 16->13 breaks the FP8 rule (both % 16 == 0)",
        "4": "kept: te.LayerNorm needs one normalized dim with weight and bias",
    }
    assert isinstance(model[0], te.LayerNorm) and isinstance(model[1], te.Linear) and isinstance(model[3][0], te.Linear)
    assert type(model[3][1]) is nn.Linear and type(model[3][2]) is nn.Linear and type(model[4]) is nn.LayerNorm
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


# --- examples/out_of_tree_plugin ------------------------------------------------------------------
def _install_by_hand(site: Path) -> None:
    """What pip would install: the package plus a dist-info with METADATA and entry_points.txt."""
    shutil.copytree(PLUGIN_SRC / "te_fl_example_plugin", site / "te_fl_example_plugin")
    info = site / "te_fl_example_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: te-fl-example-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[te_fl.plugin]\nexample = te_fl_example_plugin\n")


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """A folder holding the installed example plugin (built offline from a copy of its sources)."""
    root = tmp_path_factory.mktemp("plugin")
    src, site = root / "src", root / "site"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--no-cache-dir", "--quiet", "--target", str(site), str(src)]
    if subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S).returncode != 0:
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir()
        _install_by_hand(site)
    assert (site / "te_fl_example_plugin" / "__init__.py").exists()
    return site


# Prints, as JSON: the loaded non-builtin plugins, which impl ran gelu/dgelu through ops (and which a
# built-ins-only manager picks for the same call), the plugin's call counter, and the plugin's
# numerical error against the reference backend on an odd-sized input.
_PROBE = """
import json, torch
import te_fl_example_plugin as plugin
from transformer_engine.plugin import OpManager, get_default_manager, ops
torch.manual_seed(0)
x, dy = torch.randn(37, 5), torch.randn(37, 5)
manager, builtins = get_default_manager(), OpManager(discover=False)
_, gelu_impl = ops.gelu.traced(x)
_, dgelu_impl = ops.dgelu.traced(dy, x)
calls = dict(plugin.CALLS)
ref = lambda op, *a: manager.call_impl(op, "reference.torch", *a)
print(json.dumps({
    "plugins": [[r.name, r.source, r.ok, r.impl_ids] for r in manager.plugin_records if r.source != "builtin"],
    "gelu": gelu_impl.impl_id, "dgelu": dgelu_impl.impl_id, "calls": calls,
    "builtin_gelu": builtins.select("gelu", x).impl_id, "builtin_dgelu": builtins.select("dgelu", dy, x).impl_id,
    "gelu_err": (plugin.gelu(x) - ref("gelu", x)).abs().max().item(),
    "dgelu_err": (plugin.dgelu(dy, x) - ref("dgelu", dy, x)).abs().max().item(),
}))
"""


def _probe(site, **variables):
    return json.loads(_run(["-c", _PROBE], env=_env([site], **variables)).strip().splitlines()[-1])


def test_plugin_selected_by_per_op_policy(plugin_site):
    result = _probe(plugin_site, TE_FL_PER_OP="gelu=vendor:example")
    assert result["plugins"] == [["example", "entry_point", True, ["vendor.example"]]]
    assert result["gelu"] == "vendor.example"
    assert result["dgelu"] == result["builtin_dgelu"]  # the policy names gelu only
    assert result["calls"] == {"gelu": 1}
    # float32 math in both; 1e-6 absorbs a different evaluation order of the tanh formula
    assert result["gelu_err"] <= 1e-6 and result["dgelu_err"] <= 1e-6


def test_plugin_leaves_default_selection_unchanged(plugin_site):
    result = _probe(plugin_site)
    assert result["plugins"] == [["example", "entry_point", True, ["vendor.example"]]]
    assert (result["gelu"], result["dgelu"]) == (result["builtin_gelu"], result["builtin_dgelu"])
    assert result["calls"] == {}


def test_te_fl_info_json_lists_plugin(plugin_site):
    out = _run(["-m", "transformer_engine", "info", "--json", "--op", "gelu", "--op", "dgelu"], env=_env([plugin_site]))
    info = json.loads(out)
    records = [b for b in info["backends"] if b["name"] == "example"]
    assert len(records) == 1 and records[0]["source"] == "entry_point" and records[0]["ok"], info["backends"]
    assert records[0]["impl_ids"] == ["vendor.example"] and records[0]["ops"] == 2
    for op in ("gelu", "dgelu"):
        assert "vendor.example" in [c["impl_id"] for c in info["dispatch"]["cpu"][op]["candidates"]]
