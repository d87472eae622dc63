"""``Linear``: y = x W^T + b as the fused operation [BasicLinear, Bias] (TE's ``ops.Linear``).

With ``tensor_parallel_mode="row"`` (P > 1) the operations are [BasicLinear on the local input
features, Bias of out_features, AllReduce (ReduceScatter with ``sequence_parallel``)]: as in TE, each
rank adds its own bias before the reduction, so the effective bias is sum_r b_r.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .basic_linear import BasicLinear, tensor_parallelism
from .bias import Bias
from .communication import AllReduce, ReduceScatter
from .op import FusedOperation

__all__ = ["Linear"]


class Linear(FusedOperation):
    """y = x W^T + b; ``weight`` and ``bias`` are those of its basic operations (``basic_ops``).

    Args: as :class:`~.basic_linear.BasicLinear` (without ``userbuffers_options``), plus ``bias``
    (add a learnable bias, zero-initialized). The state dict holds the parameters under
    ``basic_ops.<i>.*`` only (TE's keys).

    Example:
        >>> import torch, transformer_engine.pytorch.ops as te_ops
        >>> layer = te_ops.Linear(8, 4, device="cpu")
        >>> sorted(k for k in layer.state_dict() if not k.endswith("_extra_state"))
        ['basic_ops.0.weight', 'basic_ops.1.bias']
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable] = None, accumulate_into_main_grad: bool = False) -> None:
        config, local_in, _ = tensor_parallelism(tensor_parallel_mode, tensor_parallel_group, sequence_parallel,
                                                 in_features, out_features)
        row = config.parallel_mode == "row"
        linear = BasicLinear(
            local_in if row else in_features, out_features, device=device, dtype=dtype,
            tensor_parallel_mode=None if row else config.parallel_mode, tensor_parallel_group=config.tp_group,
            sequence_parallel=config.sequence_parallel and not row, rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=accumulate_into_main_grad,
        )
        ops = [linear]
        if bias:
            ops.append(Bias(out_features * (config.tp_size if row else 1), device=device, dtype=dtype,
                            tensor_parallel=config.parallel_mode is not None, tensor_parallel_group=config.tp_group))
        if row:
            ops.append(ReduceScatter(config.tp_group) if config.sequence_parallel else AllReduce(config.tp_group))
        super().__init__(ops)
        self._bias_idx = 1 if bias else None
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", ops[1].bias if bias else None)

    def reset_parameters(self) -> None:
        """Initialize the basic operations' parameters (materializing "meta" ones) and take them over."""
        for op in self.basic_ops:
            if hasattr(op, "reset_parameters"):
                op.reset_parameters()
        self.weight = self.basic_ops[0].weight
        if self._bias_idx is not None:
            self.bias = self.basic_ops[self._bias_idx].bias

    def _forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):  # noqa: A002 - TE's name
        if self.weight.is_meta:  # initialization deferred by device="meta" (TE: at the first forward)
            self.reset_parameters()
        return super()._forward(input, *extra_inputs)

    def register_parameter(self, name: str, param: Optional[torch.nn.Parameter]) -> None:
        """Register ``param``; "weight" / "bias" also become the basic operations' (so ``op.weight = w`` works).

        Raises:
            ValueError: a bias is set on a Linear built with ``bias=False``.
        """
        if name == "bias" and param is not None and self._bias_idx is None:
            raise ValueError("this ops.Linear was built with bias=False; it cannot take a bias parameter")
        super().register_parameter(name, param)
        if name == "weight":
            self.basic_ops[0].weight = param
        elif name == "bias" and self._bias_idx is not None:
            self.basic_ops[self._bias_idx].bias = param

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Nothing of its own: ``weight`` and ``bias`` are saved by the basic operations that own them."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        """Nothing of its own: the basic operations load ``weight`` and ``bias`` (the same parameters)."""
