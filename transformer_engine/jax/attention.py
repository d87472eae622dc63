"""Dot-product attention in plain JAX (einsum + float32 softmax), with TE's enums and layouts.

For q (b, sq, hq, d), k (b, skv, hkv, d), v (b, skv, hkv, dv) and hq = g * hkv (query head i uses
kv head i // g):

    s   = q k^T                                    (float32 accumulation)
    z   = scale * s                 NO_BIAS
          scale * (s + bias)        PRE_SCALE_BIAS
          scale * s + bias          POST_SCALE_BIAS
    z   = lowest float32 where masked (mask = 1 / True means masked out)
    p   = exp(z - m) / (sum exp(z - m) + extra)    extra = 0 (VANILLA), exp(0 - m) (OFF_BY_ONE),
                                                   exp(alpha_h - m) (LEARNABLE, alpha = softmax_offset)
    out = dropout(p) v

Masks: PADDING from a [b, 1, sq, skv] mask or a :class:`SequenceDescriptor`; CAUSAL keeps key j <= i
(top-left), the BOTTOM_RIGHT variants keep j <= i + skv - sq; ``window_size=(left, right)`` keeps
i - left <= j <= i + right (-1 = unbounded). THD layouts hold several sequences per row, told apart by
segment ids (0 = padding) with positions for the causal and window masks. Gradients by autodiff.

On a GPU, a call that cuDNN's fused attention expresses runs there instead (``jax.nn.dot_product_attention`` with
``implementation="cudnn"``, forward and backward; see :func:`cudnn_gap` for which calls): bf16 / fp16 BSHD tensors
of one head size (a multiple of 8, at most 128), no bias, no padding or window, a vanilla softmax, unmasked or causal
on a square problem (where top-left and bottom-right agree), and no dropout (cuDNN's JAX path takes its dropout seed as a
compile-time constant, which would repeat one mask every step). Everything else runs the einsum path above.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "AttnBiasType",
    "AttnMaskType",
    "AttnSoftmaxType",
    "QKVLayout",
    "QKVFormat",
    "CPStrategy",
    "SequenceDescriptor",
    "canonicalize_attn_mask_type",
    "canonicalize_attn_bias_type",
    "canonicalize_softmax_type",
    "canonicalize_qkv_layout",
    "cudnn_gap",
    "fused_attn",
]

_MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


class AttnBiasType(Enum):
    """NO_BIAS: softmax(scale*qk); PRE_SCALE_BIAS: softmax(scale*(qk+bias)); POST_SCALE_BIAS: softmax(scale*qk+bias)."""

    NO_BIAS = 0
    PRE_SCALE_BIAS = 1
    POST_SCALE_BIAS = 2


class AttnMaskType(Enum):
    """Which positions attention may not see (padding, causal top-left or bottom-right, both)."""

    NO_MASK = 0
    PADDING_MASK = 1
    CAUSAL_MASK = 2
    PADDING_CAUSAL_MASK = 3
    CAUSAL_BOTTOM_RIGHT_MASK = 4
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5

    def is_padding(self) -> bool:
        """True for the types that apply the padding mask."""
        return self in (AttnMaskType.PADDING_MASK, AttnMaskType.PADDING_CAUSAL_MASK,
                        AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK)

    def is_causal(self) -> bool:
        """True for the types that apply a causal mask."""
        return self not in (AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK)

    def is_bottom_right(self) -> bool:
        """True when the causal diagonal is aligned to the bottom-right corner."""
        return self in (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK)


class AttnSoftmaxType(Enum):
    """VANILLA; OFF_BY_ONE adds 1 to the denominator; LEARNABLE adds exp(alpha_h) per head."""

    VANILLA_SOFTMAX = 0
    OFF_BY_ONE_SOFTMAX = 1
    LEARNABLE_SOFTMAX = 2


class QKVFormat(Enum):
    """Axis order of q, k, v."""

    SBHD = 0
    BSHD = 1
    THD = 2


class QKVLayout(Enum):
    """How q, k, v are passed: packed (3 on axis 2), kv packed (2 on axis 2), or separate."""

    BS3HD = 0
    BSHD_BS2HD = 1
    BSHD_BSHD_BSHD = 2
    T3HD = 3
    THD_T2HD = 4
    THD_THD_THD = 5

    def get_qkv_format(self) -> QKVFormat:
        """BSHD for the BS* layouts, THD for the T* layouts."""
        return QKVFormat.THD if self.is_thd() else QKVFormat.BSHD

    def is_thd(self) -> bool:
        """True for the packed-sequence (THD) layouts."""
        return self in (QKVLayout.T3HD, QKVLayout.THD_T2HD, QKVLayout.THD_THD_THD)

    def n_tensors(self) -> int:
        """Number of arrays in the qkv tuple: 1 (qkv packed), 2 (kv packed) or 3."""
        return {QKVLayout.BS3HD: 1, QKVLayout.T3HD: 1, QKVLayout.BSHD_BS2HD: 2, QKVLayout.THD_T2HD: 2}.get(self, 3)


class CPStrategy(Enum):
    """Context-parallel strategy; only DEFAULT (no context parallelism) is implemented."""

    DEFAULT = 0
    ALL_GATHER = 1
    RING = 2


def _canonicalize(enum_cls, value, names: dict):
    if isinstance(value, enum_cls):
        return value
    key = str(value).lower().replace("-", "_")
    if key not in names:
        raise ValueError(f"unknown {enum_cls.__name__} {value!r}: choose one of {sorted(names)}")
    return names[key]


def canonicalize_attn_mask_type(attn_mask_type) -> AttnMaskType:
    """'no_mask', 'padding', 'causal', 'padding_causal' (= 'causal_padding'), '..._bottom_right'."""
    m = AttnMaskType
    names = {"no_mask": m.NO_MASK, "padding": m.PADDING_MASK, "causal": m.CAUSAL_MASK,
             "padding_causal": m.PADDING_CAUSAL_MASK, "causal_padding": m.PADDING_CAUSAL_MASK,
             "causal_bottom_right": m.CAUSAL_BOTTOM_RIGHT_MASK,
             "padding_causal_bottom_right": m.PADDING_CAUSAL_BOTTOM_RIGHT_MASK}
    return _canonicalize(AttnMaskType, attn_mask_type, names)


def canonicalize_attn_bias_type(attn_bias_type) -> AttnBiasType:
    """'no_bias', 'pre_scale_bias', 'post_scale_bias'."""
    names = {t.name.lower(): t for t in AttnBiasType}
    return _canonicalize(AttnBiasType, attn_bias_type, names)


def canonicalize_softmax_type(softmax_type) -> AttnSoftmaxType:
    """'vanilla', 'off_by_one' (or 'off-by-one'), 'learnable'."""
    names = {"vanilla": AttnSoftmaxType.VANILLA_SOFTMAX, "off_by_one": AttnSoftmaxType.OFF_BY_ONE_SOFTMAX,
             "learnable": AttnSoftmaxType.LEARNABLE_SOFTMAX}
    return _canonicalize(AttnSoftmaxType, softmax_type, names)


def canonicalize_qkv_layout(qkv_layout) -> QKVLayout:
    """'bs3hd', 'bshd_bs2hd', 'bshd_bshd_bshd', 't3hd', 'thd_t2hd', 'thd_thd_thd' (any case)."""
    names = {t.name.lower(): t for t in QKVLayout}
    return _canonicalize(QKVLayout, qkv_layout, names)


@jax.tree_util.register_pytree_node_class
@dataclass
class SequenceDescriptor:
    """Which tokens belong to which sequence, for the padding / THD masks.

    Either ``seqlens`` = (q_seqlens, kv_seqlens), each (b,) int: valid tokens per row, padding at
    the end; or ``segment_ids`` = (q_ids, kv_ids), each (b, s) int with 0 = padding, plus
    ``segment_pos`` = (q_pos, kv_pos), each (b, s): the position of each token in its sequence.
    """

    seqlens: Optional[Tuple[jax.Array, jax.Array]] = None
    segment_ids: Optional[Tuple[jax.Array, jax.Array]] = None
    segment_pos: Optional[Tuple[jax.Array, jax.Array]] = None

    def tree_flatten(self):
        return (self.seqlens, self.segment_ids, self.segment_pos), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @classmethod
    def from_seqlens(cls, seqlens) -> "SequenceDescriptor":
        """From valid lengths: one (b,) array (same for q and kv) or a pair (q_seqlens, kv_seqlens)."""
        pair = tuple(seqlens) if isinstance(seqlens, (tuple, list)) else (seqlens, seqlens)
        return cls(seqlens=tuple(jnp.asarray(s, jnp.int32) for s in pair))

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None) -> "SequenceDescriptor":
        """From segment ids (b, s) (0 = padding) and optional positions (default: derived from the ids)."""
        ids = tuple(segment_ids) if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        ids = tuple(jnp.asarray(i, jnp.int32) for i in ids)
        if segment_pos is None:
            pos = tuple(_positions_from_ids(i) for i in ids)
        else:
            pos = tuple(segment_pos) if isinstance(segment_pos, (tuple, list)) else (segment_pos, segment_pos)
        return cls(segment_ids=ids, segment_pos=tuple(jnp.asarray(p, jnp.int32) for p in pos))


def _positions_from_ids(ids: jax.Array) -> jax.Array:
    """Position of each token inside its run of equal segment ids: [1,1,2,2,2] -> [0,1,0,1,2]."""
    idx = jnp.arange(ids.shape[-1])
    starts = jnp.concatenate([jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
    run_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=ids.ndim - 1)
    return idx - run_start


def _unpack_qkv(qkv, layout: QKVLayout):
    if not isinstance(qkv, (tuple, list)) or len(qkv) != layout.n_tensors():
        raise ValueError(f"fused_attn: {layout.name} takes a tuple of {layout.n_tensors()} arrays as qkv")
    if layout.n_tensors() == 1:
        return tuple(jnp.take(qkv[0], i, axis=-3) for i in range(3))
    if layout.n_tensors() == 2:
        return (qkv[0],) + tuple(jnp.take(qkv[1], i, axis=-3) for i in range(2))
    return tuple(qkv)


def _check_shapes(q, k, v) -> None:
    ok = (q.ndim == k.ndim == v.ndim == 4 and q.shape[0] == k.shape[0] == v.shape[0]
          and k.shape[:3] == v.shape[:3] and q.shape[-1] == k.shape[-1] and q.shape[2] % k.shape[2] == 0)
    if not ok:
        raise ValueError(
            f"fused_attn: q{q.shape}, k{k.shape}, v{v.shape} must be (b, s, h, d) with equal batch, "
            "k and v of equal (b, s, h), equal q/k head dim and q heads a multiple of kv heads"
        )


def _position_ids(desc, b: int, sq: int, skv: int):
    if desc is not None and desc.segment_pos is not None:
        return desc.segment_pos[0][:, :, None], desc.segment_pos[1][:, None, :]
    return jnp.arange(sq)[None, :, None], jnp.arange(skv)[None, None, :]


def _padding_mask(desc, b: int, sq: int, skv: int) -> Optional[jax.Array]:
    """(b, 1, sq, skv) bool, True = masked, from a SequenceDescriptor or a mask array."""
    if desc is None:
        return None
    if not isinstance(desc, SequenceDescriptor):
        return jnp.asarray(desc).astype(bool)
    if desc.segment_ids is not None:
        q_ids, kv_ids = desc.segment_ids
        same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] != 0)
        return ~same[:, None]
    q_len, kv_len = desc.seqlens
    valid = (jnp.arange(sq)[None, :, None] < q_len[:, None, None]) & (jnp.arange(skv)[None, None, :] < kv_len[:, None, None])
    return ~valid[:, None]


def _build_mask(desc, mask_type: AttnMaskType, layout: QKVLayout, shape, window_size) -> Optional[jax.Array]:
    b, sq, skv = shape
    mask = _padding_mask(desc, b, sq, skv) if (mask_type.is_padding() or layout.is_thd()) else None
    q_pos, kv_pos = _position_ids(desc if layout.is_thd() else None, b, sq, skv)
    offset = skv - sq if mask_type.is_bottom_right() else 0
    extra = []
    if mask_type.is_causal():
        extra.append(kv_pos > q_pos + offset)
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            extra.append(kv_pos < q_pos + offset - left)
        if right >= 0:
            extra.append(kv_pos > q_pos + offset + right)
    for m in extra:
        m = m[:, None] if m.ndim == 3 else m
        mask = m if mask is None else (mask | m)
    return mask


def _softmax(z: jax.Array, softmax_type: AttnSoftmaxType, softmax_offset) -> jax.Array:
    """p = exp(z - m) / (sum exp(z - m) + exp(extra - m)); extra = -inf, 0, or alpha_h."""
    if softmax_type == AttnSoftmaxType.VANILLA_SOFTMAX:
        return jax.nn.softmax(z, axis=-1)
    if softmax_type == AttnSoftmaxType.LEARNABLE_SOFTMAX:
        if softmax_offset is None:
            raise ValueError("fused_attn: LEARNABLE_SOFTMAX needs softmax_offset of shape (1, h, 1, 1)")
        extra = jnp.broadcast_to(jnp.asarray(softmax_offset, jnp.float32), z.shape[:-1] + (1,))
    else:
        extra = jnp.zeros(z.shape[:-1] + (1,), jnp.float32)
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(z, axis=-1, keepdims=True), extra))
    e = jnp.exp(z - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(extra - m))


def _logits(q, k, bias, bias_type: AttnBiasType, scale: float) -> jax.Array:
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    grouped = q.reshape(b, sq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k, preferred_element_type=jnp.float32)
    s = s.reshape(b, hq, sq, k.shape[1])
    if bias_type == AttnBiasType.PRE_SCALE_BIAS:
        return scale * (s + bias.astype(jnp.float32))
    if bias_type == AttnBiasType.POST_SCALE_BIAS:
        return scale * s + bias.astype(jnp.float32)
    return scale * s


def _check_options(bias, bias_type, dropout_probability, is_training, seed, cp) -> None:
    if (bias is None) != (bias_type == AttnBiasType.NO_BIAS):
        raise ValueError(f"fused_attn: attn_bias_type={bias_type.name} but bias is {'None' if bias is None else 'given'}")
    if not 0.0 <= dropout_probability < 1.0:
        raise ValueError(f"fused_attn: dropout_probability must be in [0, 1), got {dropout_probability}")
    if is_training and dropout_probability > 0.0 and seed is None:
        raise ValueError("fused_attn: dropout needs a PRNG key as seed (e.g. jax.random.PRNGKey(0))")
    strategy, load_balanced, axis, stripe = cp
    if CPStrategy(strategy) != CPStrategy.DEFAULT or load_balanced or axis or stripe is not None:
        raise NotImplementedError("fused_attn: context parallelism is not implemented; use the defaults")


def fused_attn(
    qkv: tuple,
    bias: Optional[jax.Array],
    sequence_descriptor: Union[None, SequenceDescriptor, jax.Array],
    seed: Optional[jax.Array],
    attn_bias_type: AttnBiasType,
    attn_mask_type: AttnMaskType,
    qkv_layout: QKVLayout,
    softmax_type: AttnSoftmaxType,
    scaling_factor: float,
    dropout_probability: float,
    is_training: bool,
    max_segments_per_seq: int = 1,
    window_size: Optional[Tuple[int, int]] = None,
    context_parallel_strategy: CPStrategy = CPStrategy.DEFAULT,
    context_parallel_causal_load_balanced: bool = False,
    context_parallel_axis: str = "",
    context_checkpoint_name: str = "context",
    softmax_offset: Optional[jax.Array] = None,
    stripe_size: Optional[int] = None,
) -> jax.Array:
    """Attention over (b, s, h, d) tensors, see the module docstring for the math.

    Args:
        qkv: ``(qkv_packed,)``, ``(q, kv_packed)`` or ``(q, k, v)`` as the layout says.
        bias: (1 or b, h, sq, skv) or None. sequence_descriptor: a :class:`SequenceDescriptor`,
            a [b, 1, sq, skv] mask (1 = masked out), or None.
        seed: a PRNG key for dropout. scaling_factor: the softmax scale (usually 1/sqrt(d)).
        max_segments_per_seq: accepted for compatibility (any number of segments works).
        window_size: (left, right) sliding window, -1 = unbounded.
        context_parallel_*: must keep their defaults. softmax_offset: alpha (1, h, 1, 1) for LEARNABLE.
        context_checkpoint_name: ``checkpoint_name`` of the output.

    Returns:
        (b, sq, hq, dv) in q's dtype.

    Raises:
        ValueError: inconsistent shapes, bias, dropout or mask inputs.
        NotImplementedError: context parallelism.
    """
    del max_segments_per_seq
    layout = canonicalize_qkv_layout(qkv_layout)
    mask_type = canonicalize_attn_mask_type(attn_mask_type)
    bias_type = canonicalize_attn_bias_type(attn_bias_type)
    softmax_type = canonicalize_softmax_type(softmax_type)
    q, k, v = _unpack_qkv(qkv, layout)
    _check_shapes(q, k, v)
    _check_options(bias, bias_type, dropout_probability, is_training, seed,
                   (context_parallel_strategy, context_parallel_causal_load_balanced, context_parallel_axis, stripe_size))
    if (mask_type.is_padding() or layout.is_thd()) and sequence_descriptor is None:
        raise ValueError(f"fused_attn: {mask_type.name} with {layout.name} needs a sequence_descriptor or mask")
    dropout = dropout_probability if is_training else 0.0
    if cudnn_gap(q, k, v, bias_type=bias_type, mask_type=mask_type, layout=layout, softmax_type=softmax_type, dropout=dropout,
                 window_size=window_size) is None:
        out = jax.nn.dot_product_attention(q, k, v, scale=scaling_factor, is_causal=mask_type.is_causal(), implementation="cudnn")
    else:
        out = _xla_attention(q, k, v, bias=bias, sequence_descriptor=sequence_descriptor, seed=seed, bias_type=bias_type,
                             mask_type=mask_type, layout=layout, softmax_type=softmax_type, scaling_factor=scaling_factor,
                             dropout=dropout, window_size=window_size, softmax_offset=softmax_offset)
    return checkpoint_name(out, context_checkpoint_name)


def cudnn_gap(q, k, v, bias_type: AttnBiasType, mask_type: AttnMaskType, layout: QKVLayout, softmax_type: AttnSoftmaxType,
              dropout: float, window_size: Optional[Tuple[int, int]], backend: Optional[str] = None) -> Optional[str]:
    """Why :func:`fused_attn` does not run this call on cuDNN's fused attention, or None when it does.

    ``q``, ``k``, ``v`` are (b, s, h, d) (only shapes and dtypes are read); ``dropout`` is the probability applied in
    this call (0 outside training); ``backend`` is the platform JAX compiles for (default ``jax.default_backend()``).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend not in ("gpu", "cuda"):
        return f"the {backend} backend has no cuDNN"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (cuDNN: bfloat16 or float16, all alike)"
    d = q.shape[-1]
    if v.shape[-1] != d or d % 8 or d > 128:
        return f"head sizes {d} / {v.shape[-1]} (cuDNN here: equal, a multiple of 8, at most 128)"
    if layout.is_thd():
        return "packed (THD) sequences"
    if bias_type != AttnBiasType.NO_BIAS or softmax_type != AttnSoftmaxType.VANILLA_SOFTMAX:
        return f"{bias_type.name} with {softmax_type.name}"
    if mask_type.is_padding():
        return f"{mask_type.name} (padded query rows: cuDNN writes 0 where this path writes the mean of v)"
    if mask_type.is_causal() and q.shape[1] != k.shape[1]:
        return f"{mask_type.name} with {q.shape[1]} queries and {k.shape[1]} keys (cuDNN's causal mask: square problems here)"
    unbounded = {(-1, -1), (-1, 0)} if mask_type.is_causal() else {(-1, -1)}  # (-1, 0) is the causal mask itself
    if window_size is not None and tuple(window_size) not in unbounded:
        return f"window_size={tuple(window_size)}"
    if dropout > 0.0:
        return f"dropout {dropout} (cuDNN's JAX path fixes its seed at compile time)"
    return None


def _xla_attention(q, k, v, bias, sequence_descriptor, seed, bias_type: AttnBiasType, mask_type: AttnMaskType,
                   layout: QKVLayout, softmax_type: AttnSoftmaxType, scaling_factor: float, dropout: float, window_size,
                   softmax_offset) -> jax.Array:
    """The einsum path of the module docstring: (b, sq, hq, dv) in q's dtype."""
    z = _logits(q, k, bias, bias_type, scaling_factor)
    mask = _build_mask(sequence_descriptor, mask_type, layout, (q.shape[0], q.shape[1], k.shape[1]), window_size)
    if mask is not None:
        z = jnp.where(mask, _MASKED_LOGIT, z)
    p = _softmax(z, softmax_type, softmax_offset)
    if dropout > 0.0:
        keep = jax.random.bernoulli(seed, 1.0 - dropout, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout), 0.0)
    b, hq, sq, skv = p.shape
    hkv = k.shape[2]
    p = p.reshape(b, hkv, hq // hkv, sq, skv).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, sq, hq, v.shape[-1]).astype(q.dtype)
