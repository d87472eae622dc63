"""FusedSGD against torch.optim.SGD: momentum, dampening, Nesterov, weight decay, dtypes, state dicts."""

import io

import pytest
import torch

from transformer_engine.pytorch.optimizers import FusedSGD

SHAPES = [(1,), (7, 13), (127,), (3, 5, 2)]
STEPS = 5
# float32: the same float32 formula as torch.optim.SGD, association aside: an ulp or two per step.
FP32_TOL = {"rtol": 1e-6, "atol": 1e-7}
# bf16/fp16: torch computes in the storage dtype, we compute in float32 and round once: a few ulps apart.
LOW_TOL = {torch.bfloat16: {"rtol": 2**-6, "atol": 1e-2}, torch.float16: {"rtol": 2**-9, "atol": 1e-3}}


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SHAPES]


def _set_grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


CONFIGS = [
    {"momentum": 0.0},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3},
    {"momentum": 0.9, "nesterov": True},
    {"momentum": 0.9, "weight_decay": 0.05},
    {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
    {"momentum": 0.0, "weight_decay": 0.05},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fp32_matches_torch(config):
    ours, ref = _params(), _params()
    opt = FusedSGD(ours, lr=0.1, **config)
    ref_opt = torch.optim.SGD(ref, lr=0.1, foreach=False, **config)
    for step in range(STEPS):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_match_torch(dtype):
    ours, ref = _params(dtype), _params(dtype)
    opt = FusedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    for step in range(STEPS):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref):
        assert opt.state[p]["momentum_buffer"].dtype == dtype
        torch.testing.assert_close(p, r, **LOW_TOL[dtype])


def test_parameter_joining_later_starts_its_momentum_like_torch():
    ours, ref = _params(), _params()
    opt = FusedSGD(ours, lr=0.1, momentum=0.9, dampening=0.5)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    for step in range(STEPS):
        for params in (ours, ref):
            _set_grads(params, step)
            if step < 2:
                params[1].grad = None  # frozen for two steps: its first step comes later
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, **FP32_TOL)


def test_wd_after_momentum_and_loss_scale():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = FusedSGD([p], lr=0.1, momentum=0.5, weight_decay=0.2, wd_after_momentum=True)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([-2.0, 2.0])]
    expected, buf = p.detach().clone(), None
    for grad in grads:
        g = grad / 4.0  # the loss scale
        buf = g if buf is None else 0.5 * buf + g
        expected = expected - 0.1 * (buf + 0.2 * expected)
        p.grad = grad.clone()
        opt.most_recent_scale = 4.0
        opt.step()
        assert opt.most_recent_scale == 1.0
        torch.testing.assert_close(p.detach(), expected, **FP32_TOL)


def test_state_dict_round_trip_continues_identically():
    straight, resumed = _params(), _params()
    config = {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}
    straight_opt = FusedSGD(straight, **config)
    first_opt = FusedSGD(resumed, **config)
    for step in range(6):
        _set_grads(straight, step)
        straight_opt.step()
    for step in range(3):
        _set_grads(resumed, step)
        first_opt.step()
    buffer = io.BytesIO()
    torch.save(first_opt.state_dict(), buffer)
    buffer.seek(0)
    second_opt = FusedSGD(resumed, **config)
    second_opt.load_state_dict(torch.load(buffer))
    for step in range(3, 6):
        _set_grads(resumed, step)
        second_opt.step()
    for s, r in zip(straight, resumed):
        assert torch.equal(s, r)


def test_zero_grad():
    params = _params()
    opt = FusedSGD(params, lr=0.1)
    _set_grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr=-1.0"),
        ({"lr": 0.1, "momentum": -0.5}, "momentum=-0.5"),
        ({"lr": 0.1, "weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"lr": 0.1, "nesterov": True}, "nesterov"),
        ({"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "dampening"),
    ],
)
def test_invalid_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedSGD(_params(), **kwargs)
