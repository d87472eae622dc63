#!/usr/bin/env bash
# The flagos launch path (transformer_engine/plugin/backends/flagos/_launch.py) against the oldest and the
# newest supported Triton: the oldest is the lower bound of the triton requirement in pyproject.toml, the
# newest is the latest release on PyPI that installs on this Python. Each runs in a throw-away virtualenv
# that sees everything else installed here (--system-site-packages), with that Triton installed from PyPI
# only (pip --isolated: no local wheel folders or mirrors), and runs
#   TRITON_INTERPRET=1 python -m pytest -q tests/plugin/backends/flagos/test_launch.py
# (on a CPU: the version-dependent parts of _launch.py that run without a GPU; see that file's docstring).
# PyPI unreachable, a version that does not install or a failing test all fail this script.
#
# Usage: bash scripts/triton_compat.sh            # oldest and newest
#        bash scripts/triton_compat.sh 3.6.0 ...  # these versions instead (newest = the latest release)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=tests/plugin/backends/flagos/test_launch.py
step() { echo "==> triton-compat: $*" >&2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/te-fl-triton.XXXXXX")
trap 'rm -rf "$work"' EXIT

oldest() {  # the X of "triton>=X" in the pytorch extra of pyproject.toml
    "$PY" - <<'EOF'
import re, sys, tomllib
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["optional-dependencies"]["pytorch"]
found = [m.group(1) for d in deps for m in [re.match(r"\s*triton\s*>=\s*([0-9][0-9.]*)", d)] if m]
if len(found) != 1:
    sys.exit(f"triton-compat: expected one 'triton>=X' in the pytorch extra of pyproject.toml, found {deps}")
print(found[0])
EOF
}

run_one() {  # $1: a version, or "newest"
    local want=$1 venv="$work/venv-$1" spec got
    "$PY" -m venv --system-site-packages "$venv"
    if [ "$want" = newest ]; then spec=triton; else spec="triton==$want"; fi
    step "installing $spec from PyPI into a throw-away virtualenv"
    # --isolated: PyPI only (no PIP_* variables, user config, find-links or extra indexes), so an unreachable
    # PyPI fails here instead of silently taking a local copy; --ignore-installed: never the Triton installed
    # here; --no-deps: everything else comes from this Python's site-packages
    "$venv/bin/python" -m pip --isolated install --disable-pip-version-check --progress-bar off --no-deps \
        --ignore-installed --retries 3 --timeout 60 "$spec"
    got=$("$venv/bin/python" -c '
import sys, triton
assert triton.__file__.startswith(sys.prefix), f"triton imported from {triton.__file__}, not from the virtualenv {sys.prefix}"
print(triton.__version__)')
    step "Triton $got ($want): TRITON_INTERPRET=1 pytest $TEST"
    TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "$TEST"
    rm -rf "$venv"
}

if [ $# -gt 0 ]; then
    versions=("$@")
else
    low=$(oldest)
    versions=("$low" newest)
fi
for version in "${versions[@]}"; do
    run_one "$version"
done
step "passed: ${versions[*]}"
