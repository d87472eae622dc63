"""``BasicLinear``: y = x W^T (no bias), with FP8 GEMMs under ``te.autocast`` and optional tensor parallelism.

Forward and backward are those of ``te.Linear`` (``_functions.linear_function.LinearFunction``):

    fprop  y  = x @ W^T        dgrad  dx = dy @ W        wgrad  dW = dy^T @ x

Tensor parallelism over P ranks (``tensor_parallel_mode``): "column" splits W along dim 0
(out_features / P rows per rank; dx is all-reduced, or reduce-scattered with ``sequence_parallel``,
which also all-gathers x), "row" splits W along dim 1 (the output is all-reduced, or reduce-scattered
with ``sequence_parallel``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..parallel import comm
from .._functions.common import apply_without_torch_autocast
from .._functions.gemm import WgradTarget
from .._functions.linear_function import LinearArgs, LinearFunction
from ..module.base import ParallelConfig, TransformerEngineBaseModule, check_unsupported, default_device
from ..parallel.linear_comm import share_scales
from .op import BasicOperation

__all__ = ["BasicLinear", "default_group", "tensor_parallelism"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_group(group):
    """``group``, or the world group when it is None and torch.distributed is initialized (TE's default)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def tensor_parallelism(mode: Optional[str], group, sequence_parallel: bool, in_features: int,
                       out_features: int) -> Tuple[ParallelConfig, int, int]:
    """(parallel config, local in_features, local out_features) of a linear split by ``mode`` over ``group``.

    ``group=None`` means the world group; a group of one rank disables tensor parallelism (TE's rule).

    Raises:
        ValueError: ``mode`` is not None / "column" / "row", or the split dim is not divisible by P.
    """
    if mode not in (None, "column", "row"):
        raise ValueError(f'tensor_parallel_mode={mode!r} is not supported; use None, "column" or "row"')
    group = default_group(group) if mode is not None else None
    size = comm.group_size(group) if mode is not None else 1
    if size == 1:
        return ParallelConfig(), in_features, out_features
    split = out_features if mode == "column" else in_features
    if split % size:
        name = "out_features" if mode == "column" else "in_features"
        raise ValueError(f"tensor_parallel_mode={mode!r} splits {name}={split} over {size} ranks; it must be divisible")
    config = ParallelConfig(tp_group=group, tp_size=size, sequence_parallel=sequence_parallel, parallel_mode=mode)
    return config, in_features // (size if mode == "row" else 1), out_features // (size if mode == "column" else 1)


