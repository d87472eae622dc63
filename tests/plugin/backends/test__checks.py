"""The shared argument checks import on their own (no cycle through a backend package)."""

import subprocess
import sys


def test_checks_module_imports_first():
    code = "import transformer_engine.plugin.backends._checks as c; print(c.check_norm_fwd.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "check_norm_fwd"
