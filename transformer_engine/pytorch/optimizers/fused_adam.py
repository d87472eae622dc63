"""FusedAdam: Adam / AdamW over every parameter of a group in one multi-tensor op per step.

Step t of a group (counted per group, from 1), gradient g, weight p (the parameter, or its fp32 master):
    L2 mode (adam_w_mode=False):        g = g + wd p
    AdamW mode (adam_w_mode=True):      p = p - lr wd p          (decoupled weight decay)
    m = b1 m + (1 - b1) g               v = b2 v + (1 - b2) g^2
    p = p - lr m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
                                        (m_hat = m, v_hat = v with bias_correction=False)
With ``master_weights`` the step runs on an fp32 copy of each parameter and the parameter (bf16, fp16)
is that copy rounded; states kept in fp16 or FP8 (``master_weight_dtype``, ``exp_avg_dtype``,
``exp_avg_sq_dtype``; :mod:`._scaled_state`) are taken to float32 for the step and stored back with a new scale; an FP8 parameter (a
``QuantizedTensor``, e.g. from ``quantized_model_init``) is
that copy re-quantized in place (``param.copy_(master)``), which needs ``master_weights``. ``capturable`` keeps lr and t on the device and
reads a torch GradScaler's scale
and found-inf flag there (no host synchronisation): g = g / scale, and when found_inf is set nothing
changes and t does not advance.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Iterable, List, Optional, Tuple

import torch

from transformer_engine.plugin import ops

from ..tensor.quantized_tensor import QuantizedTensor
from ._common import ParamListCache, deprecated_set_grad_none, resolve_set_to_none
from ._scaled_state import SCALED_DTYPES, new_scaled, store, unscaled
from .multi_tensor_apply import multi_tensor_applier

__all__ = ["FusedAdam"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
_MASTER_DTYPES = (torch.float32, torch.float16)
_LIST_OF_STATE = {"exp_avg": "exp_avgs", "exp_avg_sq": "exp_avg_sqs"}


@dataclass(frozen=True)
class _AdamLists:
    """A group's tensors, one per parameter with a gradient, in the same order."""

    params: List[torch.Tensor]  # the model's parameters
    weights: List[torch.Tensor]  # what the step updates: the fp32 masters, or the parameters themselves
    exp_avgs: List[torch.Tensor]  # m
    exp_avg_sqs: List[torch.Tensor]  # v
    copy_params: List[torch.Tensor]  # with master weights: the plain parameters, rounded from their masters in one foreach copy
    copy_masters: List[torch.Tensor]
    quantized: List[Tuple[torch.Tensor, torch.Tensor]]  # (FP8 parameter, master): re-quantized one by one


@dataclass(frozen=True)
class _AdamScalars:
    """A group's hyper-parameters for one step (lr and step may be device tensors)."""

    lr: object
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: int
    bias_correction: bool


def _check_state_dtypes(master_weights: bool, master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype, capturable: bool) -> None:
    """Raise ValueError for state dtypes NVIDIA TE does not offer either, NotImplementedError for scaled states
    with ``capturable`` (their scales are recomputed on the host's schedule each step)."""
    if master_weights and master_weight_dtype not in _MASTER_DTYPES:
        raise ValueError(f"FusedAdam: master_weight_dtype={master_weight_dtype} must be torch.float32 or torch.float16")
    for option, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in _MOMENT_DTYPES:
            raise ValueError(f"FusedAdam: {option}={dtype} must be torch.float32, torch.bfloat16, torch.float16 or torch.uint8 (FP8)")
    scaled = {exp_avg_dtype, exp_avg_sq_dtype, master_weight_dtype if master_weights else torch.float32} & set(SCALED_DTYPES)
    if capturable and scaled:
        raise NotImplementedError(f"FusedAdam: capturable=True with states stored in {sorted(map(str, scaled))} is not "
                                  "implemented; use float32 or bfloat16 states")


