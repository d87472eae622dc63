"""FusedAdam against torch.optim.AdamW / Adam: fp32, bf16 with fp32 master weights, state dicts, capturable."""

import copy
import io
import warnings

import pytest
import torch

from transformer_engine.pytorch.optimizers import FusedAdam

SHAPES = [(1,), (7, 13), (127,), (3, 5, 2)]
STEPS = 5
HYPER = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6}
# float32: both compute the same formula in float32, only the association differs (torch divides
# sqrt(v) by sqrt(1 - b2^t), we take sqrt(v / (1 - b2^t))): a few ulps per step.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
# bf16 parameter = round(fp32 master): at most one bf16 ulp (2^-8 relative) from the rounded reference.
BF16_TOL = {"rtol": 2**-7, "atol": 1e-5}


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SHAPES]


def _set_grads(params, step, dtype=None):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=dtype or p.dtype)


def _reference(params, adam_w_mode, weight_decay):
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, weight_decay=weight_decay, foreach=False, **HYPER)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("capturable", [False, True])
def test_fp32_matches_torch(adam_w_mode, weight_decay, capturable):
    ours, ref = _params(), _params()
    opt = FusedAdam(ours, adam_w_mode=adam_w_mode, weight_decay=weight_decay, capturable=capturable, **HYPER)
    ref_opt = _reference(ref, adam_w_mode, weight_decay)
    for step in range(STEPS):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, **FP32_TOL)
    assert int(opt.param_groups[0]["step"]) == STEPS


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_bf16_master_weights_follow_fp32_reference(adam_w_mode):
    ours, ref = _params(torch.bfloat16), [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16)]
    opt = FusedAdam(ours, adam_w_mode=adam_w_mode, weight_decay=0.1, master_weights=True, **HYPER)
    ref_opt = _reference(ref, adam_w_mode, weight_decay=0.1)
    for step in range(STEPS):
        _set_grads(ours, step)
        for p, r in zip(ours, ref):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, r.detach(), **FP32_TOL)
            assert torch.equal(p.detach(), master.to(torch.bfloat16))
            torch.testing.assert_close(p.detach(), r.detach().to(torch.bfloat16), **BF16_TOL)


def test_bf16_moments():
    ours, ref = _params(), _params()
    opt = FusedAdam(ours, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    ref_opt = _reference(ref, adam_w_mode=True, weight_decay=0.0)
    for step in range(STEPS):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        # m and v carry a 2^-9 relative rounding, so each update m_hat / sqrt(v_hat) is off by ~2^-8:
        # after 5 steps of size <= lr the parameters differ by well under lr * 5 * 2^-8 = 2e-4.
        torch.testing.assert_close(p, r, rtol=0, atol=2e-4)


def _run(opt, params, steps, grad_dtype=None):
    for step in steps:
        _set_grads(params, step, grad_dtype)
        opt.step()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"capturable": True},
        {"master_weights": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    ],
)
def test_state_dict_round_trip_continues_identically(options):
    dtype = torch.bfloat16 if options.get("master_weights") else torch.float32
    straight, resumed = _params(dtype), _params(dtype)
    straight_opt = FusedAdam(straight, **options, **HYPER)
    _run(straight_opt, straight, range(6))

    first_opt = FusedAdam(resumed, **options, **HYPER)
    _run(first_opt, resumed, range(3))
    buffer = io.BytesIO()
    torch.save(first_opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert all(t.dtype == torch.float32 for state in saved["state"].values() for t in state.values())
    second_opt = FusedAdam(resumed, **options, **HYPER)
    second_opt.load_state_dict(saved)
    assert second_opt.state[resumed[0]]["exp_avg"].dtype == options.get("exp_avg_dtype", torch.float32)
    _run(second_opt, resumed, range(3, 6))
    for s, r in zip(straight, resumed):
        assert torch.equal(s, r)
    assert int(second_opt.param_groups[0]["step"]) == 6


def test_zero_grad():
    params = _params()
    opt = FusedAdam(params)
    _set_grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_zero_grad_deprecated_set_grad_none():
    params = _params()
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = FusedAdam(params, set_grad_none=False)
    _set_grads(params, 0)
    opt.zero_grad()
    assert all(p.grad is not None for p in params)
    with pytest.raises(ValueError, match="set_grad_none=False"):
        opt.zero_grad(set_to_none=True)


def test_decoupled_grad():
    ours = _params(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedAdam(ours, master_weights=True, use_decoupled_grad=True, **HYPER)
    ref_opt = _reference(ref, adam_w_mode=True, weight_decay=0.0)
    _set_grads(ref, 0)
    for p, r in zip(ours, ref):
        p.decoupled_grad = r.grad.clone()  # a float32 gradient for a bf16 parameter, .grad stays None
    opt.step()
    ref_opt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), **FP32_TOL)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in ours)


