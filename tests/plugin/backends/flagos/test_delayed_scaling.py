"""flagos delayed-scaling updates vs the reference backend, bit for bit: delayed_scaling_update, the in-place
delayed_scaling_update_ and delayed_scaling_update_many_ (the casts: test_quantization.py).

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py).
"""

import math

import pytest
import torch

from tests.plugin.backends.reference.test_delayed_scaling import amaxes_to_fold, five_step_update, fold_then_update
from transformer_engine.plugin.backends.flagos import delayed_scaling as fd
from transformer_engine.plugin.backends.reference import quantization as ref


# ---------------------------------------------------------------- delayed scaling update


def _histories(length, n, device):
    """H [L, N] over 40 decades (tiny amaxes overflow fp8_max / amax) with zeros, inf and NaN; s [N] > 0."""
    history = torch.rand(length, n) * 10.0 ** (torch.rand(length, n) * 40 - 20)
    pick = torch.rand(length, n)
    history[pick < 0.1] = 0.0
    history[(pick >= 0.1) & (pick < 0.15)] = math.inf
    history[(pick >= 0.15) & (pick < 0.2)] = math.nan
    return history.to(device), (torch.rand(n) * 4).to(device)


def _assert_bitwise_equal(actual, expected):
    """Same float32 bit patterns (NaN payloads and the sign of zero included)."""
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.cpu().view(torch.int32), expected.cpu().view(torch.int32))


def _assert_same_update(history, scale, fp8_max, margin, algo):
    actual = fd.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    expected = ref.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    for got, want in zip(actual, expected):
        _assert_bitwise_equal(got, want)


def _fp8_max_forms(n, device):
    """(margin, fp8_max): a float, a float32 [N] vector and a one-element tensor; margins 0 and 2."""
    return ((0.0, 448.0), (2.0, torch.rand(n, device=device) * 6e4), (2.0, torch.tensor([57344.0], device=device)))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("length", [1, 16])
def test_delayed_scaling_update_bit_exact(length, n, algo, device):
    history, scale = _histories(length, n, device)
    for margin, fp8_max in _fp8_max_forms(n, device):
        _assert_same_update(history, scale, fp8_max, margin, algo)


def test_delayed_scaling_update_edge_values(device):
    # amax 0, subnormal (s overflows to float32 max), normal, inf, NaN, negative; an infinite old
    # scale kept by an invalid amax also becomes float32 max; a non-integer margin
    row0 = torch.tensor([0.0, 1e-40, 3.0, math.inf, math.nan, -2.0, 0.0, 5.0])
    history = torch.stack([row0, torch.rand(8), torch.rand(8) * 10]).to(device)
    scale = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, math.inf, 0.5], device=device)
    for algo in ("max", "most_recent"):
        _assert_same_update(history, scale, 448.0, 0.3, algo)
    new_history, new_scale = fd.delayed_scaling_update(history, scale, 448.0, 1.0, "most_recent")
    fp32_max = torch.finfo(torch.float32).max
    assert torch.equal(new_scale[[0, 1, 2, 3, 6]].cpu(), torch.tensor([2.0, fp32_max, 448.0 / 3.0 / 2.0, 2.0, fp32_max]))
    _assert_bitwise_equal(new_history, torch.cat([torch.zeros(1, 8, device=device), history[[2, 0]]]))


def test_delayed_scaling_update_strided_and_low_precision_inputs(device):
    wide, scale = _histories(5, 22, device)
    history = wide[:, ::2]  # column stride 2
    _assert_same_update(history, scale[:11].bfloat16(), 448.0, 0.0, "max")
    _assert_same_update(history.t().contiguous().t(), scale[:11], torch.full((11,), 57344.0, dtype=torch.float64), 2.0, "max")
    _assert_same_update(history.bfloat16(), scale[:11], 448.0, 0.0, "most_recent")


def test_delayed_scaling_update_empty_errors_and_supports(device):
    new_history, new_scale = fd.delayed_scaling_update(torch.zeros(3, 0, device=device), torch.ones(0, device=device), 448.0, 0.0, "max")
    assert new_history.shape == (3, 0) and new_scale.shape == (0,)
    history, scale = torch.zeros(2, 3, device=device), torch.ones(3, device=device)
    with pytest.raises(ValueError, match="most_recent"):
        fd.delayed_scaling_update(history, scale, 448.0, 0.0, "mean")
    with pytest.raises(ValueError, match=r"needs \[3\]"):
        fd.delayed_scaling_update(history, scale[:2], 448.0, 0.0, "max")
    with pytest.raises(ValueError, match="fp8_max"):
        fd.delayed_scaling_update(history, scale, torch.ones(2), 0.0, "max")
    with pytest.raises(ValueError, match="margin"):
        fd.delayed_scaling_update(history, scale, 448.0, math.inf, "max")
    supports = fd.SUPPORTS["delayed_scaling_update"]
    verdict = supports(history, torch.ones(3, device="meta"), 448.0, 0.0, "max")
    assert not verdict and "device" in verdict.reason
    assert supports(history, scale, 448.0, 0.0, "max")


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_large_gpu(algo):
    history, scale = _histories(1024, 4096, "cuda")
    history[0, :4] = torch.tensor([1e-40, 1e-38, 0.0, 2.0**-149])  # subnormal amaxes: no flush to zero
    for margin, fp8_max in _fp8_max_forms(4096, "cuda"):
        _assert_same_update(history, scale, fp8_max, margin, algo)


