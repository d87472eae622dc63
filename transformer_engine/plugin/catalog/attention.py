"""Scaled dot-product attention, forward and backward, with TE's mask, window, bias and softmax variants.

Layouts (``AttentionConfig.qkv_format``):
- ``"bshd"``: q [b, s_q, h, d_qk], k [b, s_kv, h_kv, d_qk], v [b, s_kv, h_kv, d_v];
- ``"thd"``: packed sequences q [t_q, h, d_qk], k/v [t_kv, h_kv, d], with int32 ``cu_seqlens_q`` /
  ``cu_seqlens_kv`` of shape [b + 1] (sequence i is rows cu[i]:cu[i+1]).
h is a multiple of h_kv (GQA / MQA: query head n uses kv head n // (h / h_kv)). The output has q's
layout with d_v features.

For one sequence and head, with scores S = softmax_scale * Q K^T (s_q x s_kv):
- ``bias_type`` "pre_scale_bias": S = softmax_scale * (Q K^T + B); "post_scale_bias": S += B;
  "alibi": S += -slope_h * |i + s_kv - s_q - j| (``alibi_slopes`` [h] or [b, h]);
- masking sets S[i, j] = -inf where: ``attn_mask`` is True (broadcast to [b, h, s_q, s_kv]);
  ``mask_type`` "causal" and j > i; "causal_bottom_right" and j > i + s_kv - s_q;
  ``window_size`` (left, right) with left >= 0 and j < i + s_kv - s_q - left, or right >= 0 and
  j > i + s_kv - s_q + right (the window is bottom-right aligned; -1 means unbounded);
- P = softmax(S) with denominator sum_j exp(S_ij) (+ 1 for ``softmax_type`` "off-by-one",
  + exp(alpha_h) for "learnable", alpha = ``softmax_offset`` [h]); a fully masked row gives P = 0;
- dropout: P' = P * M / (1 - dropout_p) with M ~ Bernoulli(1 - dropout_p) from the device's
  default generator; O = P' V.
``fused_attn_fwd`` returns (O, ctx): ctx is opaque and backend-specific (e.g. the log-sum-exp and
the dropout state); ``fused_attn_bwd`` must run on the backend that produced ctx. Each implementation of
``fused_attn_bwd`` (and ``attention_block_bwd``) therefore declines, through its ``supports`` predicate, a ctx
its own forward did not make: a plain ``ops.fused_attn_bwd(...)`` call then reaches the implementation that made
the ctx whatever the policy's order (a declined call is passed on, also under ``TE_FL_STRICT=1``).

Layouts are checked the same way on every backend: :func:`attention_layout_error` (a reason, or None) and
:func:`check_attention_layout` (raises it as ValueError).

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): a zero batch gives empty results; NaN
and inf in q, k or v propagate as in the
float32 formula (a fully masked row stays 0); q, k, v and dout may have any strides.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import declare

__all__ = [
    "AttentionConfig",
    "attention_block_bwd",
    "attention_block_fwd",
    "attention_layout_error",
    "attention_max_logit",
    "check_attention_layout",
    "fused_attn_fwd",
    "fused_attn_bwd",
]

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
QKV_FORMATS = ("bshd", "thd")


@dataclass(frozen=True)
class AttentionConfig:
    """The non-tensor settings of one attention call (hashable, so backends can test it cheaply).

    Attributes:
        softmax_scale: multiplier of Q K^T (usually 1 / sqrt(d_qk)).
        mask_type: "no_mask", "causal" (top-left) or "causal_bottom_right"; padding and arbitrary
            masks are passed as ``attn_mask`` or, for "thd", through ``cu_seqlens``.
        window_size: (left, right) sliding window, -1 = unbounded.
        dropout_p: attention dropout probability (0 in eval).
        softmax_type: "vanilla", "off-by-one" or "learnable".
        bias_type: "no_bias", "pre_scale_bias", "post_scale_bias" or "alibi".
        qkv_format: "bshd" or "thd".
        max_seqlen_q, max_seqlen_kv: longest sequence for "thd" (0 = compute from cu_seqlens).
    """

    softmax_scale: float
    mask_type: str = "no_mask"
    window_size: Tuple[int, int] = (-1, -1)
    dropout_p: float = 0.0
    softmax_type: str = "vanilla"
    bias_type: str = "no_bias"
    qkv_format: str = "bshd"
    max_seqlen_q: int = 0
    max_seqlen_kv: int = 0

    def __post_init__(self):
        _check("mask_type", self.mask_type, MASK_TYPES)
        _check("softmax_type", self.softmax_type, SOFTMAX_TYPES)
        _check("bias_type", self.bias_type, BIAS_TYPES)
        _check("qkv_format", self.qkv_format, QKV_FORMATS)
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"dropout_p={self.dropout_p} must be in [0, 1)")
        left, right = self.window_size
        if left < -1 or right < -1:
            raise ValueError(f"window_size={self.window_size}: each side is -1 (unbounded) or >= 0")
        object.__setattr__(self, "window_size", (int(left), int(right)))

    @property
    def has_window(self) -> bool:
        """True when a sliding window limits the keys."""
        return self.window_size != (-1, -1)


def _check(name: str, value: str, allowed: Tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def attention_layout_error(q, k, v, config: AttentionConfig, cu_seqlens_q=None, cu_seqlens_kv=None) -> Optional[str]:
    """Why q, k, v (and the sequence offsets) do not have the layout of ``config.qkv_format``, or None.

    The rules of the module docstring, the same for every backend (a call that breaks one is an error
    everywhere, not a case for another backend): "bshd" q [b, s_q, h, d_qk], k [b, s_kv, h_kv, d_qk],
    v [b, s_kv, h_kv, d_v] and no ``cu_seqlens``; "thd" 3-D q, k, v and both ``cu_seqlens`` 1-D of one
    shape [b + 1]; h a multiple of h_kv. Reads only shapes (no torch import, no device sync).
    """
    thd = config.qkv_format == "thd"
    rank = 3 if thd else 4
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != rank or k.dim() != rank or v.dim() != rank:
        return f"qkv_format={config.qkv_format!r} needs {rank}-D q, k, v; got {shapes}"
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        return f"{shapes}: k and v need the same tokens and heads, and q and k the same head dim"
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads:
        return f"{shapes}: the query heads ({heads}) must be a multiple of the kv heads ({kv_heads})"
    if not thd:
        if q.shape[0] != k.shape[0]:
            return f"{shapes}: q and k need the same batch"
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            return "cu_seqlens_q / cu_seqlens_kv are for qkv_format='thd'; a padded bshd batch passes its padding as attn_mask"
        return None
    if cu_seqlens_q is None or cu_seqlens_kv is None or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_kv.shape:
        return "qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv, both int32 [b + 1]"
    return None


def check_attention_layout(q, k, v, config: AttentionConfig, cu_seqlens_q=None, cu_seqlens_kv=None) -> None:
    """Raise :func:`attention_layout_error`'s reason as a ValueError (nothing when the layout is right)."""
    error = attention_layout_error(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    if error:
        raise ValueError(error)


@declare
def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                   cu_seqlens_kv=None):
    """O = dropout(softmax(S)) V for the settings in ``config`` (see the module docstring).

    Returns: (out in q's layout and dtype with d_v features, ctx for ``fused_attn_bwd``).
    """


