"""``LayerNormMLP``: y = fc2(act(fc1(norm(x)))), TE's fused MLP block with FP8 GEMMs under ``autocast``."""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from ..parallel.linear_comm import NO_COMM, LinearComm
from .._functions.activation import ActivationConfig
from .._functions.activation_function import ActivationArgs, apply_activation
from .._functions.common import apply_without_torch_autocast, cast
from ._layernorm_mlp_function import LayerNormMLPArgs, LayerNormMLPFunction
from ._linear_setup import checked_norm, keep_norm, linear_parallel_config, norm_linear_outputs, norm_then
from .._checks import check_sizes
from ._params import add_linear_params, add_norm_params
from .base import TransformerEngineBaseModule, default_device, resolve_params_dtype
from .linear import torch_linear

__all__ = ["LayerNormMLP"]


class LayerNormMLP(TransformerEngineBaseModule):
    """Applies y = fc2(act(fc1(norm(x)))); fc1 has 2F rows for the gated activations.

    Args (TE's, in TE's order):
        hidden_size, ffn_hidden_size: H and F.
        eps, normalization, zero_centered_gamma: the norm (see :class:`~.layernorm_linear.LayerNormLinear`).
        return_bias: return fc2's bias separately instead of adding it.
        activation: one of gelu (tanh approximation), geglu, glu, qgelu, qgeglu, relu, reglu, srelu,
            sreglu, silu, swiglu, clamped_swiglu.
        activation_params: for clamped_swiglu, {limit (7.0), alpha (1.702), glu_linear_offset (1.0)}.
        init_method, output_layer_init_method: initializers of fc1 and fc2 (default normal, std 0.023).
        set_parallel_mode: fc1 column-parallel, fc2 row-parallel (over tp_size); a gated fc1 [a; b] is
            split so that each rank holds [a_r; b_r] (``partition_stride`` 2). Under sequence parallelism
            the norm runs on the rank's rows, its (FP8) output is all-gathered for fc1, fc2's output is
            reduce-scattered, and the gradients of the norm parameters and fc2's bias are all-reduced.
        return_layernorm_output(_gathered), fuse_wgrad_accumulation, params_dtype, device, tp_group,
            tp_size, sequence_parallel, get_rng_state_tracker, ub_*, name, symmetric_ar_type: as in Linear.
        seq_length, micro_batch_size: stored.
        delay_wgrad_compute: backward computes dgrad only and queues both dW for :meth:`backward_dw` (see
            :mod:`.._functions.wgrad_store`).
        checkpoint: TE's selective recomputation: forward keeps none of the [tokens, ffn] activations and backward
            recomputes the norm, fc1 and the activation (not fc2) with forward's scales: the same results for
            less memory and one more norm and fc1 GEMM. Not yet with tensor or sequence parallelism.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias``, ``fc1_weight`` [F or 2F, H], ``fc1_bias``,
    ``fc2_weight`` [H, F], ``fc2_bias``.

    Forward: ``forward(inp, is_first_microbatch=None)`` returns out[, fc2_bias][, ln_out]. Where ``te.Linear`` would
    run as ``torch.nn.functional.linear`` (high precision, see its docstring) and without ``checkpoint``, the norm and
    the activation run as autograd nodes of their own and FC1 / FC2 as PyTorch's ``linear``.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> mlp = te.LayerNormMLP(32, 64, activation="swiglu")
        >>> tuple(mlp.fc1_weight.shape), mlp(torch.randn(4, 32)).shape
        ((128, 32), torch.Size([4, 32]))
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: Optional[Union[str, torch.device]] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        checkpoint: bool = False,
    ):
        check_sizes("LayerNormMLP", hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        # a bad eps or an unknown normalization raises here, before any work
        norm = checked_norm("LayerNormMLP", normalization, eps, zero_centered_gamma=zero_centered_gamma)
        activation_config = ActivationConfig.create(activation, activation_params)  # so does an unknown activation
        super().__init__(2, get_rng_state_tracker, None, name)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation_config
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output, self.return_layernorm_output_gathered = return_layernorm_output, return_layernorm_output_gathered
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.set_parallel_mode, self.seq_length, self.micro_batch_size = set_parallel_mode, seq_length, micro_batch_size
        self.parallel = linear_parallel_config(
            tp_group, tp_size, sequence_parallel=sequence_parallel, parallel_mode=None, symmetric_ar_type=symmetric_ar_type,
            ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )
        if checkpoint and (self.tp_size > 1 or sequence_parallel):
            raise NotImplementedError("LayerNormMLP(checkpoint=True) with tensor or sequence parallelism is not implemented yet "
                                      "(the recomputation would redo fc1's communication); leave checkpoint False there")
        self.checkpoint = checkpoint
        keep_norm(self, norm)
        device = default_device(device)
        self.params_dtype = resolve_params_dtype(params_dtype, None)
        common = dict(bias=bias, dtype=self.params_dtype, device=device, tp_size=self.tp_size)
        add_norm_params(self, "layer_norm_", (hidden_size,), self.norm, dtype=self.params_dtype, device=device)
        halves = 2 if self.activation.gated else 1
        self.fc1 = add_linear_params(self, "fc1_", hidden_size, ffn_hidden_size * halves, init_method=init_method,
                                     parallel_mode="column" if set_parallel_mode else None, partition_stride=halves, **common)
        self.fc2 = add_linear_params(self, "fc2_", ffn_hidden_size, hidden_size, init_method=output_layer_init_method,
                                     parallel_mode="row" if set_parallel_mode else None, fp8_gemm=1, **common)
        self.reset_parameters(defer_init=device.type == "meta")
        self._delay_wgrads(delay=delay_wgrad_compute,
                           names=[*self.fc1.weight_names, *self.fc1.bias_names, *self.fc2.weight_names, *self.fc2.bias_names])

    _FP8_OPERANDS = ("input", "fc1_weight", "fc2_weight")
    _NO_COMMS = (NO_COMM, NO_COMM)

    def _gemm_comms(self) -> Tuple[LinearComm, LinearComm]:
        """fc1 column-parallel, fc2 row-parallel with ``set_parallel_mode``; else neither communicates."""
        split = self.set_parallel_mode
        return self._comm("column" if split else None), self._comm("row" if split else None)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """out = fc2(act(fc1(norm(inp)))); returns out[, fc2_bias][, ln_out] (TE's order)."""
        w1, w2 = self.fc1.weight(self), self.fc2.weight(self)
        # comms: tensor parallelism, what the Function communicates
        act_dtype, comms, q = self._linear_prelude((inp, w1, w2), self.hidden_size, what="hidden_size")
        fc1_comm, fc2_comm = comms
        b2 = self.fc2.bias(self)
        gemm_b2 = None if self.return_bias else b2
        if not self.checkpoint and self._runs_as_torch_linear(inp, (w1, w2), act_dtype, q, comms):
            result = norm_then(self, inp, act_dtype, self.hidden_size,
                               lambda ln_out: self._torch_linears(ln_out, w1, w2, gemm_b2, act_dtype))
        else:
            args = LayerNormMLPArgs(
                dtype=act_dtype,
                quantization=q,
                fc1_operand=self._weight_operand("fc1_weight", w1, q.gemms[0].weight, is_first_microbatch=is_first_microbatch),
                fc2_operand=self._weight_operand("fc2_weight", w2, q.gemms[1].weight, is_first_microbatch=is_first_microbatch),
                fc1_wgrad=self._wgrad_target(w1.dtype, self.fc1.weight_params(self)),
                fc2_wgrad=self._wgrad_target(w2.dtype, self.fc2.weight_params(self)),
                norm=self.norm,
                activation=self.activation,
                return_layernorm_output=self.return_layernorm_output,
                fc1_comm=fc1_comm,
                fc2_comm=fc2_comm,
                checkpoint=self.checkpoint,
            )
            result = apply_without_torch_autocast(
                LayerNormMLPFunction, inp.device, inp, self.layer_norm_weight, self.layer_norm_bias, w1, self.fc1.bias(self), w2,
                gemm_b2, args,
            )
        return norm_linear_outputs(self, result, fc2_comm.deferred_bias(cast(b2, act_dtype)), fc1_comm)

    def _torch_linears(self, ln_out: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: Optional[torch.Tensor],
                       dtype: torch.dtype) -> torch.Tensor:
        """fc2(act(fc1(ln_out))) in high precision, ``b2`` (None with ``return_bias``) added by FC2: PyTorch's ``linear`` for
        FC1 and FC2 (see ``Linear``), the activation as an autograd node of its own (``apply_activation``, as ``te.ops``'
        activations)."""
        h = torch_linear(ln_out, w1, self.fc1.bias(self), dtype)
        a = apply_activation(h, ActivationArgs(act=self.activation, dtype=dtype, interleave=None, cache_quantizer=None))
        return torch_linear(a, w2, b2, dtype)
