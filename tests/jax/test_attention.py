"""fused_attn (pure JAX) against a float64 NumPy attention, over masks, biases, softmax types, layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVLayout,
    SequenceDescriptor,
    _xla_attention,
    canonicalize_attn_mask_type,
    cudnn_gap,
    fused_attn,
)

from ._utils import assert_allclose, randn

B, SQ, SKV, HQ, HKV, D = 2, 5, 7, 4, 2, 8
SCALE = D**-0.5


def _np_attention(q, k, v, mask=None, bias=None, bias_type="none", softmax="vanilla", offset=None):
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    bias = None if bias is None else np.asarray(bias, np.float64)
    z = {"none": lambda: SCALE * s, "pre": lambda: SCALE * (s + bias), "post": lambda: SCALE * s + bias}[bias_type]()
    if mask is not None:
        z = np.where(mask, -1e30, z)
    extra = {"vanilla": -np.inf, "off_by_one": 0.0}.get(softmax)
    extra = np.broadcast_to(np.asarray(offset, np.float64) if extra is None else extra, z.shape[:-1] + (1,))
    m = np.maximum(z.max(-1, keepdims=True), extra)
    e = np.exp(z - m)
    p = e / (e.sum(-1, keepdims=True) + np.exp(extra - m))
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _qkv():
    return randn(1, (B, SQ, HQ, D)), randn(2, (B, SKV, HKV, D)), randn(3, (B, SKV, HKV, D))


def _run(qkv, bias=None, descriptor=None, bias_type=AttnBiasType.NO_BIAS, mask_type=AttnMaskType.NO_MASK,
         layout=QKVLayout.BSHD_BSHD_BSHD, softmax=AttnSoftmaxType.VANILLA_SOFTMAX, window=None, offset=None):
    fn = jax.jit(lambda qkv, bias, descriptor, offset: fused_attn(
        qkv, bias, descriptor, None, bias_type, mask_type, layout, softmax, SCALE, 0.0, is_training=False,
        window_size=window, softmax_offset=offset))
    return fn(qkv, bias, descriptor, offset)


def _padding(q_len, kv_len):
    valid = (np.arange(SQ)[None, :, None] < np.asarray(q_len)[:, None, None]) & (
        np.arange(SKV)[None, None, :] < np.asarray(kv_len)[:, None, None])
    return ~valid[:, None]


CAUSAL_TL = np.arange(SKV)[None, :] > np.arange(SQ)[:, None]
CAUSAL_BR = np.arange(SKV)[None, :] > np.arange(SQ)[:, None] + (SKV - SQ)


@pytest.mark.parametrize("mask_name", ["no_mask", "padding", "causal", "padding_causal_bottom_right"])
def test_masks_with_gqa(mask_name):
    q, k, v = _qkv()
    q_len, kv_len = np.array([5, 3]), np.array([7, 4])
    mask_type = canonicalize_attn_mask_type(mask_name)
    mask = np.zeros((B, 1, SQ, SKV), bool)
    if mask_type.is_padding():
        mask |= _padding(q_len, kv_len)
    if mask_type.is_causal():
        mask |= CAUSAL_BR if mask_type.is_bottom_right() else CAUSAL_TL
    descriptor = SequenceDescriptor.from_seqlens((q_len, kv_len))
    got = _run((q, k, v), descriptor=descriptor, mask_type=mask_type)
    assert_allclose(got, _np_attention(q, k, v, mask), jnp.float32)
    if mask_type.is_padding():  # the same padding given as a [b, 1, sq, skv] mask array (1 = masked)
        legacy = _run((q, k, v), descriptor=jnp.asarray(_padding(q_len, kv_len)), mask_type=mask_type)
        np.testing.assert_allclose(np.asarray(legacy), np.asarray(got), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias_type,name", [(AttnBiasType.PRE_SCALE_BIAS, "pre"), (AttnBiasType.POST_SCALE_BIAS, "post")])
def test_bias_types(bias_type, name):
    q, k, v = _qkv()
    bias = randn(4, (1, HQ, SQ, SKV))
    got = _run((q, k, v), bias=bias, bias_type=bias_type, mask_type=AttnMaskType.CAUSAL_MASK)
    assert_allclose(got, _np_attention(q, k, v, CAUSAL_TL, bias, name), jnp.float32)


@pytest.mark.parametrize("softmax,name", [(AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, "off_by_one"),
                                          (AttnSoftmaxType.LEARNABLE_SOFTMAX, "learnable")])
def test_softmax_types(softmax, name):
    q, k, v = _qkv()
    offset = randn(5, (1, HQ, 1, 1))
    got = _run((q, k, v), softmax=softmax, offset=offset if name == "learnable" else None)
    assert_allclose(got, _np_attention(q, k, v, None, softmax=name, offset=offset), jnp.float32)


def test_packed_layouts_and_window_bf16():
    q = randn(1, (B, SKV, HQ, D), jnp.bfloat16)
    k, v = randn(2, (B, SKV, HQ, D), jnp.bfloat16), randn(3, (B, SKV, HQ, D), jnp.bfloat16)
    window = (2, 0)
    win = (np.arange(SKV)[None, :] < np.arange(SKV)[:, None] - 2) | (np.arange(SKV)[None, :] > np.arange(SKV)[:, None])
    expected = _np_attention(q, k, v, win)
    packed = jnp.stack([q, k, v], axis=2)
    kv_packed = jnp.stack([k, v], axis=2)
    for layout, qkv in ((QKVLayout.BS3HD, (packed,)), (QKVLayout.BSHD_BS2HD, (q, kv_packed)),
                        (QKVLayout.BSHD_BSHD_BSHD, (q, k, v))):
        got = _run(qkv, layout=layout, window=window)
        assert got.dtype == jnp.bfloat16
        assert_allclose(got, expected, jnp.bfloat16)


def test_thd_segments_equal_separate_sequences():
    """Two packed sequences per row (segment ids, 0 = padding) == each sequence attended alone."""
    s = 8
    q, k, v = (randn(i, (1, s, 2, D)) for i in (1, 2, 3))
    ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(ids)
    got = _run((q, k, v), descriptor=descriptor, mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
               layout=QKVLayout.THD_THD_THD)
    for lo, hi in ((0, 3), (3, 7)):
        causal = np.arange(hi - lo)[None, :] > np.arange(hi - lo)[:, None]
        want = _np_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], causal)
        assert_allclose(got[:, lo:hi], want, jnp.float32)


def test_dropout_and_errors():
    q, k, v = _qkv()
    seed = jax.random.PRNGKey(7)
    run = jax.jit(lambda qkv, seed, training: fused_attn(
        qkv, None, None, seed, AttnBiasType.NO_BIAS, AttnMaskType.NO_MASK, QKVLayout.BSHD_BSHD_BSHD,
        AttnSoftmaxType.VANILLA_SOFTMAX, SCALE, 0.5, training), static_argnums=2)
    assert_allclose(run((q, k, v), seed, training=False), _np_attention(q, k, v), jnp.float32)
    dropped = np.asarray(run((q, k, v), seed, training=True))
    assert np.all(np.isfinite(dropped)) and not np.allclose(dropped, _np_attention(q, k, v), atol=1e-3)
    args = (None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.NO_MASK, QKVLayout.BSHD_BSHD_BSHD,
            AttnSoftmaxType.VANILLA_SOFTMAX, SCALE)
    with pytest.raises(ValueError, match="PRNG key"):
        fused_attn((q, k, v), *args, 0.1, is_training=True)
    with pytest.raises(ValueError, match=r"must be \(b, s, h, d\)"):
        fused_attn((q, k[:, :, :, :4], v), *args, 0.0, is_training=False)
    with pytest.raises(ValueError, match="needs a sequence_descriptor"):
        fused_attn((q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.PADDING_MASK,
                   QKVLayout.BSHD_BSHD_BSHD, AttnSoftmaxType.VANILLA_SOFTMAX, SCALE, 0.0, is_training=False)
    with pytest.raises(ValueError, match="unknown AttnMaskType"):
        canonicalize_attn_mask_type("diagonal")


def _shaped(shape_q, shape_kv, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape_q, dtype), jax.ShapeDtypeStruct(shape_kv, dtype), jax.ShapeDtypeStruct(shape_kv, dtype)


_NONE, _CAUSAL = AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK


@pytest.mark.parametrize("shapes, mask, window, dropout, reason", [
    (((2, 64, 8, 64), (2, 64, 2, 64)), _CAUSAL, None, 0.0, None),  # GQA, causal, square
    (((2, 64, 8, 128), (2, 96, 8, 128)), _NONE, (-1, -1), 0.0, None),
    (((2, 64, 8, 64), (2, 64, 8, 64)), AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, (-1, 0), 0.0, None),
    (((2, 64, 8, 64), (2, 96, 8, 64)), _CAUSAL, None, 0.0, "square problems"),
    (((2, 64, 8, 64), (2, 64, 8, 64)), _CAUSAL, None, 0.1, "dropout 0.1"),
    (((2, 64, 8, 64), (2, 64, 8, 64)), _NONE, (8, 8), 0.0, "window_size=(8, 8)"),
    (((2, 64, 8, 64), (2, 64, 8, 64)), AttnMaskType.PADDING_CAUSAL_MASK, None, 0.0, "padded query rows"),
    (((2, 64, 8, 256), (2, 64, 8, 256)), _NONE, None, 0.0, "head sizes 256"),
    (((2, 64, 8, 60), (2, 64, 8, 60)), _NONE, None, 0.0, "head sizes 60"),
])
def test_cudnn_gap_names_the_calls_cudnn_does_not_run(shapes, mask, window, dropout, reason):
    q, k, v = _shaped(*shapes)
    args = (AttnBiasType.NO_BIAS, mask, QKVLayout.BSHD_BSHD_BSHD, AttnSoftmaxType.VANILLA_SOFTMAX, dropout, window)
    gap = cudnn_gap(q, k, v, *args, backend="gpu")
    assert gap is None if reason is None else reason in gap
    assert "cpu backend" in cudnn_gap(q, k, v, *args, backend="cpu")


@pytest.mark.parametrize("dtype, bias_type, softmax, layout, reason", [
    (jnp.float32, AttnBiasType.NO_BIAS, AttnSoftmaxType.VANILLA_SOFTMAX, QKVLayout.BSHD_BSHD_BSHD, "dtypes"),
    (jnp.bfloat16, AttnBiasType.POST_SCALE_BIAS, AttnSoftmaxType.VANILLA_SOFTMAX, QKVLayout.BSHD_BSHD_BSHD, "POST_SCALE_BIAS"),
    (jnp.bfloat16, AttnBiasType.NO_BIAS, AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, QKVLayout.BSHD_BSHD_BSHD, "OFF_BY_ONE"),
    (jnp.bfloat16, AttnBiasType.NO_BIAS, AttnSoftmaxType.VANILLA_SOFTMAX, QKVLayout.THD_THD_THD, "THD"),
])
def test_cudnn_gap_other_settings(dtype, bias_type, softmax, layout, reason):
    q, k, v = _shaped((2, 64, 8, 64), (2, 64, 8, 64), dtype)
    assert reason in cudnn_gap(q, k, v, bias_type, _NONE, layout, softmax, 0.0, None, backend="gpu")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a GPU")
@pytest.mark.parametrize("mask", [_NONE, _CAUSAL])
def test_cudnn_path_equals_the_einsum_path(mask):
    """On a GPU an eligible call compiles to cuDNN's fused attention (a cuDNN custom call in the HLO) and agrees with
    the einsum path, forward and gradients, to bf16 tolerance; the einsum path computes in float32 (the reference)."""
    b, s, hq, hkv, d = 2, 256, 8, 2, 64
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, s, h, d), jnp.bfloat16) for i, h in ((1, hq), (2, hkv), (3, hkv)))
    dy = jax.random.normal(jax.random.PRNGKey(4), (b, s, hq, d), jnp.bfloat16)
    scale = d**-0.5
    args = (AttnBiasType.NO_BIAS, mask, QKVLayout.BSHD_BSHD_BSHD, AttnSoftmaxType.VANILLA_SOFTMAX)

    def fused(q, k, v):
        return fused_attn((q, k, v), None, None, None, *args, scale, 0.0, is_training=True)

    def einsum(q, k, v):
        return _xla_attention(q, k, v, None, None, None, *args, scale, 0.0, None, None)

    assert cudnn_gap(q, k, v, *args, 0.0, None) is None
    assert "cudnn" in jax.jit(fused).lower(q, k, v).compile().as_text().lower()
    for f in (fused, einsum):
        out, vjp = jax.vjp(f, q, k, v)
        if f is fused:
            got = (out, *vjp(dy))
        else:
            want = (out, *vjp(dy))
    for g, w in zip(got, want):
        assert_allclose(g, w, jnp.bfloat16)
