"""The tree passes ruff with the project's configuration (pyproject.toml, [tool.ruff]): no unused or
undefined names, no shadowed imports, no syntax errors. ruff is a test dependency (the ``test`` extra)."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
