#!/usr/bin/env bash
# One-step set-up from a fresh clone: PyTorch first (so no other requirement pulls a multi-GB
# CUDA build by accident), then this package in editable mode with the PyTorch, JAX and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # On the project's CPU machines torch==2.13.0 resolves to a local CPU wheel.
    "$PY" -m pip install --quiet "torch==2.13.0" || "$PY" -m pip install --quiet torch
fi
"$PY" -m pip install --quiet -e ".[pytorch,jax,test]"
