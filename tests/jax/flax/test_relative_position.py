"""te_flax.RelativePositionBiases: T5 buckets against a float64 re-derivation and hand-checked values."""

import math

import jax
import numpy as np

import transformer_engine.jax.flax as te_flax

from .._utils import randn, unbox


def _t5_bucket(query: int, key: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's bucket of one (query, key) pair, written out with Python scalars."""
    n = query - key
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    large = exact + int(math.log(n / exact + np.finfo(np.float32).eps) / math.log(max_distance / exact)
                        * (num_buckets - exact))
    return bucket + min(large, num_buckets - 1)


def test_relative_position_biases():
    heads, buckets, max_distance, q_len, k_len = 3, 32, 128, 9, 200
    module = te_flax.RelativePositionBiases(num_buckets=buckets, max_distance=max_distance, num_attention_heads=heads)
    variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), q_len, k_len))
    table = randn(1, (heads, buckets))
    apply = jax.jit(lambda t, bidirectional: module.apply({"params": {"rel_embedding": t}}, q_len, k_len,
                                                          bidirectional), static_argnums=1)
    assert unbox(variables)["params"]["rel_embedding"].shape == (heads, buckets)
    for bidirectional in (True, False):
        got = np.asarray(apply(table, bidirectional))
        idx = np.array([[_t5_bucket(i, j, buckets, max_distance, bidirectional) for j in range(k_len)]
                        for i in range(q_len)])
        np.testing.assert_array_equal(got, np.asarray(table)[:, idx][None])
    # Hand-checked: distance 0 -> bucket 0; a key 1 ahead (bidirectional) -> bucket 16 + 1; far ahead -> last.
    assert _t5_bucket(5, 5, 32, 128, bidirectional=True) == 0 and _t5_bucket(5, 6, 32, 128, bidirectional=True) == 17
    assert _t5_bucket(0, 500, 32, 128, bidirectional=True) == 31 and _t5_bucket(0, 3, 32, 128, bidirectional=False) == 0
