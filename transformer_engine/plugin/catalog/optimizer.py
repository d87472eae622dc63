"""Multi-tensor optimizer ops (in-place, TE's ``multi_tensor_*`` calling convention).

Each takes ``chunk_size`` (a launch granularity hint), ``noop_flag`` (int32 [1]; set to 1 when a
non-finite value is seen, and when it is already non-zero the update ops do nothing) and
``tensor_lists`` (lists of equal length, one tensor per parameter).

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): empty lists and empty tensors are fine
(nothing to do; the l2norm of nothing is 0);
lists of unequal lengths, tensors of one parameter with unequal sizes, and non-contiguous tensors raise
ValueError (as TE's multi_tensor_apply, the kernels walk raw addresses); a NaN or inf input sets
noop_flag and is otherwise processed by the formula (the update ops then skip the next calls).
"""

from transformer_engine.plugin.core.catalog import declare


@declare(key="tensor_lists", inplace=True)
def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """tensor_lists = [inputs, outputs]: out = in * scale; noop_flag = 1 if any input is not finite."""


@declare(key="tensor_lists", inplace=True)  # writes noop_flag
def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """tensor_lists = [tensors]: total = sqrt(sum_t ||t||^2) in float32.

    Returns: (total float32 [1], per-tensor norms float32 [n] if per_tensor else an empty tensor);
    noop_flag = 1 if the norm is not finite.
    """


@declare(key="tensor_lists", inplace=True)
def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay):
    """tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]; one Adam step in float32 math.

    mode 0 (L2): g = g + wd p; mode 1 (AdamW): p = p - lr wd p (decoupled).
    m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    with bias_correction: m_hat = m / (1 - b1^step), v_hat = v / (1 - b2^step), else m, v;
    p = p - lr m_hat / (sqrt(v_hat) + eps).
    """


@declare(key="tensor_lists", inplace=True)
def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening, lr, nesterov, first_run, wd_after_momentum,
                     scale):
    """tensor_lists = [grads, params, momentum_buffers]; one SGD step (PyTorch's SGD semantics).

    g = scale * g (+ wd p unless wd_after_momentum); buf = g if first_run else momentum buf +
    (1 - dampening) g; d = g + momentum buf if nesterov else buf (g when momentum == 0);
    (d += wd p when wd_after_momentum); p = p - lr d.
    """
