"""The examples under ``examples/`` run as written, and the out-of-tree plugin works once installed.

Each CPU-capable example runs in a fresh interpreter (``sys.executable examples/<name>.py``) at its
small default sizes; the test checks the exit code and the key lines of its output. The plugin
packages (``out_of_tree_plugin``, and ``upstream_style_plugin`` written against upstream TE-FL's
plugin API) are built offline into temporary folders (pip without index or build isolation, or by
hand when pip cannot build them) and exercised in subprocesses whose ``PYTHONPATH`` points there.
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
UPSTREAM_PLUGIN_SRC = EXAMPLES / "upstream_style_plugin"
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
    if not {PLUGIN_SRC, UPSTREAM_PLUGIN_SRC} & set(p.parents) and p.relative_to(EXAMPLES).as_posix() not in _DEDICATED
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
def _install_by_hand(src: Path, site: Path, package: str, dist: str, entry: str) -> None:
    """What pip would install: the package plus a dist-info with METADATA and entry_points.txt."""
    shutil.copytree(src / package, site / package)
    info = site / f"{package}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[te_fl.plugin]\n{entry} = {package}\n")


def _build_site(root: Path, plugin_src: Path, package: str, dist: str, entry: str) -> Path:
    """Install the example plugin at ``plugin_src`` into ``root/site`` offline, from a copy of its sources."""
    src, site = root / "src", root / "site"
    shutil.copytree(plugin_src, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--no-cache-dir", "--quiet", "--target", str(site), str(src)]
    if subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S).returncode != 0:
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir()
        _install_by_hand(src, site, package, dist, entry)
    assert (site / package / "__init__.py").exists()
    return site


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """A folder holding the installed example plugin."""
    return _build_site(tmp_path_factory.mktemp("plugin"), PLUGIN_SRC, "te_fl_example_plugin", "te-fl-example-plugin", "example")


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


# --- examples/upstream_style_plugin (written against upstream TE-FL's plugin API) ------------------
UPSTREAM_IMPL = "vendor.myvendor"
_UPSTREAM_OPS = ("rmsnorm_fwd", "rmsnorm_bwd", "swiglu", "dswiglu")


@pytest.fixture(scope="module")
def upstream_plugin_site(tmp_path_factory):
    """A folder holding the installed upstream-style example plugin (entry point ``myvendor``)."""
    return _build_site(tmp_path_factory.mktemp("upstream_plugin"), UPSTREAM_PLUGIN_SRC, "te_fl_upstream_example",
                       "te-fl-upstream-example", "myvendor")


# Prints, as JSON: the loaded non-builtin plugins and the upstream-compat warnings of loading them;
# which impl serves rmsnorm_fwd / swiglu by default; the plugin's call counter after te.RMSNorm and
# te.ops.SwiGLU ran forward and backward on odd sizes, and their largest differences to the same
# modules run under with_preference("reference"); and explain's (impl, status, reason) for an fp32
# call, an fp16 call (outside supported_dtypes) and a zero_centered_gamma call (the **kwargs impl cannot take it).
_UPSTREAM_PROBE = """
import json, warnings, torch
import te_fl_upstream_example as plugin
import transformer_engine.pytorch as te
from transformer_engine.plugin import explain, get_default_manager, ops
from transformer_engine.plugin.compat import UpstreamCompatWarning
from transformer_engine.plugin.core import with_preference
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    get_default_manager().ensure_initialized()
torch.manual_seed(0)
x, w = torch.randn(37, 29), torch.rand(29) + 0.5
h = torch.randn(37, 2 * 13)
def block():
    norm = te.RMSNorm(29, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
    xr, hr = x.clone().requires_grad_(True), h.clone().requires_grad_(True)
    y, z = norm(xr), te.ops.SwiGLU()(hr)
    (y * torch.cos(y)).sum().backward()
    (z * torch.sin(z)).sum().backward()
    return [y, xr.grad, norm.weight.grad, z, hr.grad]
plugin.CALLS.clear()
got = block()
calls = dict(plugin.CALLS)
with with_preference("reference"):
    ref = block()
why = lambda *a, **k: [[d.impl_id, d.status, d.reason] for d in explain(*a, **k)]
print(json.dumps({
    "plugins": [[r.name, r.source, r.ok, r.impl_ids] for r in get_default_manager().plugin_records if r.source != "builtin"],
    "compat_warnings": [str(m.message) for m in caught if issubclass(m.category, UpstreamCompatWarning)],
    "rmsnorm_fwd": ops.rmsnorm_fwd.traced(x, w, 1e-5)[1].impl_id, "swiglu": ops.swiglu.traced(h)[1].impl_id,
    "calls": calls, "errors": [(a - b).abs().max().item() for a, b in zip(got, ref)],
    "explain_fp32": why("rmsnorm_fwd", x, w, 1e-5), "explain_fp16": why("swiglu", h.half()),
    "explain_zero_centered": why("rmsnorm_fwd", x, w, 1e-5, zero_centered_gamma=True),
}))
"""


def _upstream_probe(extra_path, **variables):
    return json.loads(_run(["-c", _UPSTREAM_PROBE], env=_env(extra_path, **variables)).strip().splitlines()[-1])


def _decision(explained, impl_id):
    return next((status, reason) for impl, status, reason in explained if impl == impl_id)


def test_upstream_style_plugin_runs_modules_and_matches_reference(upstream_plugin_site):
    result = _upstream_probe([upstream_plugin_site], MYVENDOR_AVAILABLE="1")
    assert result["plugins"] == [["myvendor", "entry_point", True, [UPSTREAM_IMPL]]]
    assert result["compat_warnings"] == []  # every op it registers has a catalog equivalent
    assert result["rmsnorm_fwd"] == result["swiglu"] == UPSTREAM_IMPL  # vendor priority 200; flagos declines the CPU
    assert result["calls"] == dict.fromkeys(_UPSTREAM_OPS, 1)
    # float32 math on both sides; 1e-5 absorbs a different evaluation order (row means, sigmoid forms)
    assert max(result["errors"]) <= 1e-5, result["errors"]
    assert _decision(result["explain_fp32"], UPSTREAM_IMPL)[0] == "selected"
    status, reason = _decision(result["explain_fp16"], UPSTREAM_IMPL)  # supported_dtypes={"float32", "bfloat16"}
    assert status == "rejected" and "float16" in reason
    status, reason = _decision(result["explain_zero_centered"], UPSTREAM_IMPL)
    assert status == "rejected" and "zero_centered_gamma" in reason


def test_upstream_style_plugin_unavailable_leaves_default_selection(upstream_plugin_site):
    result = _upstream_probe([upstream_plugin_site])  # MYVENDOR_AVAILABLE unset: fn._is_available() is False
    assert result["plugins"] == [["myvendor", "entry_point", True, [UPSTREAM_IMPL]]]
    assert result["rmsnorm_fwd"] == result["swiglu"] == "reference.torch"
    assert result["calls"] == {} and max(result["errors"]) == 0.0
    status, reason = _decision(result["explain_fp32"], UPSTREAM_IMPL)
    assert status == "rejected" and "_is_available" in reason


def test_upstream_style_plugin_loads_from_env_module_list():
    result = _upstream_probe([UPSTREAM_PLUGIN_SRC], TE_FL_PLUGIN_MODULES="te_fl_upstream_example", MYVENDOR_AVAILABLE="1")
    assert result["plugins"] == [["te_fl_upstream_example", "env", True, [UPSTREAM_IMPL]]]
    assert result["calls"] == dict.fromkeys(_UPSTREAM_OPS, 1)


def test_upstream_style_plugin_demo(upstream_plugin_site):
    out = _run([str(UPSTREAM_PLUGIN_SRC / "demo.py")], env=_env([upstream_plugin_site]))
    assert out.rstrip().endswith("upstream_style_plugin demo done"), out
    assert "get_manager().call('rmsnorm_fwd'): output (7, 48), rsigma (7, 1)" in out  # upstream's (output, rsigma)
    assert "calls on the plugin: {'dswiglu': 1, 'rmsnorm_bwd': 1, 'rmsnorm_fwd': 1, 'swiglu': 1}" in out
    diffs = [float(v) for v in re.findall(r"max \|plugin - reference\| [\w ]+: (\S+)", out)]
    assert len(diffs) == 3 and max(diffs) <= 1e-5, out
    assert f"explain rmsnorm_fwd: {UPSTREAM_IMPL} selected" in out


def test_upstream_style_plugin_in_te_fl_info(upstream_plugin_site):
    out = _run(["-m", "transformer_engine", "info", "--json", *(a for op in _UPSTREAM_OPS for a in ("--op", op))],
               env=_env([upstream_plugin_site], MYVENDOR_AVAILABLE="1"))
    info = json.loads(out)
    records = [b for b in info["backends"] if b["name"] == "myvendor"]
    assert len(records) == 1 and records[0]["source"] == "entry_point" and records[0]["ok"], info["backends"]
    assert records[0]["impl_ids"] == [UPSTREAM_IMPL] and records[0]["ops"] == len(_UPSTREAM_OPS)
    for op in _UPSTREAM_OPS:
        assert UPSTREAM_IMPL in [c["impl_id"] for c in info["dispatch"]["cpu"][op]["candidates"]]
