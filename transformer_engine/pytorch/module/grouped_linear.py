"""``GroupedLinear``: y_i = x_i W_i^T + b_i over the row splits of x, TE's grouped linear for mixture-of-experts."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from ..parallel.tensor_parallel import local_features, megatron_attributes
from ..quantization.autocast import current_config
from ..quantization.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from ..quantization.roles import Role
from .._checks import check_sizes
from .._functions.common import apply_without_torch_autocast, cast
from .._functions.fp8_meta import ForwardQuantization
from ._grouped_fp8_function import (
    CurrentSplits, DelayedSplits, GroupedFp8Args, GroupedFp8Function, GroupedFp8Weights, SplitCaster, cast_weights,
)
from ._grouped_linear_function import GroupedLinearArgs, GroupedLinearFunction
from ._params import default_init_method
from .base import (
    _DEFAULT_FIRST_MICROBATCH, ParallelConfig, TransformerEngineBaseModule, check_saved_input, check_unsupported, default_device,
    resolve_params_dtype,
)

__all__ = ["GroupedLinear"]


_GROUPED_WEIGHTS = "grouped_fp8_weights"  # the weight cache's key of the one-call path's FP8 weights


def _zeros(t: torch.Tensor) -> None:
    t.zero_()


class GroupedLinear(TransformerEngineBaseModule):
    """Applies y_i = x_i W_i^T + b_i to the splits x = [x_0; ...; x_{n-1}] of the input rows (n = num_gemms).

    Split i runs as a ``Linear`` holding ``weight{i}`` / ``bias{i}`` would run it, bit for bit, under
    ``te.autocast`` with GEMM i's quantizers (FP8 state: 3n forward slots, input / weight / output per
    GEMM, and 2n backward slots, grad output / grad input per GEMM). Under delayed or current scaling, splits
    and features that are multiples of 16 run all splits in one call per pass (each split's casts in one launch,
    grouped GEMMs: ``_grouped_fp8_function``), with the same casts and products per split (bit for bit on the
    reference backend; on a GPU the GEMMs may sum in another order).

    Args (TE's, in TE's order):
        num_gemms: n, the number of splits (experts).
        in_features, out_features: sizes of each GEMM's input and output features.
        sequence_parallel: stored (only with tp_size > 1).
        fuse_wgrad_accumulation: accumulate dW_i into ``weight{i}.main_grad`` (fp32) instead of ``.grad``.
        tp_group, tp_size: the tensor-parallel group and size; as in TE, only the parameter shapes follow
            them (the MoE dispatcher does the communication). A bias needs tp_size 1.
        get_rng_state_tracker, rng_tracker_name: RNG tracker whose ``fork`` wraps initialization.
        init_method: callable(weight) initializing each weight; default normal with std 0.023.
        bias: add a learnable bias per GEMM.
        return_bias: return (y, [b_0, ..., b_{n-1}]) with the biases not added (cast to the activation
            dtype; None entries with ``bias=False``).
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
        parallel_mode: None, "column" (out_features divided by tp_size) or "row" (in_features divided).
        device: parameter device; None = current CUDA device if any, else CPU; "meta" defers init.
        ub_name: stored.
        name: debug name.
        use_grouped_tensor: None or a bool, stored: TE's grouped tensors (one parameter for all weights) are not
            offered; the path taken follows the recipe and the splits (above).
        ub_overlap_rs, ub_overlap_ag: unsupported, as in TE (ValueError).
        delay_wgrad_compute: backward computes dgrad only and queues every dW_i for :meth:`backward_dw` (see
            :mod:`.._functions.wgrad_store`).
        save_original_input: keep the input as given for backward (as the MoE layer keeps it anyway) rather than
            each split's FP8 x_i^T, which backward casts again; not with DelayedScaling (ValueError).
        single_grouped_weight, single_grouped_bias: not implemented yet (must stay False).

    Parameters: ``weight0`` .. ``weight{n-1}`` [out, in] and ``bias0`` .. ``bias{n-1}`` [out] (None
    without bias).

    Forward: ``forward(inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None)``; ``m_splits``
    is a list of n non-negative ints summing to the rows of ``inp`` (a tensor is accepted in eager mode;
    torch.compile needs the list). ``out`` / ``dgrad_out``: preallocated buffers for y [M, out_features] and, in
    backward, dx [M, in_features] (2-D, contiguous, not requiring grad, on the input's device; out in the activation
    dtype, dgrad_out in the input's dtype; a 2-D input): the returned y is ``out`` itself (the splits' outputs are
    copied into it, one pass), and dgrad_out receives dx, which autograd hands on (it may copy it into a leaf's
    ``.grad``). Reusing a buffer across steps: pass ``buffer.detach()``, since the returned y carries autograd history.
    Under FP8 a split may have any row count, as in TE (the weights follow TE's FP8 shape rule); MXFP8 and
    NVFP4 need multiples of 32 / 16 rows (their column-wise block scales; the error names the split). A split
    whose rows are not a multiple of 16 cannot take cuBLASLt's FP8 GEMM for its weight gradient (K = its rows):
    that GEMM runs on the reference backend (dequantized, float32); ``Fp8Padding`` aligns the splits.

    Example:
        >>> import torch
        >>> from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
        >>> layer = GroupedLinear(3, 32, 16)
        >>> layer(torch.randn(10, 32), [4, 0, 6]).shape
        torch.Size([10, 16])
    """

    def __init__(
        self,
        num_gemms: int,
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
        device: Optional[Union[str, torch.device]] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
    ):
        check_sizes("GroupedLinear", num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        super().__init__(num_gemms, get_rng_state_tracker, rng_tracker_name, name)
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear does not support Userbuffer overlap (ub_overlap_rs / ub_overlap_ag); leave them False")
        check_unsupported(single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_bias)
        self.save_original_input = save_original_input
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(f"use_grouped_tensor must be a bool or None, got {type(use_grouped_tensor).__name__}")
        self.parallel = ParallelConfig(tp_group, tp_size, sequence_parallel=sequence_parallel, parallel_mode=parallel_mode, ub_name=ub_name)
        if self.tp_size > 1 and bias:
            raise ValueError(
                f"GroupedLinear does not support a bias with tp_size={self.tp_size} (the tensor-parallel communication "
                "happens outside the module); pass bias=False"
            )
        self.num_gemms, self.use_grouped_tensor = num_gemms, use_grouped_tensor
        self.in_features, self.out_features = local_features(in_features, out_features, parallel_mode, self.tp_size)
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.params_dtype = resolve_params_dtype(params_dtype, None)
        device = default_device(device)
        self._add_params(init_method or default_init_method, device)
        self.reset_parameters(defer_init=device.type == "meta")
        self._delay_wgrads(delay=delay_wgrad_compute, names=self._weight_names + (self._bias_names if bias else ()))

    def _add_params(self, init_method: Callable, device: torch.device) -> None:
        """Register ``weight{i}`` [out, in] and ``bias{i}`` [out] (or None) for each GEMM; the weights are slices of one
        [num_gemms, out, in] buffer, which the one-call FP8 path reads as the stacked weights."""
        tp_attrs = megatron_attributes(self.parallel_mode)
        shape = (self.out_features, self.in_features)
        stacked = torch.empty((self.num_gemms, *shape), dtype=self.params_dtype, device=device)  # one-call FP8: no stack copy
        for i in range(self.num_gemms):
            self._register(f"weight{i}", shape, init_method, self.params_dtype, device, data=stacked[i], fp8_gemm=i, **tp_attrs)
            if self.use_bias:
                self._register(f"bias{i}", shape[:1], _zeros, self.params_dtype, device)
            else:
                self.register_parameter(f"bias{i}", None)
        self._weight_names = tuple(f"weight{i}" for i in range(self.num_gemms))
        self._bias_names = tuple(f"bias{i}" for i in range(self.num_gemms))

    def _apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``, ...), which gives each weight its own tensor, then
        the weights back to back in one buffer again (see :meth:`_add_params`); weights of other kinds (FP8, sharded
        tensor subclasses, meta) are left as they are."""
        module = super()._apply(fn, *args, **kwargs)
        weights = [getattr(self, name) for name in self._weight_names]
        plain = all(type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor and w.device.type != "meta" for w in weights)
        if plain and len({(w.dtype, w.device, tuple(w.shape)) for w in weights}) == 1:
            with torch.no_grad():
                for weight, part in zip(weights, torch.stack([w.detach() for w in weights])):
                    weight.data = part
        return module

    _ROLE_MAJOR_CHECKPOINT = True  # TE's GroupedLinear stores its slots role-major; Megatron-Core splits them per expert so

    # ----------------------------------------------------------------------------- TE's module API (Megatron-Core)
    @property
    def fp8(self) -> bool:
        """True inside an ``autocast`` that quantizes (TE's flag)."""
        return current_config().enabled

    @property
    def fp8_calibration(self) -> bool:
        """True inside an ``autocast`` that only records amaxes (TE's flag)."""
        config = current_config()
        return config.calibrating and not config.enabled

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE's hook before loading a checkpoint: the scaling state is built when it is first needed, so
        this only checks the GEMM count.

        Raises:
            ValueError: ``num_gemms`` differs from the module's.
        """
        if num_gemms != self.num_gemms:
            raise ValueError(f"init_fp8_metadata(num_gemms={num_gemms}) on a GroupedLinear of {self.num_gemms} GEMMs")

    # ----------------------------------------------------------------------------- forward
    def _check_splits(self, inp: torch.Tensor, m_splits) -> Tuple[int, ...]:
        """``m_splits`` as a tuple of ints, checked against the GEMM count and the input's rows."""
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        splits = tuple(m_splits)
        if len(splits) != self.num_gemms:
            raise ValueError(f"m_splits has {len(splits)} entries but GroupedLinear has num_gemms={self.num_gemms}")
        if any(not isinstance(m, int) or m < 0 for m in splits):
            raise ValueError(f"m_splits must be non-negative ints, got {list(splits)}")
        rows = math.prod(inp.shape[:-1])
        if sum(splits) != rows:
            raise ValueError(
                f"m_splits {list(splits)} sums to {sum(splits)}, but the input of shape {tuple(inp.shape)} has {rows} rows "
                f"(the product of all dimensions but the last)"
            )
        return splits

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor], is_first_microbatch: Optional[bool] = None,
                out: Optional[torch.Tensor] = None, dgrad_out: Optional[torch.Tensor] = None):
        """y_i = x_i W_i^T + b_i for the row splits x_i of ``inp``; returns y, or (y, [b_i]) with ``return_bias``."""
        weights = [getattr(self, name) for name in self._weight_names]
        biases = [getattr(self, name) for name in self._bias_names]
        act_dtype = self._check_input(inp, weights[0].dtype, self.in_features)
        splits = self._check_splits(inp, m_splits)
        _check_buffer("out", out, inp, (inp.shape[0], self.out_features), act_dtype)
        _check_buffer("dgrad_out", dgrad_out, inp, (inp.shape[0], self.in_features), inp.dtype)
        q = self._prepare_quantization(inp.device, [("weight", weights[0].shape)])
        if self.save_original_input:
            check_saved_input("GroupedLinear", q.gemms[0].input)
        biases = [None] * self.num_gemms if self.return_bias else biases
        casters = self._split_casters(q, splits, weights, out, dgrad_out)
        if casters is not None:
            inputs, weight_casts, grad_outputs = casters
            fp8_weights = self._fp8_weights(weight_casts, weights, is_first_microbatch=is_first_microbatch)
            args = GroupedFp8Args(dtype=act_dtype, m_splits=splits, weights=fp8_weights, inputs=inputs, grad_outputs=grad_outputs,
                                  split_accumulator=q.split_accumulator, backward_update=q.backward_update)
            out = apply_without_torch_autocast(GroupedFp8Function, inp.device, inp, args, *weights, *biases)
            return self._with_bias(out, act_dtype)
        args = GroupedLinearArgs(
            dtype=act_dtype,
            quantization=q,
            m_splits=splits,
            weight_operands=tuple(self._weight_operand(name, w, g.weight, is_first_microbatch=is_first_microbatch)
                                  for name, w, g in zip(self._weight_names, weights, q.gemms)),
            wgrads=tuple(self._wgrad_target(w.dtype, (w,)) for w in weights),
            save_original_input=self.save_original_input,
            out=out,
            dgrad_out=dgrad_out,
        )
        out = apply_without_torch_autocast(GroupedLinearFunction, inp.device, inp, args, *weights, *biases)
        return self._with_bias(out, act_dtype)

    def _with_bias(self, out: torch.Tensor, act_dtype: torch.dtype):
        """y, or (y, [b_i in the activation dtype]) with ``return_bias``."""
        if self.return_bias:
            return out, [cast(getattr(self, name), act_dtype) for name in self._bias_names]
        return out

    def _split_casters(self, q: ForwardQuantization, splits: Tuple[int, ...], weights, out, dgrad_out):
        """(input, weight, grad output) casts of :class:`GroupedFp8Function` (every split's cast in one launch, one
        grouped GEMM a pass) when this call takes it rather than a GEMM per split, else None. It takes eager FP8
        delayed or current scaling (no amax reduction) on high-precision weights, splits and features that are
        multiples of 16 (FP8 GEMM alignment), and none of the options that act per split (main_grad accumulation,
        delayed or recomputed wgrads, preallocated buffers)."""
        roles = (q.gemms[0].input, q.gemms[0].weight, q.gemms[0].grad_output)
        if (torch.compiler.is_compiling() or self.primary_weights_in_fp8 or out is not None or dgrad_out is not None
                or self.save_original_input or self.fuse_wgrad_accumulation or self.wgrad_store.delay_wgrad_compute()
                or any(m % 16 for m in splits) or self.in_features % 16 or self.out_features % 16 or weights[0].dim() != 2):
            return None
        if all(type(r) is Float8Quantizer for r in roles):
            fwd, bwd = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
            return DelayedSplits(fwd, Role.INPUT), DelayedSplits(fwd, Role.WEIGHT), DelayedSplits(bwd, Role.GRAD_OUTPUT)
        if all(type(r) is Float8CurrentScalingQuantizer and r.reduce_amax is None for r in roles):
            return tuple(CurrentSplits(r) for r in roles)
        return None

    def _fp8_weights(self, caster: SplitCaster, weights, is_first_microbatch: Optional[bool]) -> GroupedFp8Weights:
        """The weights in FP8 for the one-call path, cached per TE's ``is_first_microbatch`` rule (as per split): None
        casts, True casts and caches, False reuses the cache (recording no amax), casting if there is none yet."""
        if is_first_microbatch is None:
            is_first_microbatch = _DEFAULT_FIRST_MICROBATCH[0]
        cached = self._weight_cache.get(_GROUPED_WEIGHTS)
        if is_first_microbatch is False and isinstance(cached, GroupedFp8Weights):
            return cached
        fp8_weights = cast_weights(caster, weights)
        if is_first_microbatch is not None:
            self._weight_cache[_GROUPED_WEIGHTS] = fp8_weights
        return fp8_weights