def _kaiming_uniform(weight: torch.Tensor) -> None:
    """TE's (and torch.nn.Linear's) init: U(-b, b), b = 1 / sqrt(in_features)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


#: the scaling-state key of each mode of ``get_quantizer`` (TE's ``FP8GlobalStateManager.get_meta_tensor_key``)
_STATE_KEYS = {"forward": "scaling_fwd", "backward": "scaling_bwd"}


class BasicLinear(TransformerEngineBaseModule, BasicOperation):
    """y = x W^T, W of shape [out_features, in_features] (this rank's shard under tensor parallelism).

    Args (TE's; all but the sizes keyword-only):
        in_features, out_features: sizes of the (global) input and output features.
        device: parameter device; None = current CUDA device if any, else CPU; "meta" defers
            initialization to the first forward (or :meth:`reset_parameters`).
        dtype: parameter dtype, float32 / float16 / bfloat16 (default ``torch.get_default_dtype()``).
        tensor_parallel_mode: None, "column" or "row" (see the module docstring).
        tensor_parallel_group: process group (default: the world group).
        sequence_parallel: shard the replicated activation along dim 0 as well.
        rng_state_tracker_function: callable returning a tracker whose ``fork()`` wraps initialization.
        accumulate_into_main_grad: add dW into ``weight.main_grad`` (Megatron); ``weight.grad`` is then
            TE's placeholder (when the weight has ``grad_added_to_main_grad``) or None.
        userbuffers_options: must be None (Userbuffers overlap is not implemented).

    Built under ``quantized_model_init``, the weight is an FP8 parameter of that recipe (as in ``te.Linear``).

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> te_ops.BasicLinear(8, 4, device="cpu")(torch.randn(2, 8)).shape
        torch.Size([2, 4])
    """

    def __init__(self, in_features: int, out_features: int, *, device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel_mode: Optional[str] = None,
                 tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable] = None, accumulate_into_main_grad: bool = False,
                 userbuffers_options: Optional[dict] = None) -> None:
        super().__init__(1, get_rng_state_tracker=rng_state_tracker_function)
        check_unsupported(userbuffers_options=userbuffers_options)
        dtype = dtype or torch.get_default_dtype()
        if dtype not in _PARAM_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; use float32, float16 or bfloat16")
        self.in_features, self.out_features = in_features, out_features
        self.parallel, self.local_in_features, self.local_out_features = tensor_parallelism(
            tensor_parallel_mode, tensor_parallel_group, sequence_parallel, in_features, out_features)
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self._linear_comm = self._comm(self.parallel.parallel_mode)
        device = default_device(device)
        self._register("weight", (self.local_out_features, self.local_in_features), _kaiming_uniform, dtype, device, fp8_gemm=0)
        self.reset_parameters(defer_init=device.type == "meta")

    @property
    def tensor_parallel_mode(self) -> Optional[str]:
        return self.parallel.parallel_mode

    @property
    def tensor_parallel_group(self):
        return self.parallel.tp_group

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.tp_size

    def get_quantizer(self, mode: str, index: int):
        """TE's accessor: the quantizer of slot ``index`` in ``mode`` ("forward": input 0, weight 1, output 2;
        "backward": grad output 0, grad input 1), or None before the first quantized forward.

        Raises:
            ValueError: ``mode`` is neither "forward" nor "backward".
        """
        if mode not in _STATE_KEYS:
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        quantizers = self.quantizers.get(_STATE_KEYS[mode])
        return quantizers[index] if quantizers else None

    @property
    def _fp8_metas(self):
        """TE's layout of the scaling state (its tests read it): {"forward": {"scaling_fwd": state}, "backward":
        {"scaling_bwd": state}}, a mode None before the first quantized forward."""
        return {mode: None if self.fp8_meta.get(key) is None else {key: self.fp8_meta[key]} for mode, key in _STATE_KEYS.items()}

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T over the last dim, in the autocast dtype or else the weight's (x is cast to it)."""
        if self.weight.device.type == "meta":
            self.reset_parameters()
        weight = self.weight
        if x.dim() < 1 or x.shape[-1] != self.local_in_features:
            raise ValueError(f"BasicLinear expects the last input dim to be {self.local_in_features}, got shape {tuple(x.shape)}")
        on = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if on else weight.dtype
        q = self._prepare_quantization(x.device, [("input", x.shape), ("weight", weight.shape)])
        args = LinearArgs(
            dtype=dtype,
            quantization=share_scales(q, self._linear_comm),
            weight_operand=self._weight_operand("weight", weight, q.gemms[0].weight, None),
            wgrad=self._wgrad_target(weight),
            comm=self._linear_comm,
        )
        return apply_without_torch_autocast(LinearFunction, x.device, x, weight, None, args)

    def _wgrad_target(self, weight: torch.nn.Parameter) -> WgradTarget:
        """dW into ``weight.main_grad`` with ``accumulate_into_main_grad`` (checked here, before any work).

        Raises:
            RuntimeError: the weight has no ``main_grad``.
            NotImplementedError: the weight asks to overwrite ``main_grad`` (``overwrite_main_grad``).
        """
        if not (self._accumulate_into_main_grad and weight.requires_grad and torch.is_grad_enabled()):
            return WgradTarget(weight.dtype)
        if getattr(weight, "main_grad", None) is None:
            raise RuntimeError("BasicLinear has accumulate_into_main_grad=True but its weight has no main_grad; set weight.main_grad")
        if getattr(weight, "overwrite_main_grad", False):
            raise NotImplementedError("weight.overwrite_main_grad=True is not implemented: dW is always added into main_grad")
        return WgradTarget(weight.dtype, (weight,))
