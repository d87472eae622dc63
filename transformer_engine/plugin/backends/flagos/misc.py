"""Cross entropy in Triton, forward and backward (dropout is left to the reference backend).

For one row z [V] of logits and target t, with label smoothing eps, in float32:

    forward   lse = log sum_j exp(z_j), computed online over blocks of V:
                  m' = max(m, max_block z),  s' = s exp(m - m') + sum_block exp(z - m'),  lse = m + log s
              loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j)
    backward  dz_j = g (exp(z_j - lse) - (1 - eps) [j == t] - eps / V),  g = grad_loss of the row

Rows whose target equals ``ignore_index`` get loss 0 and gradient 0 (their lse is still written).
A target outside [0, V) that is not ``ignore_index`` gives a NaN loss: the kernel never reads out
of bounds and never synchronises to raise (the reference backend raises instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transformer_engine.plugin.core import Reject

from ._common import device_guard

__all__ = ["cross_entropy_fwd", "cross_entropy_bwd"]

_BLOCK_V = 4096  # logits per step of the loop over the vocabulary


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,  # *z [N, V], row stride stride_z
    target_ptr,  # *int [N]
    loss_ptr,  # *float32 [N]
    lse_ptr,  # *float32 [N]
    V,  # vocabulary size
    stride_z,  # elements between rows of z
    label_smoothing,  # eps
    ignore_index,  # target value of ignored rows
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_z
    m = float("-inf")
    s = 0.0
    z_sum = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no inf - inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)
        m = m_new
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    target = tl.load(target_ptr + row).to(tl.int64)
    in_range = (target >= 0) & (target < V)
    z_t = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = (1.0 - label_smoothing) * (lse - z_t) + label_smoothing * (lse - z_sum / V)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    grad_ptr,  # *grad_loss [N], stride stride_g
    logits_ptr,  # *z [N, V], row stride stride_z
    target_ptr,  # *int [N]
    lse_ptr,  # *lse [N]
    dz_ptr,  # *dz [N, V] contiguous, logits' dtype
    V,  # vocabulary size
    stride_g,  # elements between entries of grad_loss (0 when broadcast)
    stride_z,  # elements between rows of z
    label_smoothing,  # eps
    ignore_index,  # target value of ignored rows
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    g = tl.load(grad_ptr + row64 * stride_g).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(logits_ptr + row64 * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        hit = tl.where(cols == target, 1.0 - label_smoothing, 0.0)
        dz = g * (tl.exp(z - lse) - hit - label_smoothing / V)
        tl.store(dz_ptr + row64 * V + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _check(logits, target, label_smoothing: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}; flatten the leading dims")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"target shape {tuple(target.shape)} must be [N] = [{logits.shape[0]}] (one class per row)")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of class indices, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def cross_entropy_fwd(logits, target, label_smoothing=0.0, ignore_index=-100):
    """Per-row cross entropy: loss = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j).

    Args:
        logits: [N, V] float tensor.
        target: [N] integer class indices; ``ignore_index`` rows get loss 0.
        label_smoothing: eps in [0, 1].
        ignore_index: target value that marks rows to ignore.

    Returns:
        (loss float32 [N], lse float32 [N]); an out-of-range target gives a NaN loss.

    Raises:
        ValueError / TypeError: bad shapes, dtypes or eps.
    """
    _check(logits, target, label_smoothing)
    logits = _unit_cols(logits)
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n and vocab:
        with device_guard(logits):
            _cross_entropy_fwd_kernel[(n,)](
                logits, target.contiguous(), loss, lse, vocab, logits.stride(0), float(label_smoothing),
                int(ignore_index), BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)), num_warps=8,
            )  # fmt: skip
    return loss, lse


def cross_entropy_bwd(grad_loss, logits, target, lse, label_smoothing=0.0, ignore_index=-100):
    """dz_j = grad_loss (softmax(z)_j - (1 - eps) [j == t] - eps / V), zero for ignored rows.

    Args:
        grad_loss: [N] gradient of the per-row loss (an expanded scalar is fine).
        logits, target, label_smoothing, ignore_index: as given to :func:`cross_entropy_fwd`.
        lse: [N] from :func:`cross_entropy_fwd`.

    Returns:
        dlogits with logits' shape and dtype.

    Raises:
        ValueError / TypeError: as :func:`cross_entropy_fwd`, or grad_loss / lse not of shape [N].
    """
    _check(logits, target, label_smoothing)
    for name, value in (("grad_loss", grad_loss), ("lse", lse)):
        if value.shape != target.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} must be [N] = [{target.shape[0]}]")
    logits = _unit_cols(logits)
    n, vocab = logits.shape
    dz = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n and vocab:
        with device_guard(logits):
            _cross_entropy_bwd_kernel[(n,)](
                grad_loss, logits, target.contiguous(), lse.contiguous(), dz, vocab, grad_loss.stride(0),
                logits.stride(0), float(label_smoothing), int(ignore_index),
                BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)), num_warps=8,
            )  # fmt: skip
    return dz


def _same_device(logits, *others) -> object:
    if isinstance(logits, torch.Tensor):
        for other in others:
            if isinstance(other, torch.Tensor) and other.device != logits.device:
                return Reject(f"an operand is on {other.device} but logits on {logits.device}")
    return True


def _fwd_fits(logits, target, label_smoothing=0.0, ignore_index=-100):
    return _same_device(logits, target)


def _bwd_fits(grad_loss, logits, target, lse, label_smoothing=0.0, ignore_index=-100):
    return _same_device(logits, grad_loss, target, lse)


SUPPORTS = {"cross_entropy_fwd": _fwd_fits, "cross_entropy_bwd": _bwd_fits}
