"""te_flax.TransformerLayer (encoder and decoder) against a pure-Flax T5X-style layer, with and without FP8."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common.recipe import DelayedScaling

from .._utils import assert_allclose, jit_init, randn, sqnr, unbox

B, S, HIDDEN, HEADS, MLP = 2, 8, 32, 4, 64
D = HIDDEN // HEADS


class _RefAttention(nn.Module):
    """T5X attention: unscaled logits (the query kernel carries 1/sqrt(d)), 1 = keep masks."""

    dtype: type

    @nn.compact
    def __call__(self, x_q, x_kv, keep, bias):
        dense = lambda name, x: nn.DenseGeneral((HEADS, D), use_bias=False, dtype=self.dtype, name=name)(x)  # noqa: E731
        q, k, v = dense("query", x_q), dense("key", x_kv), dense("value", x_kv)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = logits + (0.0 if bias is None else bias)
        probs = jax.nn.softmax(jnp.where(keep, logits, -1e10), axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(HIDDEN, axis=(-2, -1), use_bias=False, dtype=self.dtype, name="out")(ctx)


class _RefLayer(nn.Module):
    """Pre-LN T5X layer computing in ``dtype`` (parameters in float32), as TE's own reference does."""

    decoder: bool
    dtype: type

    @nn.compact
    def __call__(self, x, encoded, keep, cross_keep, bias):
        ln = lambda name: nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name=name)  # noqa: E731
        y = ln("pre_attention_layer_norm")(x)
        x = x + _RefAttention(self.dtype, name="attention")(y, y, keep, bias)
        if self.decoder:
            y = ln("pre_cross_attention_layer_norm")(x)
            x = x + _RefAttention(self.dtype, name="encoder_decoder_attention")(y, encoded, cross_keep, None)
        y = ln("pre_mlp_layer_norm")(x)
        h = nn.DenseGeneral((2, MLP), use_bias=False, dtype=self.dtype, name="wi")(y)
        a = nn.gelu(h[..., 0, :], approximate=True) * h[..., 1, :]
        return x + nn.Dense(HIDDEN, use_bias=False, dtype=self.dtype, name="wo")(a)


def _split_heads(kernel, n):
    return [kernel.reshape(HIDDEN, n, HEADS, D)[:, i] for i in range(n)]


def _ref_params(p, decoder):
    """TE parameter tree -> the reference's names and shapes."""
    self_name = "self_attention" if decoder else "attention"
    q, k, v = _split_heads(p[self_name]["qkv"]["kernel"], 3)
    out = {
        "pre_attention_layer_norm": {"scale": p[self_name]["qkv"]["scale"], "bias": p[self_name]["qkv"]["ln_bias"]},
        "attention": {"query": {"kernel": q}, "key": {"kernel": k}, "value": {"kernel": v},
                      "out": {"kernel": p[self_name]["out"]["kernel"].reshape(HEADS, D, HIDDEN)}},
        "pre_mlp_layer_norm": {"scale": p["mlp"]["scale"], "bias": p["mlp"]["ln_bias"]},
        "wi": {"kernel": p["mlp"]["wi_kernel"]}, "wo": {"kernel": p["mlp"]["wo_kernel"]},
    }
    if decoder:
        cross = p["encoder_decoder_attention"]
        k, v = _split_heads(cross["kv"]["kernel"], 2)
        out["pre_cross_attention_layer_norm"] = {"scale": cross["query"]["scale"], "bias": cross["query"]["ln_bias"]}
        out["encoder_decoder_attention"] = {
            "query": {"kernel": cross["query"]["kernel"].reshape(HIDDEN, HEADS, D)}, "key": {"kernel": k},
            "value": {"kernel": v}, "out": {"kernel": cross["out"]["kernel"].reshape(HEADS, D, HIDDEN)}}
    return out


def _layer(decoder):
    return te_flax.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS, mlp_activations=("gelu", "linear"),
        layer_type=te_flax.TransformerLayerType.DECODER if decoder else te_flax.TransformerLayerType.ENCODER)


