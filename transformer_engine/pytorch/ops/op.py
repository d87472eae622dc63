"""The operation base classes: ``FusibleOperation``, ``BasicOperation`` and ``FusedOperation`` (TE's names).

An operation is a ``torch.nn.Module`` with one main input and output,
``op(input, *extra_inputs) -> output`` or ``(output, *extra_outputs)``, where the class attributes
``num_extra_inputs`` / ``num_extra_outputs`` say how many extra tensors it takes and gives.
A basic operation owns its parameters and state; a fused operation runs a list of basic operations
and owns nothing of its own. Subclasses implement ``_forward(input, *extra_inputs)`` with autograd:
each op is its own autograd node (or torch composition), and there is no fusion yet.
"""

from __future__ import annotations

from typing import Iterable, Tuple, Union

import torch

from transformer_engine.plugin import ops as catalog

from .._functions import extra_state
from ..tensor.quantized_tensor import QuantizedTensor

__all__ = ["BasicOperation", "FusedOperation", "FusibleOperation", "high_precision", "run_operations"]

Outputs = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def high_precision(x: torch.Tensor) -> torch.Tensor:
    """``x``, dequantized when it is a quantized tensor (TE's operations take those and compute on their values)."""
    return x.dequantize() if isinstance(x, QuantizedTensor) else x


class FusibleOperation(torch.nn.Module):
    """Base of every operation that :class:`~.sequential.Sequential` can chain.

    Attributes:
        num_extra_inputs: extra tensors ``forward`` takes after the main input.
        num_extra_outputs: extra tensors ``forward`` returns after the main output.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def __init__(self) -> None:
        super().__init__()
        catalog.prepare_for_compile()  # every catalog op traceable before torch.compile can meet one

    @property
    def is_fused_op(self) -> bool:
        """True for a :class:`FusedOperation`."""
        return False

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor) -> Outputs:  # noqa: A002 - TE's name
        """y = op(input, *extra_inputs); returns y, or (y, *extra_outputs) when the op makes extra outputs.

        Raises:
            ValueError: the number of extra inputs is not ``num_extra_inputs``.
        """
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(f"{type(self).__name__} takes {self.num_extra_inputs} extra inputs, got {len(extra_inputs)}")
        return self._forward(input, *extra_inputs)

    def _forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor) -> Outputs:  # noqa: A002
        raise NotImplementedError(f"{type(self).__name__} does not implement _forward")


class BasicOperation(FusibleOperation):
    """An operation that owns its parameters and state (TE: the unit the fuser combines).

    ``state_dict`` carries an ``_extra_state`` entry, as TE's ops do: empty for stateless ops;
    :class:`~.basic_linear.BasicLinear` stores its delayed-scaling state there.
    """

    def get_extra_state(self) -> torch.Tensor:
        """An empty uint8 tensor: a stateless op has nothing to checkpoint."""
        return extra_state.empty()

    def set_extra_state(self, state) -> None:
        """Accept the empty state of :meth:`get_extra_state` (or None).

        Raises:
            ValueError: a non-empty state (saved by an op that had quantization state).
        """
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise ValueError(f"{type(self).__name__} keeps no extra state, got a non-empty '_extra_state'")


class FusedOperation(FusibleOperation):
    """An operation made of basic operations, run one after the other (``basic_ops``, TE's name).

    Raises:
        ValueError: no basic operations were given.
    """

    def __init__(self, basic_ops: Iterable[FusibleOperation]) -> None:
        super().__init__()
        self.basic_ops = torch.nn.ModuleList(basic_ops)
        if len(self.basic_ops) == 0:
            raise ValueError("a fused operation needs at least one basic operation")
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.basic_ops)
        self.num_extra_outputs = sum(op.num_extra_outputs for op in self.basic_ops)

    @property
    def is_fused_op(self) -> bool:
        return True

    def _forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor) -> Outputs:  # noqa: A002
        return run_operations(self.basic_ops, input, extra_inputs)


def run_operations(modules: Iterable[torch.nn.Module], x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...]) -> Outputs:
    """Apply ``modules`` in order: each operation takes the next ``num_extra_inputs`` of ``extra_inputs``
    and its extra outputs are collected; any other module maps x -> module(x).

    Returns:
        x, or (x, *extra_outputs) in the order the operations made them.

    Raises:
        ValueError: ``extra_inputs`` does not match what the operations take.
    """
    extra_outputs = []
    for module in modules:
        if not isinstance(module, FusibleOperation):
            x = module(x)
            continue
        k = module.num_extra_inputs
        if k > len(extra_inputs):
            raise ValueError(f"{type(module).__name__} takes {k} extra inputs but only {len(extra_inputs)} are left")
        y = module(x, *extra_inputs[:k])
        extra_inputs = extra_inputs[k:]
        if module.num_extra_outputs:
            x, *made = y
            extra_outputs.extend(made)
        else:
            x = y
    if extra_inputs:
        raise ValueError(f"{len(extra_inputs)} extra inputs were given that no operation takes")
    return (x, *extra_outputs) if extra_outputs else x
