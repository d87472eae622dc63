"""The package surface of transformer_engine.jax and its error when JAX is missing."""

import subprocess
import sys
from pathlib import Path

import transformer_engine.jax as te


def test_public_names():
    assert sorted(te.__all__) == sorted(
        ["NVTE_FP8_COLLECTION_NAME", "autocast", "fp8_autocast", "update_collections", "MeshResource", "flax",
         "quantize"])
    assert te.NVTE_FP8_COLLECTION_NAME == "fp8_metas"
    for module in ("dense", "layernorm", "layernorm_dense", "layernorm_mlp", "activation", "softmax",
                   "attention", "quantize", "sharding"):
        assert hasattr(te, module), module
    assert callable(te.dense.dense) and callable(te.attention.fused_attn)


def test_missing_jax_says_how_to_install():
    code = "import sys; sys.modules['jax'] = None; import transformer_engine.jax"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=120)
    assert result.returncode != 0
    assert "pip install 'transformer_engine[jax]'" in result.stderr