def test_groups_without_gradients_still_count_steps():
    used, unused = _params(), _params(seed=1)
    empty_tensor = torch.nn.Parameter(torch.empty(0))
    opt = FusedAdam([{"params": used + [empty_tensor]}, {"params": unused}, {"params": []}])
    for step in range(3):
        _set_grads(used, step)
        empty_tensor.grad = torch.empty(0)
        opt.step()
    assert [g["step"] for g in opt.param_groups] == [3, 3, 3]
    assert all(len(opt.state[p]) == 0 for p in unused)


def test_non_finite_gradient_propagates_like_te_without_capturable():
    # TE's non-capturable kernel ignores the no-op flag ("propagate infs/nans"): skipping is GradScaler's job.
    params = _params()
    opt = FusedAdam(params)
    _set_grads(params, 0)
    params[0].grad[0] = float("nan")
    opt.step()
    assert torch.isnan(params[0]).all() and opt.param_groups[0]["step"] == 1


@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_skips_non_finite_steps(capturable):
    ours, ref = _params(), _params()
    opt = FusedAdam(ours, capturable=capturable, **HYPER)
    ref_opt = torch.optim.AdamW(ref, weight_decay=0.0, foreach=False, **HYPER)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for step in range(4):
        for params, scaler, optimizer in ((ours, scalers[0], opt), (ref, scalers[1], ref_opt)):
            loss = sum((p * p).sum() for p in params)
            if step == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # GradScaler passing itself as grad_scaler
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, **FP32_TOL)
    assert int(opt.param_groups[0]["step"]) == 3  # the non-finite step did not count
    if capturable:
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_unsupported_options_name_the_option():
    params = _params()
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="master_weight_dtype"):
        FusedAdam(params, master_weights=True, master_weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):
        FusedAdam(params, exp_avg_sq_dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="capturable"):
        FusedAdam(params, exp_avg_dtype=torch.uint8, capturable=True)
    with pytest.warns(UserWarning, match="store_param_remainders"):
        opt = FusedAdam(params, master_weights=True, store_param_remainders=True)
    with pytest.raises(NotImplementedError, match="int16"):
        opt.set_scaled_state(params[0], "master_param", torch.zeros(params[0].shape, dtype=torch.int16))
    params[0].grad = torch.ones(params[0].shape).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_megatron_state_accessors():
    params = _params(torch.bfloat16)
    opt = FusedAdam(params, master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt.initialize_state(params[1])
    state = opt.state[params[1]]
    assert state["exp_avg"].dtype == torch.bfloat16 and torch.equal(state["master_param"], params[1].detach().float())
    assert opt.get_unscaled_state(params[1], "exp_avg").dtype == torch.float32
    assert opt.get_unscaled_state(params[1], "exp_avg", skip_unscale=True) is state["exp_avg"]
    master = torch.full(params[1].shape, 0.25)
    opt.set_scaled_state(params[1], "master_param", master)
    assert torch.equal(opt.get_unscaled_state(params[1], "master_param"), master)
    copy.deepcopy(opt.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("master_weights", [False, True])
def test_on_gpu_matches_torch(master_weights):
    """On a GPU the step runs the flagos multi-tensor kernel: the same values as torch's AdamW."""
    dtype = torch.bfloat16 if master_weights else torch.float32
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in _params(dtype)]
    ref = [torch.nn.Parameter(p.detach().float().cuda()) for p in _params(dtype)]
    opt = FusedAdam(ours, weight_decay=0.1, master_weights=master_weights, **HYPER)
    ref_opt = torch.optim.AdamW(ref, weight_decay=0.1, foreach=False, **HYPER)
    for step in range(STEPS):
        _set_grads(ours, step)
        for p, r in zip(ours, ref):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref):
        if master_weights:
            torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), **FP32_TOL)
            torch.testing.assert_close(p.detach(), r.detach().to(torch.bfloat16), **BF16_TOL)
        else:
            torch.testing.assert_close(p.detach(), r.detach(), **FP32_TOL)


