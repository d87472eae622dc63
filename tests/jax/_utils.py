"""Helpers of the JAX tests: TE's JAX tolerance table, comparisons, random inputs.

Tolerances follow TE's JAX test suite (reference/te_jax_api.md, section 5): rtol = atol =
eps^(2/3) of the dtype the result was computed in, a few units in its last place, so a correct
kernel that rounds or sums in another order passes and a wrong one does not:
float32 2.4e-5 (atol 2.4e-5), bfloat16 0.039, float16 0.0098, e4m3 0.25, e5m2 0.397.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

DTYPE_TOLS = {
    jnp.float32: 2.4e-5,
    jnp.bfloat16: 0.039,
    jnp.float16: 0.0098,
    jnp.float8_e4m3fn: 0.25,
    jnp.float8_e5m2: 0.397,
}


def dtype_tols(dtype) -> dict:
    """{rtol, atol} for results computed in ``dtype``."""
    tol = DTYPE_TOLS[jnp.dtype(dtype).type]
    return dict(rtol=tol, atol=tol)


def assert_allclose(actual, desired, dtype, normalize: bool = False) -> None:
    """np.testing.assert_allclose in float32 with ``dtype``'s tolerances.

    ``normalize`` divides both by the RMS of ``desired`` first, so that the absolute tolerance is
    measured in units of the typical magnitude (FP8 errors scale with it: a 64-term e5m2 gradient
    of magnitude 10 is off by ~0.6 however correct the kernel is).
    """
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    desired = np.asarray(jnp.asarray(desired, jnp.float32), np.float64)
    if normalize:
        rms = np.sqrt(np.mean(desired**2)) or 1.0
        actual, desired = actual / rms, desired / rms
    np.testing.assert_allclose(actual, desired, **dtype_tols(dtype))


def sqnr(reference, actual) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - actual||), in float64."""
    ref = np.asarray(jnp.asarray(reference, jnp.float32), np.float64)
    noise = np.linalg.norm(ref - np.asarray(jnp.asarray(actual, jnp.float32), np.float64))
    return math.inf if noise == 0 else 20.0 * math.log10(np.linalg.norm(ref) / noise)


def randn(seed: int, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """Fresh normal values (non-zero with probability 1) from an integer seed.

    Drawn with NumPy: on CPU every new shape of an eager ``jax.random`` call costs a compile.
    """
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(values).astype(dtype)


def unbox(tree):
    """Strip Flax partitioning boxes (LogicallyPartitioned) from a variable tree."""
    import flax.linen as nn

    return nn.meta.unbox(tree)


def jit_init(module, *args, **kwargs):
    """``module.init(PRNGKey(0), *args, **kwargs)`` as one compiled call (eager init compiles every op)."""
    return jax.jit(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))()
