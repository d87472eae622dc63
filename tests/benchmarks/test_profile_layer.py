"""benchmarks/profile_layer.py runs end to end on CPU at the small shape and reports what it promises."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_layer_small_run_writes_kernels_and_saved_tensors(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "benchmarks/profile_layer.py", "--small", "--variants", "bf16", "--top", "3",
           "--host-top", "3", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())["variants"]["bf16"]
    assert report["ms"] > 0 and report["back_to_back_ms"] > 0 and report["host_ms"] > 0
    assert any("LayerNormMLP" in name for name in report["kernels"])  # CPU: the autograd Functions' own time
    saved = report["saved_bytes"]
    assert saved and not any(key.startswith("(1024, 256)") for key in saved)  # parameters (fc1 weight) are left out
    assert "function calls" in run.stdout  # the host profile of the forward
