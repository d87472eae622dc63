"""Reference (pure PyTorch) implementations: dropout and cross entropy. See plugin/catalog/misc.py.

Dropout, with keep mask m ~ Bernoulli(1 - p) drawn from the default generator of x's device:
    forward   y = x * m / (1 - p)
    backward  dx = dy * m / (1 - p)
(p = 1 keeps nothing and gives zeros; a dropped element is exactly 0 even where x is NaN or inf.) Bias-dropout-add, bias b [H] broadcast
over the rows:
    forward   out = r + (x + b) * m / (1 - p)
    backward  dx = dout * m / (1 - p) (dropout_bwd), db = sum over rows of dx (dropout_bwd_dbias), dr = dout

Cross entropy of one row z [V] against target t with label smoothing eps:
    lse = log sum_j exp(z_j)
    forward   loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j)
    backward  dz_j = dloss * (softmax(z)_j - (1 - eps) [j == t] - eps / V)
Rows whose target is ``ignore_index`` have loss 0 and gradient 0; a target outside [0, V) that is not
``ignore_index`` gives that row a NaN loss and gradient (no host sync to raise). Math in float32.
"""

import torch

from transformer_engine.plugin.backends._checks import (
    check_bias_dropout_add,
    check_cross_entropy,
    check_cross_entropy_bwd,
    check_dropout_dbias,
    check_dropout_mask,
    dropout_scale,
)
from transformer_engine.plugin.backends._dropout_mask import pack_keep, unpack_keep

__all__ = ["dropout_fwd", "dropout_bwd", "dropout_bwd_dbias", "bias_dropout_add_fwd", "cross_entropy_fwd", "cross_entropy_bwd"]


def _keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """m ~ Bernoulli(1 - p) of x's shape, from the default generator of x's device (True = kept)."""
    return torch.rand(x.shape, dtype=torch.float32, device=x.device) >= p


def dropout_fwd(x, p):
    """Inverted dropout: y = x * m / (1 - p), m ~ Bernoulli(1 - p).

    Args:
        x: input tensor, any float dtype and device.
        p: drop probability in [0, 1].

    Returns:
        (y with x's shape and dtype, keep mask m packed eight elements per byte, see ``_dropout_mask``).

    Raises:
        ValueError: p outside [0, 1].
    """
    scale = dropout_scale(p)
    keep = _keep_mask(x, p)
    return _kept(x.float(), keep, scale).to(x.dtype), pack_keep(keep)


def dropout_bwd(dy, mask, p):
    """dx = dy * m / (1 - p) with the packed keep mask ``mask`` of :func:`dropout_fwd`.

    Raises:
        ValueError: p outside [0, 1], or mask does not hold one bit per element of dy.
        TypeError: mask is not a uint8 tensor.
    """
    scale = dropout_scale(p)
    check_dropout_mask(dy, mask)
    return _dropped(dy, mask, scale).to(dy.dtype)


def dropout_bwd_dbias(dy, mask, p):
    """(dx, dbias): :func:`dropout_bwd` and the float32 sum over the rows of dy [..., H] of its unrounded products.

    Raises:
        ValueError: as :func:`dropout_bwd`, or dy without a last dim.
        TypeError: as :func:`dropout_bwd`.
    """
    scale = dropout_scale(p)
    check_dropout_dbias(dy, mask)
    dx = _dropped(dy, mask, scale)
    return dx.to(dy.dtype), dx.flatten(0, -2).sum(0) if dy.dim() > 1 else dx


def _kept(h: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """h * scale where kept, exactly 0 where dropped (also where h is NaN or inf)."""
    return torch.where(keep, h * scale, torch.zeros((), dtype=h.dtype, device=h.device))


def _dropped(dy, mask, scale: float) -> torch.Tensor:
    """dy * m * scale in float32, m the packed keep mask (dropped elements exactly 0)."""
    return _kept(dy.float(), unpack_keep(mask, dy.shape), scale)


def bias_dropout_add_fwd(x, bias, residual, p):
    """out = residual + (x + bias) * m / (1 - p), m ~ Bernoulli(1 - p); the backward is :func:`dropout_bwd`.

    Args:
        x: input tensor [..., H], any float dtype.
        bias: [H], broadcast over the rows, or None.
        residual: tensor of x's shape.
        p: drop probability in [0, 1].

    Returns:
        (out with x's shape and dtype, computed in float32; keep mask m packed as by :func:`dropout_fwd`).

    Raises:
        ValueError: p outside [0, 1], bias not [H], or residual's shape differs from x's.
        TypeError: bias or residual is not a tensor.
    """
    scale = dropout_scale(p)
    check_bias_dropout_add(x, bias, residual)
    keep = _keep_mask(x, p)
    h = x.float() if bias is None else x.float() + bias.float()
    return (residual.float() + _kept(h, keep, scale)).to(x.dtype), pack_keep(keep)


def _valid_targets(logits, target, ignore_index: int):
    """(kept rows, out-of-range rows, targets with both replaced by 0), all without a host sync."""
    kept = target != ignore_index
    bad = kept & ((target < 0) | (target >= logits.shape[1]))
    return kept, bad, torch.where(kept & ~bad, target, torch.zeros_like(target)).long()


def cross_entropy_fwd(logits, target, label_smoothing=0.0, ignore_index=-100):
    """Per-row cross entropy: loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j).

    Args:
        logits: [N, V] float tensor.
        target: [N] integer class indices; ``ignore_index`` rows get loss 0.
        label_smoothing: eps in [0, 1].
        ignore_index: target value that marks rows to ignore.

    Returns:
        (loss float32 [N], lse float32 [N]).

    Raises:
        ValueError / TypeError: bad shapes (V = 0 included), dtypes or eps. A target out of [0, V) that
        is not ``ignore_index`` is not an error: its row's loss is NaN (no host sync to look).
    """
    check_cross_entropy(logits, target, label_smoothing)
    kept, bad, safe_target = _valid_targets(logits, target, ignore_index)
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    z_t = z.gather(1, safe_target[:, None])[:, 0]
    loss = (1.0 - label_smoothing) * (lse - z_t) + label_smoothing * (lse - z.mean(dim=-1))
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    return torch.where(kept, loss, torch.zeros_like(loss)), lse


def cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing=0.0, ignore_index=-100):
    """dz_j = dloss * (softmax(z)_j - (1 - eps) [j == t] - eps / V), zero for ignored rows.

    Args:
        grad_loss: [N] gradient of the per-row loss.
        logits, target, label_smoothing, ignore_index: as given to :func:`cross_entropy_fwd`.
        lse: [N] log-sum-exp returned by :func:`cross_entropy_fwd`.

    Returns:
        dlogits with logits' shape and dtype.

    Raises:
        ValueError / TypeError: as :func:`cross_entropy_fwd`, or grad_loss / lse not of shape [N].
        The row of an out-of-range target gets a NaN gradient.
    """
    check_cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing)
    kept, bad, safe_target = _valid_targets(logits, target, ignore_index)
    z = logits.float()
    probs = torch.exp(z - lse.float()[:, None])
    one_hot = torch.zeros_like(probs).scatter_(1, safe_target[:, None], 1.0)
    dz = probs - (1.0 - label_smoothing) * one_hot - label_smoothing / z.shape[1]
    scale = torch.where(kept, grad_loss.float(), torch.zeros_like(lse, dtype=torch.float32))
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return (dz * scale[:, None]).to(logits.dtype)
