"""``transformer_engine.pytorch.ops``: TE's fusible-operations API, a first unfused version.

Operations are small ``torch.nn.Module`` s with one main input and output, chained by
:class:`Sequential`:

    >>> import torch, transformer_engine.pytorch.ops as te_ops
    >>> mlp = te_ops.Sequential(
    ...     te_ops.LayerNorm(16, device="cpu"),
    ...     te_ops.Linear(16, 64, device="cpu"),
    ...     te_ops.SwiGLU(),
    ...     te_ops.Linear(32, 16, device="cpu"),
    ... )
    >>> mlp(torch.randn(4, 16)).shape
    torch.Size([4, 16])

Names, constructor signatures, defaults, parameter names and numerics follow NVIDIA TE. Under
``te.autocast`` the GEMMs of :class:`BasicLinear` run in FP8 with the same machinery as ``te.Linear``.

Not in this version: fusion. TE's operation fuser combines neighbouring operations into fused kernels
(linear + bias + activation, backward dbias + dactivation, Userbuffers overlap); here every operation
runs on its own, each its own autograd node, so the results are those of the unfused chain. Also
missing: TE's extension interface for custom operations (``op_forward`` / ``op_backward`` with an
``OperationContext``, quantizers handed between neighbours), extra-tensor channels, ``op_kwargs``, and
the operations ``GroupedLinear`` and the scaled GLU variants of TE after 2.9.
"""

from .activation import GELU, GEGLU, GLU, QGEGLU, QGELU, ClampedSwiGLU, ReGLU, ReLU, SiLU, SReGLU, SReLU, SwiGLU
from .basic_linear import BasicLinear
from .bias import Bias
from .communication import AllGather, AllReduce, ReduceScatter
from .elementwise import ConstantScale, Dropout
from .extra_tensors import AddExtraInput, MakeExtraOutput
from .linear import Linear
from .normalization import L2Normalization, LayerNorm, RMSNorm
from .op import BasicOperation, FusedOperation, FusibleOperation
from .quantize import Quantize
from .reshape import Identity, Reshape
from .sequential import Sequential

__all__ = [
    "AddExtraInput", "AllGather", "AllReduce", "BasicLinear", "BasicOperation", "Bias", "ClampedSwiGLU", "ConstantScale", "Dropout",
    "FusedOperation", "FusibleOperation", "GEGLU", "GELU", "GLU", "Identity", "L2Normalization", "LayerNorm", "Linear",
    "MakeExtraOutput", "QGEGLU", "QGELU", "Quantize", "RMSNorm", "ReGLU", "ReLU", "ReduceScatter", "Reshape", "SReGLU", "SReLU", "SiLU",
    "Sequential", "SwiGLU",
]
