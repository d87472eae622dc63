"""Reference multi-tensor optimizer ops vs torch.optim (several steps) and float64 formulas."""

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference.optimizer import (
    multi_tensor_adam,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_sgd,
)

_SHAPES = [(7,), (13, 5), (1,), (3, 11, 2)]
_CHUNK = 2048 * 32


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _params():
    return [randn(*shape) for shape in _SHAPES]


def _gradient_steps(n_steps):
    return [[randn(*shape) for shape in _SHAPES] for _ in range(n_steps)]


@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.03])
def test_adam_matches_torch_step_for_step(adamw, weight_decay):
    lr, betas, eps = 3e-3, (0.9, 0.99), 1e-8
    params = _params()
    torch_params = [p.clone().requires_grad_() for p in params]
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    optim = optim_cls(torch_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_gradient_steps(5), start=1):
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        optim.step()
        lists = [grads, params, exp_avgs, exp_avg_sqs]
        multi_tensor_adam(_CHUNK, _flag(), lists, lr, betas[0], betas[1], eps, step, int(adamw), bias_correction=True,
                          weight_decay=weight_decay)
    for p, tp, m, v in zip(params, torch_params, exp_avgs, exp_avg_sqs):
        state = optim.state[tp]
        torch.testing.assert_close(p, tp.detach(), **dtype_tols(torch.float32))
        torch.testing.assert_close(m, state["exp_avg"], **dtype_tols(torch.float32))
        torch.testing.assert_close(v, state["exp_avg_sq"], **dtype_tols(torch.float32))


def test_adam_bf16_params_without_bias_correction_match_float64_formula():
    lr, b1, b2, eps, wd = 1e-2, 0.8, 0.95, 1e-6, 0.1
    params = [randn(*shape, dtype=torch.bfloat16) for shape in _SHAPES]
    grads = [randn(*shape, dtype=torch.bfloat16) for shape in _SHAPES]
    ms, vs = [randn(*s, scale=0.1) for s in _SHAPES], [randn(*s).abs() for s in _SHAPES]
    want = []
    for p, g, m, v in zip(params, grads, ms, vs):
        g64 = g.double() + wd * p.double()  # mode 0: L2
        m64, v64 = b1 * m.double() + (1 - b1) * g64, b2 * v.double() + (1 - b2) * g64**2
        want.append((p.double() - lr * m64 / (v64.sqrt() + eps), m64, v64))
    multi_tensor_adam(_CHUNK, _flag(), [grads, params, ms, vs], lr, b1, b2, eps, 3, 0, bias_correction=False, weight_decay=wd)
    for p, m, v, (p64, m64, v64) in zip(params, ms, vs, want):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.double(), p64, **dtype_tols(torch.bfloat16))
        torch.testing.assert_close(m.double(), m64, **dtype_tols(torch.float32))
        torch.testing.assert_close(v.double(), v64, **dtype_tols(torch.float32))


@pytest.mark.parametrize(
    "hp",
    [
        dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
        dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.01),
        dict(momentum=0.9, dampening=0.25, nesterov=False, weight_decay=0.0),
        dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=0.02),
    ],
)
def test_sgd_matches_torch_step_for_step(hp):
    lr, loss_scale = 0.05, 8.0
    params = _params()
    torch_params = [p.clone().requires_grad_() for p in params]
    optim = torch.optim.SGD(torch_params, lr=lr, **hp)
    bufs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_gradient_steps(4)):
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        optim.step()
        scaled = [g * loss_scale for g in grads]  # the op unscales with ``scale``
        multi_tensor_sgd(
            _CHUNK, _flag(), [scaled, params, bufs], hp["weight_decay"], hp["momentum"], hp["dampening"], lr,
            hp["nesterov"], step == 0, wd_after_momentum=False, scale=1.0 / loss_scale,
        )
    for p, tp, buf in zip(params, torch_params, bufs):
        torch.testing.assert_close(p, tp.detach(), **dtype_tols(torch.float32))
        if hp["momentum"]:
            torch.testing.assert_close(buf, optim.state[tp]["momentum_buffer"], **dtype_tols(torch.float32))


def test_sgd_weight_decay_after_momentum_matches_formula():
    wd, mu, damp, lr = 0.1, 0.7, 0.2, 0.3
    g, p, buf = randn(17), randn(17), randn(17)
    want_buf = mu * buf.double() + (1 - damp) * g.double()
    want_p = p.double() - lr * (want_buf + wd * p.double())
    multi_tensor_sgd(_CHUNK, _flag(), [[g], [p], [buf]], wd, mu, damp, lr, nesterov=False, first_run=False, wd_after_momentum=True,
                     scale=1.0)
    torch.testing.assert_close(buf.double(), want_buf, **dtype_tols(torch.float32))
    torch.testing.assert_close(p.double(), want_p, **dtype_tols(torch.float32))


