"""``Linear``: y = x W^T + b, TE's drop-in for ``torch.nn.Linear`` with FP8 GEMMs under ``autocast``."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .._functions.common import apply_without_torch_autocast, cast
from .._functions.linear_function import LinearArgs, LinearFunction
from ._linear_setup import linear_parallel_config
from .._checks import check_sizes
from ._params import add_linear_params
from .base import TransformerEngineBaseModule, default_device, resolve_params_dtype, te_outputs

__all__ = ["Linear"]


def torch_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """y = inp W^T + b in ``dtype`` as ``torch.nn.functional.linear`` on the rows of ``inp`` (one ``addmm`` whatever the
    input's rank: the bias rides the GEMM's epilogue, as in ``LinearFunction``), with PyTorch's autograd."""
    x, weight, bias = cast(inp, dtype), cast(weight, dtype), cast(bias, dtype)
    if x.dim() == 2:  # no view nodes for autograd to walk
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class Linear(TransformerEngineBaseModule):
    """Applies y = x W^T + b; under ``te.autocast`` its fprop, dgrad and wgrad GEMMs run in FP8.

    Args (TE's, in TE's order):
        in_features, out_features: sizes of the input and output features.
        sequence_parallel: with tensor parallelism, the input (column) or output (row) is split along
            dim 0 over the ranks; the column-parallel input is all-gathered (in FP8 under FP8), the
            row-parallel output reduce-scattered.
        fuse_wgrad_accumulation: accumulate dW into ``weight.main_grad`` (fp32) instead of ``weight.grad``.
        tp_group, tp_size: tensor-parallel group and size (the group's size wins; a module built with
            tp_size > 1 and no group runs once :meth:`set_tensor_parallel_group` gave it one).
        get_rng_state_tracker, rng_tracker_name: RNG tracker whose ``fork`` wraps initialization.
        init_method: callable(weight) initializing the weight; default normal with std 0.023.
        bias: add a learnable bias.
        return_bias: return (y, bias) with the bias not added (cast to the activation dtype).
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
        parallel_mode: None, "column" (out_features split; the gradient of the input is all-reduced)
            or "row" (in_features split; the output is all-reduced, then the bias added).
        parameters_split: names (equal split) or name -> size: parameters ``<name>_weight`` / ``<name>_bias``.
        device: parameter device; None = current CUDA device if any, else CPU; "meta" defers init
            to :meth:`reset_parameters`.
        ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad: with sequence parallelism, pipeline a collective
            with the GEMM next to it, block by block (``parallel.overlap``: copy-engine transfers over CUDA
            symmetric memory; plain collectives elsewhere): ``ub_overlap_ag`` the all-gather of the input
            before the fprop (column) and of dy before the dgrad (row), ``ub_overlap_rs`` the reduce-scatter
            of the output after the fprop (row), ``ub_overlap_rs_dgrad`` (or ``ub_bulk_wgrad``) that of dx
            after the dgrad (column). ``ub_bulk_dgrad`` and ``ub_name`` are accepted and have no effect.
        delay_wgrad_compute: backward computes dgrad only and queues dW for :meth:`backward_dw` (see
            :mod:`.._functions.wgrad_store`).
        save_original_input: keep the input as given for backward (memory shared with whoever else keeps it) rather
            than its FP8 x^T, which backward casts again; not with DelayedScaling (ValueError), nor yet with
            sequence parallelism in column mode (NotImplementedError).
        symmetric_ar_type: stored.
        name: debug name.
        dtype: alias of ``params_dtype`` (``torch.nn.Linear``'s keyword, so the classes can be swapped).

    Forward: ``forward(inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False)``: outputs are
    always high precision (``fp8_output`` / ``fp8_grad`` are accepted for TE parity). A high-precision call
    without tensor parallelism, ``fuse_wgrad_accumulation`` or ``delay_wgrad_compute`` runs as
    ``torch.nn.functional.linear`` with PyTorch's autograd where the policy's ``gemm`` is PyTorch's matmul
    (vendor.cuda's, see ``OpImpl.aten_dtypes``): the same math at ``nn.Linear``'s host cost.

    Example:
        >>> import torch, transformer_engine.pytorch as te
        >>> layer = te.Linear(32, 16)
        >>> layer(torch.randn(4, 32)).shape
        torch.Size([4, 16])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        device: Optional[Union[str, torch.device]] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
        *,
        dtype: Optional[torch.dtype] = None,
    ):
        check_sizes("Linear", in_features=in_features, out_features=out_features)
        super().__init__(1, get_rng_state_tracker, rng_tracker_name, name)
        if save_original_input and sequence_parallel and parallel_mode == "column":
            raise NotImplementedError("Linear(save_original_input=True) with sequence parallelism in column mode (the input "
                                      "all-gathered) is not implemented yet; leave save_original_input False there")
        self.save_original_input = save_original_input
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.parallel = linear_parallel_config(
            tp_group, tp_size, sequence_parallel=sequence_parallel, parallel_mode=parallel_mode, symmetric_ar_type=symmetric_ar_type,
            ub_name=ub_name, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
        )
        device = default_device(device)
        self.params_dtype = resolve_params_dtype(params_dtype, dtype)
        self.layout = add_linear_params(
            self, "", in_features, out_features, parameters_split=parameters_split, bias=bias, init_method=init_method,
            dtype=self.params_dtype, device=device, parallel_mode=parallel_mode, tp_size=self.tp_size,
        )
        self.reset_parameters(defer_init=device.type == "meta")
        self._delay_wgrads(delay=delay_wgrad_compute, names=self.layout.weight_names + self.layout.bias_names)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """y = inp W^T + b over the last dim; returns y, or (y, bias) with ``return_bias``."""
        weight, bias = self.layout.weight(self), self.layout.bias(self)
        # comm: tensor parallelism, what the Function communicates
        act_dtype, comms, q = self._linear_prelude((inp, weight), self.layout.in_features,
                                                   saved_input_of="Linear" if self.save_original_input else None)
        (comm,) = comms
        gemm_bias = None if self.return_bias else bias
        if self._runs_as_torch_linear(inp, (weight,), act_dtype, q, comms):
            out = torch_linear(inp, weight, gemm_bias, act_dtype)
        else:
            args = LinearArgs(
                dtype=act_dtype,
                quantization=q,
                weight_operand=self._weight_operand("weight", weight, q.gemms[0].weight, is_first_microbatch=is_first_microbatch),
                wgrad=self._wgrad_target(weight.dtype, self.layout.weight_params(self)),
                comm=comm,
                save_original_input=self.save_original_input,
            )
            out = apply_without_torch_autocast(LinearFunction, inp.device, inp, weight, gemm_bias, args)
        return te_outputs(out, comm.deferred_bias(cast(bias, act_dtype)), return_bias=self.return_bias, return_layernorm_output=False)

