"""Parameter layouts shared by the modules: a linear (optionally split and tensor-parallel) and a norm.

Linear: weight [out, in] initialized by ``init_method`` (default normal, std 0.023, as TE), bias [out]
zeros. ``parameters_split`` (names, equal split; or name -> size) replaces them with
``<name>_weight`` / ``<name>_bias`` stacked along dim 0. ``parallel_mode`` "column" divides the
output features by ``tp_size``, "row" the input features; weights get Megatron's
``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` attributes.

Norm: gamma = ones (zeros with ``zero_centered_gamma``), beta = zeros (LayerNorm only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..parallel.tensor_parallel import local_features, megatron_attributes
from .._functions.norm import NormConfig
from ..utils import DEFAULT_INIT_STD

__all__ = ["LinearLayout", "add_linear_params", "add_norm_params", "default_init_method"]


def default_init_method(weight: torch.Tensor) -> None:
    """TE's default init: weight ~ N(0, DEFAULT_INIT_STD^2)."""
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def _zeros(t: torch.Tensor) -> None:
    t.zero_()


def _ones(t: torch.Tensor) -> None:
    t.fill_(1.0)


@dataclass(frozen=True)
class LinearLayout:
    """Names and local sizes of a linear's parameters (weight splits stack along dim 0)."""

    weight_names: Tuple[str, ...]
    bias_names: Tuple[str, ...]
    in_features: int
    out_features: int

    def weight(self, module: torch.nn.Module) -> torch.Tensor:
        """The full weight [out, in] (a concatenation when split)."""
        return _stack(module, self.weight_names)

    def bias(self, module: torch.nn.Module) -> Optional[torch.Tensor]:
        """The full bias [out], or None."""
        return _stack(module, self.bias_names) if self.bias_names else None

    def weight_params(self, module: torch.nn.Module) -> Tuple[torch.nn.Parameter, ...]:
        """The weight parameters themselves (for ``main_grad``)."""
        return tuple(getattr(module, n) for n in self.weight_names)


def _stack(module, names):
    tensors = [getattr(module, n) for n in names]
    if len(tensors) == 1:
        return tensors[0]
    if torch.compiler.is_compiling():  # storage addresses are not traceable; the compiler plans the copy
        return torch.cat(tensors)
    return _ConcatView.apply(*tensors) if _back_to_back(tensors) else torch.cat(tensors)


class _ConcatView(torch.autograd.Function):
    """torch.cat(tensors) for tensors that already lie back to back in one storage: a view, no copy.

    The splits of a parameter are allocated that way (:func:`add_linear_params`), so the full weight
    costs neither a copy per forward nor the memory of one; the gradient is split back.
    """

    @staticmethod
    def forward(ctx, *tensors):
        first = tensors[0]
        ctx.set_materialize_grads(False)  # no gradient (delayed wgrads): none for the parts either, not zeros
        ctx.rows = [t.shape[0] for t in tensors]
        shape = (sum(ctx.rows),) + tuple(first.shape[1:])
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, first.stride())

    @staticmethod
    def backward(ctx, grad):
        return (None,) * len(ctx.rows) if grad is None else grad.split(ctx.rows)


def _back_to_back(tensors) -> bool:
    """True when ``tensors`` (plain, contiguous, same dtype and trailing shape) follow each other in one storage."""
    first = tensors[0]
    if first.device.type == "meta" or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        same = t.dtype == first.dtype and t.shape[1:] == first.shape[1:] and t.is_contiguous()
        if not same or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


