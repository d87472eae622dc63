#!/usr/bin/env bash
# One-step set-up from a fresh clone: PyTorch first (so no other requirement pulls a multi-GB
# CUDA build by accident), then this package in editable mode with the PyTorch, JAX and test extras.
# Each step says what it does; pip shows its own progress (downloads, builds). Run it inside a
# virtual environment (python3 -m venv .venv && . .venv/bin/activate) to keep the system Python clean.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "==> setup: $*" >&2; }
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null && [ -z "${CONDA_PREFIX:-}" ]; then
    step "note: no virtual environment is active, installing into $("$PY" -c 'import sys; print(sys.prefix)')" \
         "(python3 -m venv .venv && . .venv/bin/activate first keeps it separate)"
fi
if "$PY" -c "import torch" >/dev/null 2>&1; then
    step "PyTorch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
    # On the project's CPU machines torch==2.13.0 resolves to a local CPU wheel.
    step "1/2 installing PyTorch (a large download the first time: a few minutes)"
    "$PY" -m pip install --progress-bar on "torch==2.13.0" || "$PY" -m pip install --progress-bar on torch
fi
step "2/2 installing transformer_engine (editable) with the pytorch, jax and test extras"
"$PY" -m pip install --progress-bar on -e ".[pytorch,jax,test]"
step "done: try 'te-fl info', 'te-fl demo' or 'python -m pytest -q'"
