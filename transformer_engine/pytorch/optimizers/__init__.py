"""Fused optimizers and the multi-tensor ops they run on (TE's ``transformer_engine.pytorch.optimizers``).

- :class:`FusedAdam` (Adam / AdamW, optional fp32 master weights, capturable) and :class:`FusedSGD`;
- :data:`multi_tensor_applier` and the ``multi_tensor_*`` ops, called as
  ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``; the ops are the plugin catalog's
  dispatchers (transformer_engine/plugin/catalog/optimizer.py states their math).
"""

from transformer_engine.plugin import ops

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

multi_tensor_scale = ops.multi_tensor_scale
multi_tensor_l2norm = ops.multi_tensor_l2norm
multi_tensor_adam = ops.multi_tensor_adam
multi_tensor_sgd = ops.multi_tensor_sgd

__all__ = [
    "FusedAdam",
    "FusedSGD",
    "MultiTensorApply",
    "multi_tensor_adam",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_sgd",
]