def _idle_histories(length, n, device):
    """``_histories`` whose row 0 also holds idle columns (0, -0.0), NaN, inf, tiny and subnormal amaxes."""
    history, scale = _histories(length, n, device)
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, 1e-40, 2.0**-149, 1e-38, 3.0], device=device)
    history[0, : min(n, 8)] = special[: min(n, 8)]
    history[0, 8::3] = 0.0  # more idle columns among the random ones
    return history, scale


def _assert_same_update_(history, scale, scale_inv, fp8_max, margin, algo):
    """fd.delayed_scaling_update_ in place on (H, s, scale_inv) gives the 5-step sequence bit for bit."""
    expected = five_step_update(history, scale, fp8_max, margin, algo)
    assert fd.delayed_scaling_update_(history, scale, scale_inv, fp8_max, margin, algo) is None
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("length", [1, 2, 16, 31])
def test_delayed_scaling_update_in_place_bit_exact(length, n, algo, device):
    for margin, fp8_max in _fp8_max_forms(n, device):
        history, scale = _idle_histories(length, n, device)
        before = history.clone()
        _assert_same_update_(history, scale, torch.empty(n, device=device), fp8_max, margin, algo)
        idle = before[0] == 0
        _assert_bitwise_equal(history[:, idle], before[:, idle])  # idle columns untouched


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_in_place_long_history(algo, device):
    history, scale = _idle_histories(1024, 37, device)
    _assert_same_update_(history, scale, torch.empty(37, device=device), 448.0, 0.0, algo)


def test_delayed_scaling_update_in_place_strided(device):
    wide, scale_buf = _idle_histories(9, 24, device)
    wide_before, inv_buf = wide.clone(), torch.full((24,), 7.0, device=device)
    history, scale, scale_inv = wide[:, 3:14], scale_buf[:22:2], inv_buf[1::2][:11]  # a column slice, stride-2 vectors
    _assert_same_update_(history, scale, scale_inv, torch.rand(11, device=device) * 6e4, 2.0, "max")
    for outside in (slice(0, 3), slice(14, None)):
        _assert_bitwise_equal(wide[:, outside], wide_before[:, outside])
    assert torch.all(inv_buf[::2] == 7.0)
    history_t = _idle_histories(5, 11, device)[0].t().contiguous().t()  # column-major H
    _assert_same_update_(history_t, scale.clone(), torch.empty(11, device=device), 448.0, 0.0, "most_recent")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length, n", [(1, 7), (31, 300), (1024, 37)])
def test_delayed_scaling_update_in_place_folds_amax(length, n, algo, device):
    """``amax`` folded into H[0] in the kernel (NaN from either side, idle slots in both) gives the fold by
    torch.maximum then the reference's update, bit for bit, and leaves amax as it was; strided amax too."""
    history, scale = _idle_histories(length, n, device)
    wide = amaxes_to_fold(2 * n).to(device)
    amax = wide[::2]
    expected, wide_before = fold_then_update(history, scale, amax, 448.0, 1.0, algo), wide.clone()
    scale_inv = torch.empty(n, device=device)
    assert fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 1.0, algo, amax=amax) is None
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)
    _assert_bitwise_equal(wide, wide_before)
    verdict = fd.SUPPORTS["delayed_scaling_update_"](history, scale, scale_inv, 448.0, 0.0, "max", torch.ones(n, device="meta"))
    assert not verdict and "amax" in verdict.reason


@pytest.mark.parametrize("k", [1, 3, 37])
def test_delayed_scaling_update_in_place_folds_the_amaxes_of_the_first_k_columns(k, device):
    """``amax`` [K <= N] (a traced backward hands one grad cast's amax over as [1]): the reference's update
    bit for bit, columns K.. untouched by the fold, over more than one program's columns."""
    history, scale = _idle_histories(16, 37, device)
    amax = amaxes_to_fold(k).to(device)
    # no NaN in row 0 or amax: which NaN torch.maximum keeps depends on its CPU vector path; the NaN rule
    # of the fold is test_delayed_scaling_update_in_place_folds_amax's
    history[0] = torch.nan_to_num(history[0], nan=5.0)
    amax = torch.nan_to_num(amax, nan=7.0)
    expected = fold_then_update(history, scale, amax, 448.0, 0.0, "max")
    scale_inv = torch.empty(37, device=device)
    fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "max", amax=amax)
    for got, want in zip((history, scale, scale_inv), expected):
        _assert_bitwise_equal(got, want)


