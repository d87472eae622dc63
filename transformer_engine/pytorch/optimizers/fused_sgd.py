"""FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one multi-tensor op per group.

Gradient g, parameter p, momentum buffer buf, momentum mu, loss scale s (``most_recent_scale``, 1 unless
the caller sets it):
    g = g / s + wd p                 (wd p is added to d after the momentum with wd_after_momentum)
    buf = g on a parameter's first step, else mu buf + (1 - dampening) g
    d = g + mu buf (nesterov), buf (momentum), g (mu = 0)
    p = p - lr d
This is ``torch.optim.SGD``'s update (lr scales the whole step, not the velocity).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Iterable, List, Optional

import torch
from torch.optim.optimizer import required

from transformer_engine.plugin import ops

from ._common import ParamListCache, deprecated_set_grad_none, resolve_set_to_none
from .multi_tensor_apply import multi_tensor_applier

__all__ = ["FusedSGD"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _SGDLists:
    """A group's parameters with a gradient and their momentum buffers; the first ``fresh`` buffers are new."""

    params: List[torch.Tensor]
    momentums: List[torch.Tensor]
    fresh: int  # buffers not yet initialised by a step (first_run for the op); 0 after the next step


class FusedSGD(torch.optim.Optimizer):
    """SGD with optional momentum, a drop-in replacement for ``torch.optim.SGD``.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (required).
        momentum, dampening, weight_decay, nesterov: as torch.optim.SGD.
        wd_after_momentum: add the weight decay to the update after the momentum instead of to the gradient.
        materialize_master_grads: accepted for TE compatibility (it only concerns apex amp's master copies).
        set_grad_none: deprecated, pass ``set_to_none`` to :meth:`zero_grad`.

    Raises:
        ValueError: a negative lr, momentum or weight_decay, or nesterov without momentum or with dampening.

    Example:
        >>> import torch
        >>> from transformer_engine.pytorch.optimizers import FusedSGD
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = FusedSGD([w], lr=0.5, momentum=0.9)
        >>> w.grad = torch.ones(3)
        >>> opt.step()
        >>> w.detach()
        tensor([0.5000, 0.5000, 0.5000])
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: Optional[bool] = None,
    ):
        if lr is not required and lr < 0.0:
            raise ValueError(f"FusedSGD: lr={lr} must be >= 0")
        if momentum < 0.0:
            raise ValueError(f"FusedSGD: momentum={momentum} must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"FusedSGD: weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError(
                f"FusedSGD: nesterov=True needs momentum > 0 and dampening == 0, got momentum={momentum}, dampening={dampening}"
            )
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov}
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = deprecated_set_grad_none("FusedSGD", set_grad_none)
        device = next((p.device for p in chain.from_iterable(g["params"] for g in self.param_groups)), torch.device("cpu"))
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._lists = ParamListCache(self._build_lists)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict; the cached lists are dropped (the momentum buffers are new tensors)."""
        super().load_state_dict(state_dict)
        self._lists.clear()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop the gradients (set_to_none, the default) or zero them."""
        super().zero_grad(set_to_none=resolve_set_to_none("FusedSGD", self.set_grad_none, set_to_none))

    def _build_lists(self, params: List[torch.Tensor]) -> _SGDLists:
        """The group's lists, parameters without a momentum buffer first (their buffers are created here)."""
        for param in params:
            if param.dtype not in _PARAM_DTYPES:
                raise TypeError(f"FusedSGD: parameters must be float32, float16 or bfloat16, got {param.dtype}")
        fresh = [p for p in params if "momentum_buffer" not in self.state[p]]
        for param in fresh:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        fresh_ids = {id(p) for p in fresh}
        ordered = fresh + [p for p in params if id(p) not in fresh_ids]
        momentums = [self.state[p]["momentum_buffer"] for p in ordered]
        return _SGDLists(params=ordered, momentums=momentums, fresh=len(fresh))

    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step over every group; gradients are divided by ``most_recent_scale``, then it is reset to 1."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lists = self._lists.get(index, params)
            grads = [p.grad for p in lists.params]
            if lists.fresh:
                split = lists.fresh
                self._fused_sgd(group, [grads[:split], lists.params[:split], lists.momentums[:split]], first_run=True)
                self._fused_sgd(group, [grads[split:], lists.params[split:], lists.momentums[split:]], first_run=False)
                lists.fresh = 0
            else:
                self._fused_sgd(group, [grads, lists.params, lists.momentums], first_run=False)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _fused_sgd(self, group: dict, tensor_lists: List[List[torch.Tensor]], first_run: bool) -> None:
        """The catalog's multi_tensor_sgd over [grads, params, momentum buffers] (empty lists do nothing)."""
        multi_tensor_applier(
            ops.multi_tensor_sgd,
            self._dummy_overflow_buf,
            tensor_lists,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            lr=group["lr"],
            nesterov=group["nesterov"],
            first_run=first_run,
            wd_after_momentum=self.wd_after_momentum,
            scale=1.0 / self.most_recent_scale,
        )