def test_update_ops_do_nothing_when_noop_flag_is_set():
    flag = torch.ones(1, dtype=torch.int32)
    params, grads = _params(), _gradient_steps(1)[0]
    before = [p.clone() for p in params]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    multi_tensor_adam(_CHUNK, flag, [grads, params, *states], 0.1, 0.9, 0.999, 1e-8, 1, 1, bias_correction=True, weight_decay=0.0)
    multi_tensor_sgd(_CHUNK, flag, [grads, params, states[0]], 0.0, 0.9, 0.0, 0.1, nesterov=False, first_run=True, wd_after_momentum=False,
                     scale=1.0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.all(s == 0) for group in states for s in group)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_scale_writes_outputs_and_flags_non_finite(src_dtype):
    srcs = [randn(*shape, dtype=src_dtype) for shape in _SHAPES]
    dsts = [torch.empty(shape) for shape in _SHAPES]
    flag = _flag()
    multi_tensor_scale(_CHUNK, flag, [srcs, dsts], 0.37)
    assert flag.item() == 0
    for src, dst in zip(srcs, dsts):
        torch.testing.assert_close(dst.double(), src.double() * 0.37, **dtype_tols(torch.float32))
    for bad in (float("inf"), float("nan")):
        srcs[2].view(-1)[0] = bad
        flag = _flag()
        ops.multi_tensor_scale(_CHUNK, flag, [srcs, dsts], 2.0)
        assert flag.item() == 1


def test_l2norm_total_and_per_tensor():
    tensors = [randn(*shape, dtype=dtype) for shape, dtype in zip(_SHAPES, [torch.float32, torch.bfloat16] * 2)]
    flag = _flag()
    total, per = multi_tensor_l2norm(_CHUNK, flag, [tensors], per_tensor=True)
    want_per = torch.stack([t.double().norm() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32 and per.dtype == torch.float32
    torch.testing.assert_close(per.double(), want_per, **dtype_tols(torch.float32))
    torch.testing.assert_close(total.double(), want_per.norm().reshape(1), **dtype_tols(torch.float32))
    assert flag.item() == 0
    (total2, empty), impl = ops.multi_tensor_l2norm.traced(_CHUNK, flag, [tensors])
    assert impl.impl_id == "reference.torch" and empty.numel() == 0 and torch.equal(total2, total)
    tensors[1].view(-1)[3] = float("nan")
    multi_tensor_l2norm(_CHUNK, flag, [tensors])
    assert flag.item() == 1


def test_list_structure_is_checked():
    with pytest.raises(ValueError, match="4 lists"):
        multi_tensor_adam(_CHUNK, _flag(), [[randn(3)]] * 3, 0.1, 0.9, 0.999, 1e-8, 1, 0, bias_correction=True, weight_decay=0.0)
    with pytest.raises(ValueError, match="equal lengths"):
        multi_tensor_scale(_CHUNK, _flag(), [[randn(3)], []], 1.0)
    with pytest.raises(ValueError, match="mode=2"):
        multi_tensor_adam(_CHUNK, _flag(), [[randn(3)]] * 4, 0.1, 0.9, 0.999, 1e-8, 1, 2, bias_correction=True, weight_decay=0.0)


@pytest.mark.parametrize("op", ["scale", "l2norm", "adam", "sgd"])
def test_non_contiguous_tensors_raise_as_the_catalog_says(op):
    x = randn(4, 4).t()  # the catalog: non-contiguous tensors raise ValueError (the kernels walk raw addresses)
    calls = {
        "scale": lambda: multi_tensor_scale(_CHUNK, _flag(), [[x], [torch.empty_like(x)]], 1.0),
        "l2norm": lambda: multi_tensor_l2norm(_CHUNK, _flag(), [[x]]),
        "adam": lambda: multi_tensor_adam(_CHUNK, _flag(), [[x]] * 4, 0.1, 0.9, 0.999, 1e-8, 1, 0, bias_correction=True, weight_decay=0.0),
        "sgd": lambda: multi_tensor_sgd(_CHUNK, _flag(), [[x]] * 3, 0.0, 0.9, 0.0, 0.1, nesterov=False, first_run=True,
                                        wd_after_momentum=False, scale=1.0),
    }
    with pytest.raises(ValueError, match="contiguous"):
        calls[op]()
