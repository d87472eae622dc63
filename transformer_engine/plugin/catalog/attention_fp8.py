"""FP8 scaled dot-product attention, forward and backward, with per-tensor scales (NVIDIA TE's ``fp8_dpa``).

Q, K, V, O and their gradients travel in FP8; the products run in FP8 with float32 accumulation, the softmax in float32.
Layout "bshd" (see :mod:`.attention`): q [b, s_q, h, d], k and v [b, s_kv, h_kv, d] (h a multiple of h_kv), one head
size d for q, k and v. With dq, dk, dv the descales (scale_inv) of the FP8 operands and S = softmax_scale (Q dq)(K dk)^T,
masked as ``config.mask_type`` says ("no_mask", or "causal" top-left):

Forward, for each query row i: m_i = max_j S_ij, P_ij = exp(S_ij - m_i) (unnormalized, <= 1), l_i = sum_j P_ij,
    P8 = fp8(P * s_scale)                                     (q's FP8 dtype: the probabilities' cast)
    O_i = sum_j (P8_ij / s_scale) (V_j dv) / l_i,  O8 = fp8(O * o_scale),  stats_i = m_i + log l_i
    amax_s = max P (1 for any row with an unmasked key), amax_o = max |O|
Backward, with dO given as FP8 dO8 (descale ddo) and O as O8 (descale 1 / o_scale):
    P = exp(S - stats) (normalized), P8 = fp8(P * s_scale);  dV = (P8 / s_scale)^T dO
    dP = dO V^T,  D_i = sum_j dO_ij O_ij,  dS = P (dP - D),  dS8 = fp8(dS * dp_scale) (dO8's dtype)
    dQ = softmax_scale (dS8 / dp_scale) K,  dK = softmax_scale (dS8 / dp_scale)^T Q   (dK, dV summed over a kv group)
    dQ8, dK8, dV8 = fp8(. * dqkv_scale) in dO8's dtype;  amax_dqkv = max(|dQ|, |dK|, |dV|),  amax_dp = max |dS|
fp8() saturates to the dtype's range. Where a backend computes the rows in tiles (online softmax, as cuDNN does), P is
quantized relative to the running maximum, which changes P8's rounding: results agree with this math to FP8 accuracy,
not bit for bit. Dropout, biases, windows, padding masks, "thd" and other softmax types are not part of these ops
(:func:`fp8_attention_error` names them): the module refuses such calls under ``fp8_dpa`` rather than run them in high
precision. Like the other attention ops these are not annotated: under ``torch.compile`` a call ends the graph.
"""

from __future__ import annotations

from typing import Optional

from transformer_engine.plugin.core.catalog import declare

from .attention import AttentionConfig

__all__ = ["fp8_attention_error", "fused_attn_fp8_bwd", "fused_attn_fp8_fwd"]


def fp8_attention_error(q, k, v, config: AttentionConfig) -> Optional[str]:
    """Why the shapes of q, k, v and ``config`` are not a call of these ops (a reason naming the setting), or None.

    Reads only shapes and the config (no device work; the backends check the FP8 dtypes), so a module can ask it of
    its high-precision inputs before casting them."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if config.qkv_format != "bshd" or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"FP8 attention takes 4-D bshd q, k, v (qkv_format={config.qkv_format!r}; {shapes})"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        return f"{shapes}: FP8 attention needs one batch and one head size for q, k and v"
    if k.shape[1] == 0:
        return f"{shapes}: no keys"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return f"{shapes}: the query heads must be a multiple of the kv heads"
    if config.mask_type not in ("no_mask", "causal"):
        return f"mask_type={config.mask_type!r} (FP8 attention: no_mask or causal)"
    if config.mask_type == "causal" and q.shape[1] != k.shape[1]:
        return f"a causal mask with {q.shape[1]} queries and {k.shape[1]} keys (FP8 attention: square causal problems)"
    plain = {"dropout_p": 0.0, "window_size": (-1, -1), "bias_type": "no_bias", "softmax_type": "vanilla"}
    unsupported = [name for name, value in plain.items() if getattr(config, name) != value]
    if unsupported:
        return f"FP8 attention does not implement {', '.join(f'{n}={getattr(config, n)!r}' for n in unsupported)}"
    return None


@declare
def fused_attn_fp8_fwd(q, k, v, qkv_scale_inv, s_scale, o_scale, config):
    """O8 = fp8(softmax(S) V * o_scale) from FP8 q, k, v (see the module docstring for the math).

    Args: q, k, v: FP8 "bshd", one dtype; qkv_scale_inv: float32 one element, the descale shared by q, k and v;
    s_scale, o_scale: float32 one element; config: an :class:`AttentionConfig` that :func:`fp8_attention_error` accepts.
    Returns: (O8 [b, s_q, h, d] contiguous in q's dtype, stats float32 [b, h, s_q] (log-sum-exp of S per row),
    amax_s, amax_o: 0-d float32).
    """


@declare
def fused_attn_fp8_bwd(dout, q, k, v, out, stats, qkv_scale_inv, out_scale_inv, dout_scale_inv, s_scale, dp_scale, dqkv_scale, config):
    """dQ8, dK8, dV8 = fp8(gradients of ``fused_attn_fp8_fwd`` * dqkv_scale) given FP8 dO (module docstring's math).

    Args: dout: FP8 dO8 [b, s_q, h, d] (its dtype is the gradients'); q, k, v, out, stats: the forward's inputs, O8 and
    stats; qkv_scale_inv, out_scale_inv, dout_scale_inv: their descales; s_scale: the forward's; dp_scale, dqkv_scale:
    float32 one element each.
    Returns: (dQ8, dK8, dV8 in dout's dtype, contiguous, shaped as q, k, v; amax_dqkv, amax_dp: 0-d float32).
    """