def _run(decoder, recipe, dtype, warmup_steps):
    x, encoded, dy = randn(1, (B, S, HIDDEN), dtype), randn(2, (B, S, HIDDEN), dtype), randn(3, (B, S, HIDDEN), dtype)
    enc_valid = np.arange(S)[None, :] < np.array([S, 5])[:, None]
    cross_mask = jnp.asarray(~(np.ones((B, 1, S, 1), bool) & enc_valid[:, None, None, :]))  # 1 = masked out
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        layer = _layer(decoder)
        args = (x, encoded if decoder else None, None, cross_mask if decoder else None)
        variables = jit_init(layer, *args, deterministic=True)

        @jax.jit
        def step(variables):
            out, vjp = jax.vjp(lambda v: layer.apply(v, *args, deterministic=True), variables)
            return out, vjp(dy)[0]

        for _ in range(warmup_steps + 1):  # FP8: each step feeds the new fp8_metas back
            out, grads = step(variables)
            variables = te.update_collections({k: v for k, v in grads.items() if k != "params"}, variables)
    params = unbox(variables)["params"]
    rel = te_flax.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=HEADS)
    ref = _RefLayer(decoder, dtype)
    keep = jnp.tril(jnp.ones((S, S), bool))  # the default self_attn_mask_type is "causal"

    @jax.jit
    def reference(params):
        bias = rel.apply({"params": params["relpos_bias"]}, S, S, not decoder)
        ref_out, ref_vjp = jax.vjp(lambda p: ref.apply({"params": p}, x, encoded, keep, ~cross_mask, bias),
                                   _ref_params(params, decoder))
        return ref_out, ref_vjp(dy)[0]

    ref_out, ref_grads = reference(params)
    return variables, out, _ref_params(unbox(grads)["params"], decoder), ref_out, ref_grads


@pytest.mark.parametrize("decoder,dtype", [(False, jnp.float32), (True, jnp.bfloat16)], ids=["encoder", "decoder"])
def test_transformer_layer_matches_flax(decoder, dtype):
    variables, out, grads, ref_out, ref_grads = _run(decoder, None, dtype, 0)
    assert out.dtype == dtype and "fp8_metas" not in variables
    assert sorted(variables["params"]) == (
        ["encoder_decoder_attention", "mlp", "relpos_bias", "self_attention"] if decoder
        else ["attention", "mlp", "relpos_bias"])
    assert_allclose(out, ref_out, dtype)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        if dtype == jnp.float32:
            assert_allclose(got, want, dtype, normalize=True)
        else:  # bf16 weight gradients of a whole tiny layer: ~1 ulp per op compounds; bound the aggregate
            assert sqnr(want, got) > 35.0


def test_transformer_layer_fp8_after_warmup():
    variables, out, grads, ref_out, ref_grads = _run(decoder=False, recipe=DelayedScaling(amax_history_len=8), dtype=jnp.float32,
                                                     warmup_steps=4)
    metas = variables["fp8_metas"]
    assert sorted(metas) == ["attention", "mlp"] and sorted(metas["attention"]) == ["out", "qkv"]
    assert len(jax.tree_util.tree_leaves(metas)) == 4 * 6  # 4 GEMMs x (scale, history) x (x, kernel, grad)
    assert int(np.count_nonzero(np.asarray(metas["mlp"]["x_1_amax_history"]))) == 5  # warm-up + final step
    assert_allclose(out, ref_out, jnp.float8_e4m3fn, normalize=True)
    assert sqnr(ref_out, out) > 25.0  # the residual carries most of the output
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        assert sqnr(want, got) > 14.0  # e5m2 gradients through four FP8 GEMMs measure 17-22 dB here


def test_transformer_layer_input_errors():
    def init(layer, x):  # traced only: the checks run before any computation
        return jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), x, deterministic=True))

    with pytest.raises(ValueError, match="3-D"):
        init(_layer(decoder=False), jnp.ones((S, HIDDEN)))
    with pytest.raises(ValueError, match="hidden_size=32"):
        init(_layer(decoder=False), jnp.ones((B, S, 16)))
    with pytest.raises(ValueError, match="needs `encoded`"):
        init(_layer(decoder=True), jnp.ones((B, S, HIDDEN)))


def test_transformer_layer_sequence_first_layout():
    """transpose_batch_sequence=True on [s, b, h] inputs == the default layout on [b, s, h]."""
    x = randn(1, (B, S, HIDDEN))
    batch_first = _layer(decoder=False)
    seq_first = batch_first.clone(transpose_batch_sequence=True)
    variables = jit_init(batch_first, x, deterministic=True)
    run = jax.jit(lambda v, x: (batch_first.apply(v, x, deterministic=True),
                                seq_first.apply(v, jnp.swapaxes(x, 0, 1), deterministic=True)))
    out, out_t = run(variables, x)
    assert_allclose(jnp.swapaxes(out_t, 0, 1), out, jnp.float32)