def _check_buffer(name: str, buffer: Optional[torch.Tensor], inp: torch.Tensor, shape: Tuple[int, int], dtype: torch.dtype) -> None:
    """Raise ValueError for a preallocated buffer that cannot receive the result (None passes).

    It must be a 2-D, contiguous tensor of ``shape`` and ``dtype`` on the input's device, not requiring grad, and the
    input must be 2-D (the result has the input's rows).
    """
    if buffer is None:
        return
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"GroupedLinear: {name} must be a torch.Tensor, got {type(buffer).__name__}")
    problems = [
        (inp.dim() != 2, f"the input is {inp.dim()}-D; a buffer needs a 2-D input [tokens, features]"),
        (tuple(buffer.shape) != tuple(shape), f"its shape {tuple(buffer.shape)} is not {tuple(shape)}"),
        (buffer.dtype != dtype, f"its dtype {buffer.dtype} is not {dtype}"),
        (buffer.device != inp.device, f"it is on {buffer.device}, the input on {inp.device}"),
        (not buffer.is_contiguous(), "it is not contiguous"),
        (buffer.requires_grad, "it requires grad (pass buffer.detach())"),
    ]
    for failed, why in problems:
        if failed:
            raise ValueError(f"GroupedLinear: the preallocated {name} buffer cannot be used: {why}")