@declare
def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_kv=None):
    """Gradients of ``fused_attn_fwd`` given dO.

    With D_i = sum_j dO_i O_i: dP' = dO V^T, dS = P * (dP' * M / (1 - p) - D) (M the dropout mask),
    dQ = softmax_scale dS K, dK = softmax_scale dS^T Q, dV = P'^T dO (summed over the query heads
    of a kv group); dbias = dS reduced to attn_bias's shape (times softmax_scale for pre-scale);
    dalpha_h = -sum_i exp(alpha_h - lse_i) * D_i for "learnable".
    dout has out's shape and any strides (an sbhd layer passes a transposed view, not a copy).
    Returns: (dq, dk, dv, dbias or None, dsoftmax_offset or None).

    ``ctx`` is what some backend's ``fused_attn_fwd`` returned, and only that backend can read it: every
    implementation (in-tree or out-of-tree) must register a ``supports`` predicate that declines (returns a
    falsy value, e.g. ``Reject("ctx was not made by <backend> fused_attn_fwd")``) any ctx its own forward did
    not produce, e.g. by its type. Callers then just call ``ops.fused_attn_bwd``: the dispatcher passes a
    declined call to the next candidate (under any policy order, ``TE_FL_STRICT=1`` included), so it reaches
    the implementation that made the ctx. An implementation without such a predicate would be handed foreign
    contexts and fail on them.
    """


@declare
def attention_block_fwd(q, k, v, config, attn_mask=None, attn_bias=None):
    """One block of blockwise attention (a ring's step): this block's O and its log-sum-exp, to be merged.

    bshd only, vanilla softmax, bias_type "no_bias" or "post_scale_bias"; the mask, window and dropout
    of ``config`` as in ``fused_attn_fwd``. For each query row i of the block:
    lse_i = log sum_j exp S_ij over this block's keys (-inf when all are masked, where O_i = 0),
    O = dropout(P) V with P = exp(S - lse). Blocks of the same queries over disjoint keys merge exactly:
    lse = logaddexp(lse_1, lse_2), O = exp(lse_1 - lse) O_1 + exp(lse_2 - lse) O_2.
    Returns: (out bshd in q's dtype with v's head dim, lse float32 [b, h, s_q], ctx for
    ``attention_block_bwd``: opaque, backend-specific, e.g. the dropout state).
    """


@declare
def attention_block_bwd(dout, q, k, v, out, lse, ctx, config, attn_mask=None, attn_bias=None):
    """Gradients of one block of blockwise attention, given the merged (final) ``out`` and ``lse``.

    With out and lse the values after every block of these queries was merged (bshd in q's dtype,
    float32 [b, h, s_q]), P = exp(S - lse) (0 where lse = -inf), D_i = sum_d dO_id O_id,
    dP' = dO V^T, dS = P * (dP' * M / (1 - p) - D) (M the block's dropout mask),
    dQ = softmax_scale dS K, dK = softmax_scale dS^T Q, dV = (P M / (1 - p))^T dO (summed over a kv
    group), dB = dS summed to attn_bias's shape: this block's share of the whole attention's gradients
    (the ring sums them). With the block's own out and lse: ``fused_attn_bwd``'s gradients.
    Returns: (dq, dk, dv in their inputs' dtypes, dbias float32 in attn_bias's shape or None).
    As for ``fused_attn_bwd``, an implementation must decline (``supports``) a ctx its own forward did not make.
    """


@declare(traced=True)
def attention_max_logit(q, k, config, attn_mask=None, attn_bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None):
    """max_logit [h] float32: for each query head, the maximum of the scores S over the batch (every packed sequence
    for "thd") and the query and key positions, masked entries left out (S before the softmax, as in the module
    docstring; -inf for a head whose every score is masked or when there is none). What TE's
    ``DotProductAttention(return_max_logit=True)`` returns (Muon's QK-clip rescales W_Q and W_K with it).
    ``config``'s dropout and softmax type play no part.
    """