def _capturable_adam(lists: _AdamLists, grads: List[torch.Tensor], scalars: _AdamScalars, step, inv_scale, keep) -> None:
    """One Adam step in float32 with lr, step, inv_scale and keep (bool, 0-dim) as device tensors.

    g = g * inv_scale is written back to the gradient (as TE's capturable kernel does); where keep is
    False every tensor keeps its value.
    """
    bc1 = 1.0 - scalars.beta1**step if scalars.bias_correction else 1.0
    bc2 = 1.0 - scalars.beta2**step if scalars.bias_correction else 1.0
    for grad, weight, exp_avg, exp_avg_sq in zip(grads, lists.weights, lists.exp_avgs, lists.exp_avg_sqs):
        g = grad.float() * inv_scale
        p = weight.float()
        g_eff = g if scalars.adam_w_mode else g + scalars.weight_decay * p
        m = scalars.beta1 * exp_avg.float() + (1.0 - scalars.beta1) * g_eff
        v = scalars.beta2 * exp_avg_sq.float() + (1.0 - scalars.beta2) * g_eff * g_eff
        update = (m / bc1) / (torch.sqrt(v / bc2) + scalars.eps)
        if scalars.adam_w_mode:
            update = update + scalars.weight_decay * p
        for dst, value in ((grad, g), (weight, p - scalars.lr * update), (exp_avg, m), (exp_avg_sq, v)):
            dst.copy_(torch.where(keep, value, dst))


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``, like ``torch.optim.Adam``) or AdamW (default, like ``torch.optim.AdamW``).

    Args:
        params: parameters or param-group dicts.
        lr, betas, eps, weight_decay: the usual hyper-parameters.
        amsgrad: not supported (raises).
        bias_correction: divide m and v by 1 - b^t.
        adam_w_mode: decoupled weight decay (AdamW) instead of an L2 term in the gradient.
        capturable: lr and step as device tensors, GradScaler-aware step without host synchronisation.
        master_weights: keep an fp32 master copy per parameter (state ``master_param``).
        master_weight_dtype: torch.float32, or torch.float16 (stored with a per-tensor scale).
        exp_avg_dtype, exp_avg_sq_dtype: torch.float32, torch.bfloat16, or torch.float16 / torch.uint8 (FP8 E4M3),
            stored with a per-tensor scale.
        use_decoupled_grad: read gradients from ``param.decoupled_grad`` instead of ``param.grad``.
        store_param_remainders: accepted; the full fp32 master is kept (see the warning).
        set_grad_none: deprecated, pass ``set_to_none`` to :meth:`zero_grad`.

    Raises:
        NotImplementedError: amsgrad=True, or scaled states with capturable. ValueError: another state dtype.

    Example:
        >>> import torch
        >>> from transformer_engine.pytorch.optimizers import FusedAdam
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> opt = FusedAdam([w], lr=0.1)
        >>> w.grad = torch.ones(4)
        >>> opt.step()
        >>> w.detach()
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: Optional[bool] = None,
    ):
        if amsgrad:
            raise NotImplementedError("FusedAdam: amsgrad=True (the AMSGrad variant) is not supported; use amsgrad=False")
        _check_state_dtypes(master_weights, master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype, capturable)
        if store_param_remainders and master_weights:
            warnings.warn(
                "FusedAdam: store_param_remainders=True keeps the full fp32 master weights (the 16-bit remainder "
                "storage is not implemented): same numerics, 2 more bytes per parameter",
                UserWarning,
                stacklevel=2,
            )
        self.capturable = capturable  # read by add_param_group, which torch's constructor calls
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype, "master_param": master_weight_dtype}
        self._scales = {}  # param -> {state name: float32 [1]} for the states stored with a scale
        self._scaled_names = tuple(name for name, dtype in self.name_to_dtype_map.items()
                                   if dtype in SCALED_DTYPES and (master_weights or name != "master_param"))
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = False  # remainders are never stored, whatever was asked
        self.set_grad_none = deprecated_set_grad_none("FusedAdam", set_grad_none)
        device = next((p.device for p in chain.from_iterable(g["params"] for g in self.param_groups)), torch.device("cpu"))
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=device)
        self._step_supports_amp_scaling = capturable
        self._lists = ParamListCache(self._build_lists)

    # ----------------------------------------------------------------------------------------- groups

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group; with capturable, lr (and step) become tensors on the group's device."""
        super().add_param_group(param_group)
        if self.capturable:
            self._place_capturable_scalars(self.param_groups[-1])

    def _place_capturable_scalars(self, group: dict) -> None:
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)
        if "step" in group:
            group["step"] = torch.as_tensor(group["step"], dtype=torch.int32).reshape(1).to(device)

    def _grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
        if grad is not None and grad.is_sparse:
            raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
        return grad

    def _build_lists(self, params: List[torch.Tensor]) -> _AdamLists:
        for param in params:
            if param.dtype not in _PARAM_DTYPES:
                raise TypeError(f"FusedAdam: parameters must be float32, float16 or bfloat16, got {param.dtype}")
            if isinstance(param, QuantizedTensor) and not self.master_weights:
                raise NotImplementedError(
                    f"FusedAdam: a {type(param).__name__} parameter (e.g. from quantized_model_init) needs master_weights=True: "
                    "the step runs on its fp32 master, which is then quantized into the parameter"
                )
            if not self.state[param]:
                self._init_state(param)
        states = [self.state[p] for p in params]
        masters = [s["master_param"] for s in states] if self.master_weights else None
        return _AdamLists(params=list(params), exp_avgs=[s["exp_avg"] for s in states], exp_avg_sqs=[s["exp_avg_sq"] for s in states],
                          **_master_fields(params, masters))

    # ------------------------------------------------------------------------------------------ state

    def _new_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """Zeros in the state's dtype (a scaled one gets its scale, 1)."""
        dtype = self.name_to_dtype_map[state_name]
        if dtype in SCALED_DTYPES:
            self._scales.setdefault(param, {})[state_name] = torch.ones(1, dtype=torch.float32, device=param.device)
            return new_scaled(param, dtype)
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        state["exp_avg"] = self._new_state(param, "exp_avg")
        state["exp_avg_sq"] = self._new_state(param, "exp_avg_sq")
        if self.master_weights:
            state["master_param"] = self._new_state(param, "master_param")
            self.set_scaled_state(param, "master_param", param.detach().float())

    def initialize_state(self, param: torch.nn.Parameter, store_param_remainders: bool = False) -> None:
        """Create the zero moments (and the master copy of ``param`` with master_weights).

        ``store_param_remainders`` is accepted for TE compatibility; the master is always a full copy.
        """
        self._init_state(param)
        self._lists.clear()

    def get_unscaled_state(self, param: torch.nn.Parameter, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """State ``state_name`` (exp_avg, exp_avg_sq, master_param) of ``param`` in float32 (a scaled one times its scale).

        A bf16 state comes back as it is with ``skip_unscale``; a float32 one is the state itself.
        """
        state = self.state[param][state_name]
        if state_name in self._scaled_names:
            return unscaled(state, self._scales[param][state_name])
        if skip_unscale and state.dtype == torch.bfloat16:
            return state
        return state.float()

    def set_scaled_state(self, param: torch.nn.Parameter, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store the float32 ``unscaled_state`` as state ``state_name`` of ``param`` (cast to that state's dtype; a
        scaled one with the scale max|x| / range, see :mod:`._scaled_state`).

        Raises:
            NotImplementedError: an int16 master (TE's store_param_remainders format).
        """
        if unscaled_state.dtype == torch.int16:
            raise NotImplementedError(
                f"FusedAdam.set_scaled_state: an int16 {state_name} (store_param_remainders format) is not supported; "
                "pass the float32 master weights"
            )
        state = self.state[param]
        if state_name not in state:
            state[state_name] = self._new_state(param, state_name)
            self._lists.clear()
        if state_name in self._scaled_names:
            store(state[state_name], self._scales[param][state_name], unscaled_state.float())
        else:
            state[state_name].copy_(unscaled_state)

    def state_dict(self) -> dict:
        """torch's state dict with every state in float32 (the format TE saves)."""
        state_dict = super().state_dict()
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for index, param in enumerate(params):
            if index in state_dict["state"]:
                state_dict["state"][index] = {name: self.get_unscaled_state(param, name) for name in self.state[param]}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then each state rebuilt in its configured dtype from the saved float32 values."""
        super().load_state_dict(state_dict)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for index, param in enumerate(params):
            saved = state_dict["state"].get(index)
            if saved is None:
                continue
            self.state[param] = {}
            for name, value in saved.items():
                self.set_scaled_state(param, name, value)
        if self.capturable:
            for group in self.param_groups:
                self._place_capturable_scalars(group)
        self._lists.clear()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop the gradients (set_to_none, the default) or zero them; ``decoupled_grad`` with use_decoupled_grad."""
        set_to_none = resolve_set_to_none("FusedAdam", self.set_grad_none, set_to_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for param in chain.from_iterable(g["params"] for g in self.param_groups):
            if set_to_none:
                param.decoupled_grad = None
            elif getattr(param, "decoupled_grad", None) is not None:
                param.decoupled_grad.zero_()

    # ------------------------------------------------------------------------------------------- step

    def _inv_scale(self, grad_scaler) -> torch.Tensor:
        """Capturable: set the overflow flag from the scaler's found-inf (0 without one); return 1 / scale."""
        if grad_scaler is None:
            self._dummy_overflow_buf.zero_()
            return self._unit_scale
        found_inf = grad_scaler._check_inf_per_device(self).get(self._dummy_overflow_buf.device)
        if found_inf is None:
            self._dummy_overflow_buf.zero_()
        else:
            self._dummy_overflow_buf.copy_(found_inf)
        return grad_scaler._get_scale_async().double().reciprocal().float()

    def _advance_step(self, group: dict, keep: Optional[torch.Tensor]) -> None:
        """t = t + 1 (on the device with capturable, where it only advances when ``keep``)."""
        if keep is None:
            group["step"] = group.get("step", 0) + 1
            return
        if "step" not in group:
            group["step"] = torch.zeros(1, dtype=torch.int32, device=keep.device)
        group["step"] += keep.int()

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One optimisation step over every group (groups without gradients still advance ``step``).

        Args:
            closure: re-evaluates the model and returns the loss.
            grad_scaler: torch.amp.GradScaler, used with capturable (GradScaler.step passes itself).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv_scale, keep = None, None
        if self.capturable:
            inv_scale = self._inv_scale(grad_scaler)
            keep = (self._dummy_overflow_buf == 0).reshape(())
        for index, group in enumerate(self.param_groups):
            self._advance_step(group, keep)
            params = [p for p in group["params"] if self._grad(p) is not None]
            if not params:
                continue
            lists = self._lists.get(index, params)
            grads = [self._grad(p) for p in params]
            scalars = _AdamScalars(
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adam_w_mode=self.adam_w_mode,
                bias_correction=bool(group["bias_correction"]),
            )
            if self._scaled_names:
                lists = self._unscaled_lists(lists)
            if self.capturable:
                _capturable_adam(lists, grads, scalars, step=group["step"], inv_scale=inv_scale, keep=keep)
            else:
                self._fused_adam(lists, grads, scalars, step=group["step"])
            if self.master_weights:
                _copy_masters(lists)
            for name in self._scaled_names:
                for param, values in zip(lists.params, _state_list(lists, name)):
                    self.set_scaled_state(param, name, values)
        return loss

    def _unscaled_lists(self, lists: _AdamLists) -> _AdamLists:
        """``lists`` with each scaled state replaced by its float32 values (the step updates those; they are stored back after)."""
        values = {name: [self.get_unscaled_state(p, name) for p in lists.params] for name in self._scaled_names}
        fields = {_LIST_OF_STATE[name]: v for name, v in values.items() if name in _LIST_OF_STATE}
        if "master_param" in values:
            fields.update(_master_fields(lists.params, values["master_param"]))
        return dataclasses.replace(lists, **fields)

    def _fused_adam(self, lists: _AdamLists, grads: List[torch.Tensor], scalars: _AdamScalars, step: int) -> None:
        """The catalog's multi_tensor_adam over the group (it never skips: the overflow flag stays 0, as in TE)."""
        multi_tensor_applier(
            ops.multi_tensor_adam,
            self._dummy_overflow_buf,
            [grads, lists.weights, lists.exp_avgs, lists.exp_avg_sqs],
            lr=scalars.lr,
            beta1=scalars.beta1,
            beta2=scalars.beta2,
            epsilon=scalars.eps,
            step=step,
            mode=scalars.adam_w_mode,
            bias_correction=scalars.bias_correction,
            weight_decay=scalars.weight_decay,
        )


def _master_fields(params: List[torch.Tensor], masters: Optional[List[torch.Tensor]]) -> dict:
    """The _AdamLists fields the masters decide: ``weights`` (the masters, or the parameters themselves without
    them) and the plain / FP8 parameters paired with their masters (rounded into the former by one foreach copy,
    the latter re-quantized one by one)."""
    if masters is None:
        return {"weights": list(params), "copy_params": [], "copy_masters": [], "quantized": []}
    plain = [(p, m) for p, m in zip(params, masters) if not isinstance(p, QuantizedTensor)]
    return {"weights": masters, "copy_params": [p for p, _ in plain], "copy_masters": [m for _, m in plain],
            "quantized": [(p, m) for p, m in zip(params, masters) if isinstance(p, QuantizedTensor)]}


def _state_list(lists: _AdamLists, name: str) -> List[torch.Tensor]:
    """The list of ``lists`` that holds state ``name``."""
    return lists.weights if name == "master_param" else getattr(lists, _LIST_OF_STATE[name])


def _copy_masters(lists: _AdamLists) -> None:
    """Each parameter := its master: rounded (one foreach copy), or re-quantized in place for FP8 parameters."""
    if lists.copy_params:
        torch._foreach_copy_(lists.copy_params, lists.copy_masters)
    for param, master in lists.quantized:
        param.copy_(master)