def _split_sizes(prefix: str, out_features: int, parameters_split) -> Dict[str, int]:
    """Parameter-name prefix -> rows of each weight split."""
    if parameters_split is None:
        return {prefix: out_features}
    if isinstance(parameters_split, dict):
        sizes = OrderedDict((f"{name.rstrip('_')}_", int(size)) for name, size in parameters_split.items())
        if sum(sizes.values()) != out_features:
            raise ValueError(f"parameters_split sizes {dict(parameters_split)} must sum to out_features={out_features}")
        return sizes
    names = tuple(parameters_split)
    if not names or out_features % len(names):
        raise ValueError(f"parameters_split {names} must split out_features={out_features} into equal parts")
    return OrderedDict((f"{name.rstrip('_')}_", out_features // len(names)) for name in names)


def add_linear_params(module, prefix: str, in_features: int, out_features: int, *, parameters_split=None,
                      bias: bool = True, init_method: Optional[Callable] = None, dtype: torch.dtype,
                      device: torch.device, parallel_mode: Optional[str] = None, tp_size: int = 1,
                      partition_stride: int = 1, fp8_gemm: int = 0) -> LinearLayout:
    """Register a linear's parameters on ``module`` (global sizes in, local sizes registered).

    Names are ``<prefix>weight`` / ``<prefix>bias`` ("weight" for prefix "", "fc1_weight" for "fc1_"),
    or ``<split>_weight`` / ``<split>_bias`` with ``parameters_split``. ``partition_stride`` 2 marks a
    gated FC1 [a; b] whose column shard is [a_r; b_r] (see :mod:`..parallel.tensor_parallel`).
    ``fp8_gemm``: the module's GEMM these weights belong to (their FP8 slot under ``quantized_model_init``).
    """
    local_in, local_out = local_features(in_features, out_features, parallel_mode, tp_size, partition_stride)
    if parameters_split is not None and parallel_mode == "column":
        parameters_split = _divide_split(parameters_split, tp_size)
    sizes = _split_sizes(prefix, local_out, parameters_split)
    tp_attrs = megatron_attributes(parallel_mode, partition_stride)
    bias_attrs = tp_attrs if parallel_mode == "column" else {}
    init = init_method or default_init_method
    weights, biases = [], []
    # the splits are slices of one weight (and one bias) buffer: the full tensors are views (_stack)
    weight_rows = torch.empty((local_out, local_in), dtype=dtype, device=device).split(list(sizes.values()))
    bias_rows = torch.empty(local_out, dtype=dtype, device=device).split(list(sizes.values())) if bias else ()
    for i, (name, rows) in enumerate(sizes.items()):
        module._register(f"{name}weight", (rows, local_in), init, dtype, device, data=weight_rows[i], fp8_gemm=fp8_gemm,
                         **tp_attrs)
        weights.append(f"{name}weight")
        if bias:
            module._register(f"{name}bias", (rows,), _zeros, dtype, device, data=bias_rows[i], **bias_attrs)
            biases.append(f"{name}bias")
        else:
            module.register_parameter(f"{name}bias", None)
    return LinearLayout(tuple(weights), tuple(biases), local_in, local_out)


def _divide_split(parameters_split, tp_size: int):
    if not isinstance(parameters_split, dict):
        return parameters_split
    for name, size in parameters_split.items():
        if size % tp_size:
            raise ValueError(f"parameters_split[{name!r}]={size} is not divisible by tp_size={tp_size}")
    return {name: size // tp_size for name, size in parameters_split.items()}


def add_norm_params(module, prefix: str, shape: Tuple[int, ...], cfg: NormConfig, *, dtype: torch.dtype,
                    device: torch.device, sequence_parallel: bool = False) -> None:
    """Register gamma (``<prefix>weight``) and beta (``<prefix>bias``; None for RMSNorm) of ``shape``."""
    attrs = {"sequence_parallel": True} if sequence_parallel else {}
    gamma_init = _zeros if cfg.zero_centered_gamma else _ones
    module._register(f"{prefix}weight", shape, gamma_init, dtype, device, **attrs)
    if cfg.has_bias:
        module._register(f"{prefix}bias", shape, _zeros, dtype, device, **attrs)
    else:
        module.register_parameter(f"{prefix}bias", None)
