"""Reference (pure PyTorch) implementations: multi-tensor optimizer ops. See plugin/catalog/optimizer.py.

All math is float32 whatever the storage dtype; results are written back in place (``copy_``
casts to each tensor's dtype). ``chunk_size`` is a launch hint and has no effect here.

noop_flag (int32 [1]): ``multi_tensor_scale`` and ``multi_tensor_l2norm`` set it to 1 when they
see a non-finite value (scale still writes its outputs); ``multi_tensor_adam`` and
``multi_tensor_sgd`` read it and change nothing when it is non-zero.

Adam (step t, mode 0 = L2, mode 1 = AdamW):
    g = g + wd p (mode 0)        p = p (1 - lr wd) (mode 1)
    m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
    p = p - lr m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
SGD (PyTorch semantics):
    g = scale g (+ wd p)   buf = g (first run) or mu buf + (1 - dampening) g
    d = g + mu buf (nesterov) or buf (g when mu = 0)   (+ wd p after momentum)   p = p - lr d
"""

import torch

from transformer_engine.plugin.backends._checks import check_multi_tensor_adam, check_tensor_lists

__all__ = ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_adam", "multi_tensor_sgd"]


def _skip(noop_flag) -> bool:
    """True when a previous op has set the no-op flag."""
    return bool(noop_flag.item() != 0)


def _f32(t, shape):
    """t as float32 with ``shape`` (the tensors of one parameter may differ in shape, not in size)."""
    return t.float().reshape(shape)


def _write(dst, value) -> None:
    """dst <- value, cast to dst's dtype and viewed as dst's shape."""
    dst.copy_(value.reshape(dst.shape))


def _flag_if_not_finite(noop_flag, value) -> None:
    if not bool(torch.isfinite(value).all()):
        noop_flag.fill_(1)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """out = in * scale for each pair; noop_flag = 1 if any input is not finite.

    Args:
        chunk_size: launch hint (unused).
        noop_flag: int32 [1], set to 1 on a non-finite input; the outputs are written regardless.
        tensor_lists: [inputs, outputs].
        scale: float multiplier.

    Raises:
        ValueError: wrong list structure or non-contiguous tensors.
    """
    check_tensor_lists("multi_tensor_scale", tensor_lists, ("inputs", "outputs"))
    for src, dst in zip(*tensor_lists):
        src32 = src.float()
        _flag_if_not_finite(noop_flag, src32)
        _write(dst, src32 * scale)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """total = sqrt(sum_t ||t||^2), in float32.

    Args:
        chunk_size: launch hint (unused).
        noop_flag: int32 [1], set to 1 when the norm is not finite.
        tensor_lists: [tensors].
        per_tensor: also return each tensor's norm.

    Returns:
        (total float32 [1], per-tensor norms float32 [n] if per_tensor else an empty float32 tensor).

    Raises:
        ValueError: wrong list structure or non-contiguous tensors.
    """
    check_tensor_lists("multi_tensor_l2norm", tensor_lists, ("tensors",))
    device = noop_flag.device
    norms = [torch.linalg.vector_norm(t.float()).reshape(1).to(device) for t in tensor_lists[0]]
    per = torch.cat(norms) if norms else torch.zeros(0, dtype=torch.float32, device=device)
    total = torch.linalg.vector_norm(per).reshape(1)
    _flag_if_not_finite(noop_flag, total)
    return total, per if per_tensor else torch.empty(0, dtype=torch.float32, device=device)


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay):
    """One Adam (mode 0, L2) or AdamW (mode 1) step, in place; nothing happens when noop_flag != 0.

    Args:
        chunk_size: launch hint (unused).
        noop_flag: int32 [1], read only.
        tensor_lists: [grads, params, exp_avgs, exp_avg_sqs].
        lr, beta1, beta2, epsilon, weight_decay: the usual hyper-parameters.
        step: 1-based step count used by the bias correction.
        mode: 0 adds wd p to the gradient, 1 decays the parameter (decoupled).
        bias_correction: divide m and v by (1 - beta^step).

    Raises:
        ValueError: wrong list structure, mode not 0/1, step < 1 with bias correction, non-contiguous tensors.
    """
    check_multi_tensor_adam(tensor_lists, step, mode, bias_correction)
    if _skip(noop_flag):
        return
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    for grad, param, exp_avg, exp_avg_sq in zip(*tensor_lists):
        g, p = _f32(grad, param.shape), param.float()
        m, v = _f32(exp_avg, param.shape), _f32(exp_avg_sq, param.shape)
        if mode == 0:
            g = g + weight_decay * p
        else:
            p = p * (1.0 - lr * weight_decay)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - lr * (m / bc1) / (torch.sqrt(v / bc2) + epsilon)
        _write(exp_avg, m)
        _write(exp_avg_sq, v)
        param.copy_(p)


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening, lr, nesterov, first_run, wd_after_momentum,
                     scale):
    """One SGD step with PyTorch's semantics, in place; nothing happens when noop_flag != 0.

    Args:
        chunk_size: launch hint (unused).
        noop_flag: int32 [1], read only.
        tensor_lists: [grads, params, momentum_buffers].
        weight_decay, momentum, dampening, lr, nesterov: as torch.optim.SGD.
        first_run: the momentum buffers are initialised to the (scaled, decayed) gradient.
        wd_after_momentum: add wd p to the update after the momentum instead of to the gradient.
        scale: multiplier of the gradient (e.g. 1 / loss scale).

    Raises:
        ValueError: wrong list structure or non-contiguous tensors.
    """
    check_tensor_lists("multi_tensor_sgd", tensor_lists, ("grads", "params", "momentum_buffers"))
    if _skip(noop_flag):
        return
    for grad, param, buf in zip(*tensor_lists):
        g, p = _f32(grad, param.shape) * scale, param.float()
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        d = g
        if momentum != 0:
            b = g if first_run else momentum * _f32(buf, param.shape) + (1.0 - dampening) * g
            _write(buf, b)
            d = g + momentum * b if nesterov else b
        if weight_decay != 0 and wd_after_momentum:
            d = d + weight_decay * p
        param.copy_(p - lr * d)
