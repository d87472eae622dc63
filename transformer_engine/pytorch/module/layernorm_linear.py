"""``LayerNormLinear``: y = norm(x) W^T + b, the norm fused with the FP8 cast of the GEMM input."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .._functions.common import apply_without_torch_autocast, cast
from ._layernorm_linear_function import LayerNormLinearArgs, LayerNormLinearFunction
from ._linear_setup import checked_norm, keep_norm, linear_parallel_config, norm_linear_outputs, norm_then
from .._checks import check_sizes
from ._params import add_linear_params, add_norm_params
from .base import TransformerEngineBaseModule, default_device, resolve_params_dtype
from .linear import torch_linear

__all__ = ["LayerNormLinear"]


class LayerNormLinear(TransformerEngineBaseModule):
    """Applies y = norm(x) W^T + b with norm = LayerNorm or RMSNorm; FP8 GEMMs under ``te.autocast``.

    Args (TE's, in TE's order): as :class:`~.linear.Linear`, plus
        eps: the norm's epsilon.
        normalization: "LayerNorm" or "RMSNorm".
        return_layernorm_output: also return the norm output (high precision).
        return_layernorm_output_gathered: under sequence parallelism, return the norm output of every
            rank's rows (all-gathered) instead of this rank's.
        zero_centered_gamma: gamma applied as 1 + gamma, initialized to 0.

    Tensor parallelism: "column" only (a row-parallel input holds 1/P of the features, which the
    norm needs all of). Under sequence parallelism the norm runs on the rank's rows, its output is
    all-gathered (in FP8 under FP8) for the GEMM, and the norm parameters' gradients are all-reduced
    over the group (so, unlike NVIDIA TE, they are not marked ``sequence_parallel`` for Megatron to do it).

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (None for RMSNorm), ``weight``, ``bias``
    (or the ``parameters_split`` names).

    Forward: ``forward(inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False)`` returns
    ``out``, then ``bias`` if ``return_bias``, then ``ln_out`` if ``return_layernorm_output``. Where ``te.Linear``
    would run as ``torch.nn.functional.linear`` (high precision, see its docstring), the norm runs as its own autograd
    node (``te.LayerNorm``'s) and the GEMM as PyTorch's ``linear``.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> layer = te.LayerNormLinear(32, 16, normalization="RMSNorm")
        >>> layer(torch.randn(4, 32)).shape
        torch.Size([4, 16])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        zero_centered_gamma: bool = False,
        device: Optional[Union[str, torch.device]] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        name: Optional[str] = None,
    ):
        check_sizes("LayerNormLinear", in_features=in_features, out_features=out_features)
        # a bad eps or an unknown normalization raises here, before any work
        norm = checked_norm("LayerNormLinear", normalization, eps, zero_centered_gamma=zero_centered_gamma)
        super().__init__(1, get_rng_state_tracker, None, name)
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output, self.return_layernorm_output_gathered = return_layernorm_output, return_layernorm_output_gathered
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.parallel = linear_parallel_config(
            tp_group, tp_size, sequence_parallel=sequence_parallel, parallel_mode=parallel_mode, symmetric_ar_type=symmetric_ar_type,
            ub_name=ub_name, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )
        keep_norm(self, norm)
        device = default_device(device)
        self.params_dtype = resolve_params_dtype(params_dtype, None)
        if parallel_mode == "row" and self.tp_size > 1:
            raise ValueError(
                f"LayerNormLinear(parallel_mode='row', tp_size={self.tp_size}): the norm needs every input feature, "
                "a row-parallel rank has 1/tp_size of them; use parallel_mode='column', or a LayerNorm then a row-parallel Linear"
            )
        add_norm_params(self, "layer_norm_", (in_features,), self.norm, dtype=self.params_dtype, device=device)
        self.layout = add_linear_params(
            self, "", in_features, out_features, parameters_split=parameters_split, bias=bias, init_method=init_method,
            dtype=self.params_dtype, device=device, parallel_mode=parallel_mode, tp_size=self.tp_size,
        )
        self.reset_parameters(defer_init=device.type == "meta")
        self._delay_wgrads(delay=delay_wgrad_compute, names=self.layout.weight_names + self.layout.bias_names)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """out = norm(inp) W^T + b; returns out[, bias][, ln_out] (TE's order)."""
        weight, bias = self.layout.weight(self), self.layout.bias(self)
        # comm: tensor parallelism, what the Function communicates
        act_dtype, comms, q = self._linear_prelude((inp, weight), self.in_features)
        (comm,) = comms
        gemm_bias = None if self.return_bias else bias
        if self._runs_as_torch_linear(inp, (weight,), act_dtype, q, comms):  # the norm's node, then PyTorch's linear
            result = norm_then(self, inp, act_dtype, self.in_features, lambda ln_out: torch_linear(ln_out, weight, gemm_bias, act_dtype))
        else:
            args = LayerNormLinearArgs(
                dtype=act_dtype,
                quantization=q,
                weight_operand=self._weight_operand("weight", weight, q.gemms[0].weight, is_first_microbatch=is_first_microbatch),
                wgrad=self._wgrad_target(weight.dtype, self.layout.weight_params(self)),
                norm=self.norm,
                return_layernorm_output=self.return_layernorm_output,
                comm=comm,
            )
            result = apply_without_torch_autocast(
                LayerNormLinearFunction, inp.device, inp, self.layer_norm_weight, self.layer_norm_bias, weight, gemm_bias, args,
            )
        return norm_linear_outputs(self, result, comm.deferred_bias(cast(bias, act_dtype)), comm)

