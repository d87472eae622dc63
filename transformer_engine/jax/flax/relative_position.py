"""Flax ``RelativePositionBiases``: T5-style bucketed relative position bias of attention logits.

For query i and key j, n = i - j (the distance back). Bidirectional: half of the buckets hold
n < 0 (keys ahead), and |n| is bucketed; unidirectional: n = max(n, 0). With B buckets left and
e = B / 2 exact ones, bucket(n) = n if n < e, else
min(B - 1, e + floor(log(n / e) / log(max_distance / e) * (B - e))).
The bias of head h is rel_embedding[h, bucket(i - j)].
"""

from __future__ import annotations

from typing import Callable, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ._base import logical_param

__all__ = ["RelativePositionBiases"]


def _buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
    """(q_len, k_len) int bucket of each (query, key) pair, computed on the host."""
    n = np.arange(q_len, dtype=np.int32)[:, None] - np.arange(k_len, dtype=np.int32)[None, :]
    bucket = np.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket += (n < 0).astype(np.int32) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    exact = num_buckets // 2
    large = exact + (
        np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps) / np.log(max_distance / exact)
        * (num_buckets - exact)
    ).astype(np.int32)
    return bucket + np.where(n < exact, n, np.minimum(large, num_buckets - 1))


class RelativePositionBiases(nn.Module):
    """T5 relative position biases: returns (1, heads, q_seqlen, k_seqlen).

    Attributes:
        num_buckets: number of distance buckets. max_distance: distances beyond share the last bucket.
        num_attention_heads: heads. embedding_init: initializer of ``rel_embedding`` (heads, buckets).
        embedding_axes: its logical axes. dtype: dtype of the parameter and of the returned bias.

    Example:
        >>> import jax
        >>> rpb = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2)
        >>> rpb.init_with_output(jax.random.PRNGKey(0), 3, 5)[0].shape
        (1, 2, 3, 5)
    """

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable = nn.linear.default_embed_init
    embedding_axes: Tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        """The bias for a (q_seqlen, k_seqlen) attention, shape (1, heads, q_seqlen, k_seqlen)."""
        bucket = _buckets(q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional)
        table = logical_param(self, "rel_embedding", self.embedding_init,
                              (self.num_attention_heads, self.num_buckets), self.dtype, self.embedding_axes)
        one_hot = jax.nn.one_hot(bucket, self.num_buckets, dtype=self.dtype)  # (q, k, buckets)
        values = jnp.einsum("hn,qkn->hqk", table.astype(self.dtype), one_hot)
        return values[None]
