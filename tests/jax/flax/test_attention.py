"""te_flax.DotProductAttention and MultiHeadAttention against flax.linen attention; decode; rotary."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax.flax as te_flax
from transformer_engine.jax.flax._rotary import rotary_pos_emb

from .._utils import assert_allclose, jit_init, randn, unbox


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dot_product_attention_padding_matches_flax(dtype):
    b, s, h, d = 2, 6, 2, 8
    q, k, v = (randn(i, (b, s, h, d), dtype) for i in (1, 2, 3))
    lengths = np.array([6, 4])
    valid = np.arange(s)[None, :] < lengths[:, None]
    te_mask = jnp.asarray(~(valid[:, None, :, None] & valid[:, None, None, :]))  # 1 = masked out
    dpa = te_flax.DotProductAttention(head_dim=d, num_attention_heads=h, attn_mask_type="padding_causal",
                                      transpose_batch_sequence=False)
    got = jax.jit(lambda q, k, v, m: dpa.apply({}, q, k, v, m, deterministic=True))(q, k, v, te_mask)
    keep = (~np.asarray(te_mask)) & np.tril(np.ones((s, s), bool))
    want = nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                    mask=jnp.asarray(keep))
    rows = valid  # padded query rows are unspecified
    assert got.dtype == dtype
    assert_allclose(np.asarray(got, np.float32)[rows], np.asarray(want)[rows], dtype)


def test_dot_product_attention_transposed_and_learnable_softmax():
    s, b, h, d = 5, 2, 2, 4
    q, k, v = (randn(i, (s, b, h, d)) for i in (1, 2, 3))
    dpa = te_flax.DotProductAttention(head_dim=d, num_attention_heads=h, transpose_batch_sequence=True,
                                      attn_mask_type="no_mask", softmax_type="learnable")
    variables = jit_init(dpa, q, k, v, deterministic=True)
    assert variables["params"]["softmax_offset"].shape == (1, h, 1, 1)
    offset = jnp.full((1, h, 1, 1), -1e9)  # exp(alpha) ~ 0: the learnable softmax becomes the vanilla one
    got = dpa.apply({"params": {"softmax_offset": offset}}, q, k, v, deterministic=True)
    want = nn.dot_product_attention(*(jnp.swapaxes(t, 0, 1) for t in (q, k, v)))
    assert_allclose(got, jnp.swapaxes(want, 0, 1), jnp.float32)


class _RefMHA(nn.Module):
    """Pre-LN multi-head attention from flax.linen pieces (query/key/value kernels (hidden, h, d))."""

    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x, keep_mask):
        y = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
        proj = lambda name: nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name=name)(y)  # noqa: E731
        ctx = nn.dot_product_attention(proj("query"), proj("key"), proj("value"), mask=keep_mask)
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="out")(ctx)


def _ref_params(p, h, d):
    hidden = p["qkv"]["kernel"].shape[0]
    qkv = p["qkv"]["kernel"].reshape(hidden, 3, h, d)
    return {"ln": {"scale": p["qkv"]["scale"], "bias": p["qkv"]["ln_bias"]},
            **{n: {"kernel": qkv[:, i]} for i, n in enumerate(("query", "key", "value"))},
            "out": {"kernel": p["out"]["kernel"].reshape(h, d, hidden)}}


def test_multi_head_attention_matches_flax():
    b, s, hidden, h = 2, 6, 32, 4
    d = hidden // h
    x, dy = randn(1, (b, s, hidden)), randn(2, (b, s, hidden))
    mha = te_flax.MultiHeadAttention(head_dim=d, num_attention_heads=h, scale_attn_logits=True,
                                     return_layernorm_output=True)
    params = unbox(jit_init(mha, x, x, deterministic=True))["params"]
    assert sorted(params) == ["out", "qkv"] and params["qkv"]["kernel"].shape == (hidden, 3, hidden)
    ref = _RefMHA(h, d)
    keep = nn.make_causal_mask(jnp.ones((b, s)))

    @jax.jit
    def run(params):
        (out, ln_out), vjp = jax.vjp(lambda p: mha.apply({"params": p}, x, x, deterministic=True), params)
        ref_out, ref_vjp = jax.vjp(lambda p: ref.apply({"params": p}, x, keep), _ref_params(params, h, d))
        return out, ln_out, _ref_params(vjp((dy, jnp.zeros_like(ln_out)))[0], h, d), ref_out, ref_vjp(dy)[0]

    out, ln_out, grads, ref_out, ref_grads = run(params)
    assert ln_out.shape == x.shape
    assert_allclose(out, ref_out, jnp.float32)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        assert_allclose(got, want, jnp.float32, normalize=True)


def test_gqa_and_unfused_parameter_names_and_decode():
    b, s, hidden = 1, 4, 16
    x = randn(1, (b, s, hidden))
    gqa = te_flax.MultiHeadAttention(head_dim=4, num_attention_heads=4, num_gqa_groups=2)
    params = unbox(jax.eval_shape(lambda: gqa.init(jax.random.PRNGKey(0), x, x, deterministic=True)))["params"]
    assert sorted(params) == ["kv", "out", "query"] and params["kv"]["kernel"].shape == (hidden, 2, 8)
    unfused = te_flax.MultiHeadAttention(head_dim=4, num_attention_heads=4, fuse_qkv_params=False)
    variables = jit_init(unfused, x, x, deterministic=True, decode=True)
    assert sorted(variables["params"]) == ["key", "out", "query", "value"]
    # Decoding one token at a time through the cache == the causal attention over the whole sequence.
    full, _ = jax.jit(lambda v: unfused.apply(v, x, x, deterministic=True))({"params": variables["params"]})
    cache, params = variables["cache"], unbox(variables)["params"]
    step = jax.jit(lambda cache, xt: unfused.apply({"params": params, "cache": cache}, xt, xt, deterministic=True,
                                                   decode=True, mutable=["cache"]))
    for t in range(s):
        (out_t, _), mutated = step(cache, x[:, t : t + 1])
        cache = mutated["cache"]
        assert_allclose(out_t[:, 0], full[:, t], jnp.float32)


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
def test_rotary_embedding_is_a_relative_rotation(method):
    """RoPE keeps norms and makes <R_i q, R_j k> depend only on i - j."""
    s, d = 6, 8
    q, k = randn(1, (1, 1, 1, d)), randn(2, (1, 1, 1, d))
    rq = rotary_pos_emb(jnp.tile(q, (1, s, 1, 1)), (1, 10000), transpose_batch_sequence=False, group_method=method)[0, :, 0]
    rk = rotary_pos_emb(jnp.tile(k, (1, s, 1, 1)), (1, 10000), transpose_batch_sequence=False, group_method=method)[0, :, 0]
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.full(s, np.linalg.norm(q)), rtol=1e-5)
    dots = np.asarray(rq @ rk.T)
    for lag in range(-2, 3):
        diagonal = np.diagonal(dots, offset=lag)
        np.testing.assert_allclose(diagonal, np.full_like(diagonal, diagonal[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dots[0, 0], float(jnp.sum(q * k)), rtol=1e-5)  # position 0 is not rotated
