"""benchmarks/bench_ab.py: each worker imports the tree it is given, and the table covers every case."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ab_workers_import_their_own_trees(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ROOT / "transformer_engine", base / "transformer_engine", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "benchmarks/bench_ab.py", "--base-tree", str(base), "--rounds", "2", "--groups", "small", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert Path(report["trees"]["base"]).resolve().is_relative_to(base.resolve())
    assert Path(report["trees"]["new"]).resolve().is_relative_to((ROOT / "transformer_engine").resolve())
    cases = report["cases"]
    assert set(cases) == {"nn.Linear(256) bf16", "te.Linear(256) bf16", "te.Linear(256) FP8", "nn.LayerNorm + nn.Linear(256) bf16",
                          "te.LayerNormLinear(256) bf16", "nn.LayerNorm + MLP(256) bf16", "te.LayerNormMLP(256) bf16"}
    for timing in cases.values():
        assert len(timing["base_us"]) == len(timing["new_us"]) == 2 and min(timing["base_us"] + timing["new_us"]) > 0


def test_ab_refuses_a_base_tree_without_the_package(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/bench_ab.py", "--base-tree", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "transformer_engine package" in run.stderr