def test_delayed_scaling_update_in_place_empty_errors_and_supports(device):
    empty = (torch.zeros(3, 0, device=device), torch.ones(0, device=device), torch.ones(0, device=device))
    assert fd.delayed_scaling_update_(*empty, 448.0, 0.0, "max") is None
    history, scale = _idle_histories(2, 3, device)
    scale_inv, before = torch.empty(3, device=device), (history.clone(), scale.clone())
    bad = [
        ((history, scale, scale_inv.double()), TypeError, "scale_inv has dtype torch.float64"),
        ((history.bfloat16(), scale, scale_inv), TypeError, "amax_history has dtype"),
        ((history, scale.half(), scale_inv), TypeError, "must be float32"),
        ((history, scale, scale_inv[:2]), ValueError, r"scale_inv has shape \(2,\).*needs \[3\]"),
        ((history, scale[:2], scale_inv), ValueError, r"needs \[3\]"),
        ((history, scale, torch.empty(3, device="meta")), ValueError, "device"),
        ((history, scale, [1.0, 1.0, 1.0]), TypeError, "scale_inv must be a torch.Tensor"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            fd.delayed_scaling_update_(*args, 448.0, 0.0, "max")
    with pytest.raises(ValueError, match="most_recent"):
        fd.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "mean")
    _assert_bitwise_equal(history, before[0])  # checked before any work
    _assert_bitwise_equal(scale, before[1])
    supports = fd.SUPPORTS["delayed_scaling_update_"]
    verdict = supports(history, scale, torch.ones(3, device="meta"), 448.0, 0.0, "max")
    assert not verdict and "scale_inv" in verdict.reason
    assert supports(history, scale, scale_inv, 448.0, 0.0, "max")


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_in_place_large_gpu(algo):
    history, scale = _idle_histories(1024, 4096, "cuda")
    for margin, fp8_max in _fp8_max_forms(4096, "cuda"):
        _assert_same_update_(history.clone(), scale.clone(), torch.empty(4096, device="cuda"), fp8_max, margin, algo)


# ---------------------------------------------------------------- delayed_scaling_update_many_


def _states_of_a_step(device):
    """(H, s, scale_inv) of five modules as one step leaves them: L 16 or 1, N 3 to 300 (several column
    blocks), idle and non-finite amaxes, and one state of strided views into larger buffers."""
    states = []
    for length, n in ((16, 3), (16, 6), (1, 5), (16, 300)):
        history, scale = _idle_histories(length, n, device)
        states.append((history, scale, torch.empty(n, device=device)))
    wide, scale_buf = _idle_histories(7, 30, device)
    states.append((wide[:, 4:12], scale_buf[:16:2], torch.empty(16, device=device)[1::2]))
    return states


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_many_is_each_state_update(algo, device):
    """One call updates every state exactly as the reference backend's delayed_scaling_update_ on each does, bit
    for bit, again on a second step (the cached table) and on new tensors of the same shapes (a new table)."""
    for states in (_states_of_a_step(device), _states_of_a_step(device)):
        for step in range(2):
            expected = [tuple(t.clone() for t in state) for state in states]
            for state in expected:
                ref.delayed_scaling_update_(*state, 448.0, 1.0, algo)
            assert fd.delayed_scaling_update_many_(*map(list, zip(*states)), 448.0, 1.0, algo) is None
            for got, want in zip(states, expected):
                for g, w in zip(got, want):
                    _assert_bitwise_equal(g, w)
            for history, _, _ in states:  # new amaxes for the next step
                history[0] = torch.rand_like(history[0]) * 100


def test_delayed_scaling_update_many_errors_before_any_work(device):
    states = _states_of_a_step(device)[:2]
    histories, scales, scale_invs = map(list, zip(*states))
    fd.delayed_scaling_update_many_(histories[:1], scales[:1], scale_invs[:1], 448.0, 0.0, "max")  # a cached table of state 0
    before = [tuple(t.clone() for t in state) for state in states]
    bad = [
        ((histories, scales[:1], scale_invs, 448.0), ValueError, "pass one of each per state"),
        ((histories, scales, scale_invs[:1], 448.0), ValueError, "pass one of each per state"),
        ((histories, scales, scale_invs, torch.tensor(448.0)), TypeError, "one float for every state"),
        (([histories[0]] * 2, [scales[0], scales[0].clone()], [scale_invs[0], scale_invs[0].clone()], 448.0), ValueError, "share memory"),
        ((histories, [scales[0], scales[1].double()], scale_invs, 448.0), TypeError, "must be float32"),
    ]
    for (h, s, i, fp8_max), error, match in bad:
        with pytest.raises(error, match=match):
            fd.delayed_scaling_update_many_(h, s, i, fp8_max, 0.0, "max")
    for got, want in zip(states, before):
        for g, w in zip(got, want):
            _assert_bitwise_equal(g, w)
