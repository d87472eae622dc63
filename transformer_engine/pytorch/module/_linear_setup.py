"""What ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP`` share outside their forward's prelude (which is
``TransformerEngineBaseModule._linear_prelude``): the tensor-parallel settings from TE's constructor arguments, the norm's
settings, and the outputs of the two norm modules. Construction-time helpers, except :func:`norm_then` and
:func:`norm_linear_outputs`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..parallel.comm import gather_from_sequence_parallel_region
from ..parallel.linear_comm import LinearComm
from ..parallel.tensor_parallel import ParallelConfig
from .._checks import check_eps
from .._functions.common import apply_without_torch_autocast
from .._functions.norm import NormConfig
from .._functions.norm_function import NormArgs, NormFunction
from .base import te_outputs

__all__ = ["checked_norm", "keep_norm", "linear_parallel_config", "norm_linear_outputs", "norm_then"]


def linear_parallel_config(tp_group, tp_size: int, *, sequence_parallel: bool, parallel_mode: Optional[str],
                           symmetric_ar_type: Optional[str], ub_name: Optional[str] = None, **ub_flags: bool) -> ParallelConfig:
    """A linear module's :class:`ParallelConfig` from TE's constructor arguments.

    Args:
        tp_group, tp_size, sequence_parallel, parallel_mode, symmetric_ar_type, ub_name: as the module received them.
        **ub_flags: its ``ub_overlap_*`` / ``ub_bulk_*`` switches; those that are on become ``comm_overlap``.

    Raises:
        ValueError: an unknown ``parallel_mode`` or a ``tp_size`` the group contradicts (``ParallelConfig``'s checks).

    Example:
        >>> linear_parallel_config(None, 1, sequence_parallel=False, parallel_mode="row", symmetric_ar_type=None,
        ...                        ub_overlap_ag=True, ub_overlap_rs=False).comm_overlap
        ('ub_overlap_ag',)
    """
    return ParallelConfig(tp_group, tp_size, sequence_parallel=sequence_parallel, parallel_mode=parallel_mode,
                          symmetric_ar_type=symmetric_ar_type, comm_overlap=ParallelConfig.switched_on(**ub_flags), ub_name=ub_name)


def checked_norm(owner: str, normalization: str, eps: float, zero_centered_gamma: bool) -> NormConfig:
    """``owner``'s norm settings, checked before any work (call it before ``super().__init__``, then :func:`keep_norm`).

    Raises:
        ValueError: ``eps`` is not a positive number, or ``normalization`` is neither "LayerNorm" nor "RMSNorm".
    """
    check_eps(owner, eps)
    return NormConfig(normalization, eps, zero_centered_gamma=zero_centered_gamma)


def keep_norm(module: torch.nn.Module, norm: NormConfig) -> None:
    """``module.norm`` := ``norm``, with TE's attributes ``normalization``, ``eps`` and ``zero_centered_gamma``."""
    module.normalization, module.eps, module.zero_centered_gamma = norm.kind, norm.eps, norm.zero_centered_gamma
    module.norm = norm


def norm_then(module: torch.nn.Module, inp: torch.Tensor, dtype: torch.dtype, hidden: int,
              gemms: Callable[[torch.Tensor], torch.Tensor]):
    """The high-precision path of LayerNormLinear / LayerNormMLP: ``module``'s norm (``layer_norm_weight`` /
    ``layer_norm_bias`` over the last ``hidden`` features, in ``dtype``) as an autograd node of its own (``te.LayerNorm``'s
    Function), then ``gemms(ln_out)``; returns out, or (out, ln_out) with ``return_layernorm_output``."""
    ln_out = apply_without_torch_autocast(NormFunction, inp.device, inp, module.layer_norm_weight, module.layer_norm_bias,
                                          NormArgs(norm=module.norm, dtype=dtype, hidden=hidden))
    out = gemms(ln_out)
    return (out, ln_out) if module.return_layernorm_output else out


def norm_linear_outputs(module: torch.nn.Module, result, bias: Optional[torch.Tensor], comm: LinearComm):
    """The outputs of LayerNormLinear / LayerNormMLP in TE's order (:func:`~.base.te_outputs`): out[, bias][, ln_out].

    ``result``: the Function's out, or (out, ln_out) with ``return_layernorm_output``. With
    ``return_layernorm_output_gathered`` under sequence parallelism, ln_out holds the rows of every rank (all-gathered
    over ``comm``'s group, ``comm`` being the GEMM that reads the norm's output).
    """
    if module.return_layernorm_output and module.return_layernorm_output_gathered and comm.sequence_parallel:
        result = (result[0], gather_from_sequence_parallel_region(result[1], comm.group))  # comm
    return te_outputs(result, bias, return_bias=module.return_bias, return_layernorm_output=module.return_layernorm_output)
