"""Dropout, the fused bias-dropout-add, and cross entropy.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available):
- empty tensors give empty results (and an empty mask); inputs may have any strides;
- dropout: a dropped element is exactly 0 in y and dx, also where x or dy is NaN or inf (the
  element does not depend on x); a kept one is x / (1 - p), NaN and inf included; p outside [0, 1]
  raises ValueError before any work;
- cross entropy: an out-of-range target (outside [0, V) and not ``ignore_index``) is not an error:
  its row's loss is NaN and its gradient row NaN, the other rows are unaffected. Raising would need
  the target values on the host (a device sync per step, impossible in a CUDA graph or a fused GPU
  kernel); NVIDIA TE's Triton cross entropy does not check either, so the NaN makes the mistake
  visible in the loss instead of silently training on a clamped class. V = 0, a non-integer
  target and a label smoothing outside [0, 1] raise (ValueError / TypeError) from shapes alone.
  NaN or inf logits make their row's lse and loss NaN / inf as in float32 math.
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare


@declare
def dropout_fwd(x: Tensor, p: float) -> Tuple[Tensor, Tensor]:
    """y = x * m / (1 - p), m ~ Bernoulli(1 - p) from the device's default generator (y = 0 exactly where m = 0).

    Returns: (y like x, m packed: uint8 [ceil(numel / 8)], element i kept where bit i % 8 of byte i // 8
    is set, least significant bit first, over x flattened row-major; the bits past numel are 0).
    """


@declare
def dropout_bwd(dy: Tensor, mask: Tensor, p: float) -> Tensor:
    """dx = dy * m / (1 - p), ``mask`` the packed m of the forward (see :func:`dropout_fwd`)."""


@declare
def dropout_bwd_dbias(dy: Tensor, mask: Tensor, p: float) -> Tuple[Tensor, Tensor]:
    """``dropout_bwd`` plus the bias gradient of bias-dropout-add, from one read of dy.

    dx = dy * m / (1 - p) in dy's dtype,  dbias[j] = sum over the rows of dy [..., H] of dy * m / (1 - p),
    accumulated in float32 from the unrounded products. Returns: (dx like dy, dbias float32 [H]).
    """


@declare
def bias_dropout_add_fwd(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float) -> Tuple[Tensor, Tensor]:
    """out = residual + (x + bias) * m / (1 - p), m ~ Bernoulli(1 - p) from the device's default generator.

    ``bias`` is [H] (H = x's last dim, broadcast over the rows) or None; ``residual`` has x's shape.
    Math in float32, ``out`` in x's dtype. The backward is :func:`dropout_bwd` (or, with a bias,
    :func:`dropout_bwd_dbias`) with the same m: dx = dout * m / (1 - p), dbias = sum over rows of dx,
    dresidual = dout.
    Returns: (out like x, m packed as in :func:`dropout_fwd`).
    """


@declare
def cross_entropy_fwd(logits: Tensor, target: Tensor, label_smoothing: float = 0.0, ignore_index: int = -100) -> Tuple[Tensor, Tensor]:
    """Per-row cross entropy of logits [N, V] (any float dtype) against int64 target [N].

    lse = log sum_j exp(z_j); loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j), eps =
    ``label_smoothing``; rows whose target equals ``ignore_index`` have loss 0; a row whose target is
    outside [0, V) (and not ``ignore_index``) has loss NaN, without a host sync (see the module docstring).
    Returns: (loss float32 [N], lse float32 [N]).
    """


@declare
def cross_entropy_bwd(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, label_smoothing: float = 0.0,
                      ignore_index: int = -100) -> Tensor:
    """dz_j = grad_loss * (softmax(z)_j - (1 - eps) [j == t] - eps / V), 0 for ignored rows, NaN for the
    rows of out-of-range targets.

    Returns: dlogits with logits' shape and dtype.
    """
