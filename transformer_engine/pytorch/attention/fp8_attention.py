"""FP8 attention of ``DotProductAttention`` under a recipe with ``fp8_dpa=True`` (NVIDIA TE's scaling roles).

The module keeps delayed-scaling states of its own, sized as TE sizes them (3 GEMMs: 9 forward slots, 6 backward),
of which six slots are used:

    QKV   forward slot 2 (TE's GEMM1_OUTPUT): q, k and v cast with one scale (the largest of their amaxes recorded)
    O     forward slot 3 (GEMM2_INPUT): the output's cast inside the kernel
    S     forward slot 8 (GEMM3_OUTPUT): the softmax probabilities' cast inside the kernel
    dQKV  backward slot 0 (GRAD_OUTPUT1): dQ, dK, dV
    dO    backward slot 3 (GRAD_INPUT2)
    dP    backward slot 5 (GRAD_INPUT3): the scores' gradient inside the kernel

Forward: q, k, v cast to FP8 (E4M3), ``ops.fused_attn_fp8_fwd``, O8 dequantized to the inputs' dtype. Backward: dO cast
(E5M2 under HYBRID), ``ops.fused_attn_fp8_bwd``, dQ8 / dK8 / dV8 dequantized. The states update with the module's others
at the autocast's exit (forward) and at the end of backward (TE's rule, :func:`register_states`). Only DelayedScaling
runs it: ``te.autocast`` refuses ``fp8_dpa`` under other recipes and ``fp8_mha`` (FP8 handed across the attention's
boundaries) everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from transformer_engine.plugin import ops
from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.catalog.attention_fp8 import fp8_attention_error

from .._functions import extra_state
from .._functions.fp8_meta import ensure_states, new_fp8_meta
from ..quantization.autocast import current_config, register_states
from ..quantization.quantizer import Quantizer

__all__ = ["FP8AttentionState", "fp8_attention"]

#: TE's slots: forward QKV, O, S; backward dQKV, dO, dP
_QKV, _O, _S = 2, 3, 8
_DQKV, _DO, _DP = 0, 3, 5


@dataclass(frozen=True)
class _Quantizers:
    """The six quantizers of one FP8 attention call and the backward update this module runs (or None)."""

    qkv: Quantizer
    o: Quantizer
    s: Quantizer
    dqkv: Quantizer
    do: Quantizer
    dp: Quantizer
    backward_update: Optional[Callable[..., None]]


class FP8AttentionState:
    """A ``DotProductAttention``'s FP8 scaling state (``fp8_meta`` in TE's layout) and its quantizers."""

    def __init__(self):
        self.fp8_meta: Dict = new_fp8_meta(3)
        self._quantizers: Dict[str, list] = {"scaling_fwd": [], "scaling_bwd": []}

    def extra_state(self) -> torch.Tensor:
        """The state in TE's ``_extra_state`` format (what TE keeps as ``core_attention._extra_state``), empty before
        the first FP8 attention call."""
        return extra_state.save_states(self.fp8_meta)

    def load_extra_state(self, state, device: torch.device, owner: str) -> None:
        """Restore what :meth:`extra_state` (or NVIDIA TE's DotProductAttention) saved; an empty payload restores nothing.

        Raises:
            ValueError: see ``extra_state.load_states``.
        """
        extra_state.load_states(state, self.fp8_meta, self._quantizers, self.fp8_meta["recipe"], owner, device)

    @staticmethod
    def requested() -> bool:
        """True when the active autocast asks for FP8 attention (its recipe's ``fp8_dpa``)."""
        config = current_config()
        return config.enabled and getattr(config.recipe, "fp8_dpa", False)

    def quantizers(self, device: torch.device, owner: str) -> _Quantizers:
        """This call's quantizers (when :meth:`requested`), its states queued for their updates."""
        ensure_states(self.fp8_meta, self._quantizers, current_config().recipe, device, owner)
        fwd, bwd = self._quantizers["scaling_fwd"], self._quantizers["scaling_bwd"]
        update = register_states(self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"])
        return _Quantizers(fwd[_QKV], fwd[_O], fwd[_S], bwd[_DQKV], bwd[_DO], bwd[_DP], update)


class _FP8AttentionFunction(torch.autograd.Function):
    """O = attention(q, k, v) in FP8; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, quant: _Quantizers, config: AttentionConfig):
        q8, k8, v8 = (quant.qkv.quantize(t) for t in (q, k, v))
        s_scale, o_scale = quant.s.scale.clone(), quant.o.scale.clone()  # the autocast's exit updates the state's scales
        o8, stats, amax_s, amax_o = ops.fused_attn_fp8_fwd(q8.data, k8.data, v8.data, qkv_scale_inv=q8.scale_inv, s_scale=s_scale,
                                                            o_scale=o_scale, config=config)
        quant.s.record(amax_s)
        quant.o.record(amax_o)
        o_scale_inv = torch.reciprocal(o_scale)
        ctx.save_for_backward(q8.data, k8.data, v8.data, o8, stats, q8.scale_inv, o_scale_inv, s_scale)
        ctx.quant, ctx.config, ctx.dtypes = quant, config, (q.dtype, k.dtype, v.dtype)
        return ops.dequantize(o8, o_scale_inv, q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q8, k8, v8, o8, stats, qkv_scale_inv, o_scale_inv, s_scale = ctx.saved_tensors
        quant = ctx.quant
        do8 = quant.do.quantize(dout)
        dqkv_scale = quant.dqkv.scale  # read before the update at the end of backward rewrites it
        dq8, dk8, dv8, amax_dqkv, amax_dp = ops.fused_attn_fp8_bwd(
            do8.data, q8, k8, v8, o8, stats, qkv_scale_inv=qkv_scale_inv, out_scale_inv=o_scale_inv, dout_scale_inv=do8.scale_inv,
            s_scale=s_scale, dp_scale=quant.dp.scale, dqkv_scale=dqkv_scale, config=ctx.config)
        quant.dp.record(amax_dp)
        quant.dqkv.record(amax_dqkv)
        descale = torch.reciprocal(dqkv_scale)
        grads = [ops.dequantize(g, descale, dtype) for g, dtype in zip((dq8, dk8, dv8), ctx.dtypes)]
        if quant.backward_update is not None:
            quant.backward_update([])
        return (*grads, None, None)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant: _Quantizers, config: AttentionConfig) -> torch.Tensor:
    """O [b, s_q, h, d] in q's dtype: FP8 attention of high-precision "bshd" q, k, v.

    Raises:
        NotImplementedError: a setting FP8 attention does not implement (named), checked before any work.
    """
    error = fp8_attention_error(q, k, v, config)
    if error:
        raise NotImplementedError(f"DotProductAttention under fp8_dpa=True: {error}; set fp8_dpa=False for this module's calls")
    return _FP8AttentionFunction.apply(q, k, v, quant, config)
