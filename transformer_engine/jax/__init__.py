"""Transformer Engine for JAX and Flax, in plain JAX (runs on CPU and GPU; no compiled extension).

    import transformer_engine.jax as te
    import transformer_engine.jax.flax as te_flax
    from transformer_engine.common.recipe import DelayedScaling

    with te.autocast(enabled=True, recipe=DelayedScaling()):
        layer = te_flax.DenseGeneral(features=256)
        variables = layer.init(key, x)              # {"params": ..., "fp8_metas": ...}
        loss, grads = jax.value_and_grad(loss_fn)(variables, x)
        # grads["fp8_metas"] holds the *next* FP8 state, grads["params"] the gradients.

FP8 GEMMs are written as clip -> cast to float8 -> ``dot_general`` with a float32 result ->
multiply by the inverse scales, which XLA rewrites into cuBLASLt FP8 GEMMs on Hopper and later
and emulates elsewhere. Functional ops live in the submodules ``dense``, ``layernorm``,
``layernorm_dense``, ``layernorm_mlp``, ``activation``, ``softmax``, ``attention``, ``quantize``
and ``sharding``.
"""

try:
    import flax as _flax  # noqa: F401  (the Flax modules need it)
    import jax as _jax  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "transformer_engine.jax needs JAX and Flax, which are not installed: "
        "pip install 'transformer_engine[jax]'  (or: pip install jax flax; for NVIDIA GPUs 'jax[cuda12]')"
    ) from _error

from . import activation, attention, dense, layernorm, layernorm_dense, layernorm_mlp, quantize, sharding, softmax  # noqa: F401
from . import flax
from ._autocast import NVTE_FP8_COLLECTION_NAME, autocast, fp8_autocast, update_collections
from .sharding import MeshResource

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "autocast",
    "fp8_autocast",
    "update_collections",
    "MeshResource",
    "flax",
    "quantize",
]