SCALED = {"fp16 master": {"master_weights": True, "master_weight_dtype": torch.float16},
          "fp16 moments": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16},
          "fp8 moments": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}}


@pytest.mark.parametrize("options", list(SCALED.values()), ids=list(SCALED))
def test_scaled_states_step_as_their_float32_values_and_store_back(options):
    """Each step equals a float32 FusedAdam step taken from the stored (scaled) states' values, after which each
    state holds the new values rounded with its new scale max|x| / range (NVIDIA TE's scaled states)."""
    from transformer_engine.pytorch.optimizers._scaled_state import SCALED_DTYPES

    torch.manual_seed(3)
    params = _params(torch.float32)
    opt = FusedAdam(params, **options, **HYPER)
    names = [n for n, d in opt.name_to_dtype_map.items() if d in SCALED_DTYPES and (n != "master_param" or opt.master_weights)]
    for p in params:
        opt.initialize_state(p)  # zero moments; the master, if any, is the parameter stored with its scale
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        ref = [torch.nn.Parameter((opt.get_unscaled_state(p, "master_param") if opt.master_weights else p.detach()).clone())
               for p in params]
        ref_opt = FusedAdam(ref, **HYPER)
        for r, p in zip(ref, params):
            r.grad = p.grad.clone()
            ref_opt.state[r] = {"exp_avg": opt.get_unscaled_state(p, "exp_avg").clone(),  # the float32 values of the states
                                "exp_avg_sq": opt.get_unscaled_state(p, "exp_avg_sq").clone()}
        ref_opt.param_groups[0]["step"] = step
        opt.step()
        ref_opt.step()
        for p, r in zip(params, ref):
            for name in names:
                values = r.detach() if name == "master_param" else ref_opt.state[r][name]
                dtype = opt.name_to_dtype_map[name]
                scale = values.abs().max() / SCALED_DTYPES[dtype]
                assert torch.equal(opt._scales[p][name], scale.reshape(1)), name
                expected = (values / scale).half().float() * scale if dtype == torch.float16 else values
                # E4M3: half a step of its 3 mantissa bits, and of its subnormal spacing 2^-9 (in units of the scale)
                tol = {} if dtype == torch.float16 else {"rtol": 2**-4, "atol": scale.item() * 2**-10}
                torch.testing.assert_close(opt.get_unscaled_state(p, name), expected, **tol)
            torch.testing.assert_close(p.detach(), r.detach(), **FP32_TOL)  # the parameter: the master's new values


def test_scaled_states_checkpoint_in_float32_and_load_back():
    torch.manual_seed(4)
    params = _params(torch.float32)
    opt = FusedAdam(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16, **HYPER)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    assert all(v.dtype == torch.float32 for state in saved["state"].values() for v in state.values())
    again = FusedAdam(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16, **HYPER)
    again.load_state_dict(copy.deepcopy(saved))
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(again.get_unscaled_state(p, name), opt.get_unscaled_state(p, name))
