"""Reference delayed-scaling updates vs hand-computed steps and list simulations (the casts: test_quantization.py).

The step helpers here (five_step_update, fold_then_update, amaxes_to_fold) also serve the flagos tests.
"""

import math

import pytest
import torch

from tests.utils import dtype_tols
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference import IMPL_ID
from transformer_engine.plugin.backends.reference import quantization as ref
from transformer_engine.plugin.core import get_spec, with_preference, with_strict_mode

_FP32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------- delayed scaling


def test_delayed_scaling_hand_computed_steps():
    """L=3, N=2, margin 0, "max": history and scale written out by hand, step by step."""
    nan, inf = math.nan, math.inf
    steps = [  # (amaxes written into row 0, expected history after the update, expected scale)
        ([2.0, 0.0], [[0, 0], [0, 0], [2, 0]], [224.0, 1.0]),
        ([8.0, 4.0], [[0, 0], [2, 0], [8, 4]], [56.0, 112.0]),
        ([1.0, inf], [[0, 0], [8, 4], [1, inf]], [56.0, 112.0]),
        ([nan, 3.5], [[0, 0], [1, inf], [nan, 3.5]], [56.0, 112.0]),
        ([0.5, 2.0], [[0, 0], [nan, 3.5], [0.5, 2]], [56.0, 112.0]),
        ([0.0, 0.0], [[0, 0], [0.5, 2], [0, 0]], [56.0, 128.0]),
        ([0.0, 1.0], [[0, 0], [0, 0], [0, 1]], [896.0, 224.0]),
    ]
    history, scale = torch.zeros(3, 2), torch.ones(2)
    for amaxes, expected_history, expected_scale in steps:
        history[0] = torch.tensor(amaxes)
        history, scale = ref.delayed_scaling_update(history, scale, 448.0, 0.0, "max")
        torch.testing.assert_close(history, torch.tensor(expected_history, dtype=torch.float32), equal_nan=True)
        assert scale.tolist() == expected_scale


def test_delayed_scaling_most_recent_margin_and_tiny_amax():
    """L=2, N=3, margin 1, "most_recent", HYBRID per-slot fp8_max; tiny amax overflows to float32 max."""
    fp8_max = torch.tensor([448.0, 57344.0, 448.0])
    history, scale = torch.zeros(2, 3), torch.ones(3)
    history[0] = torch.tensor([7.0, 1e-40, 448.0])
    history, scale = ref.delayed_scaling_update(history, scale, fp8_max, 1.0, "most_recent")
    assert scale.tolist() == [32.0, _FP32_MAX, 0.5]
    assert history.tolist() == [[0.0, 0.0, 0.0], [7.0, float(torch.tensor(1e-40)), 448.0]]
    history[0] = torch.tensor([0.25, 2.0, math.nan])
    history, scale = ref.delayed_scaling_update(history, scale, fp8_max, 1.0, "most_recent")
    assert scale.tolist() == [896.0, 14336.0, 0.5]  # "most_recent" ignores the older 7.0; NaN keeps 0.5


def test_delayed_scaling_history_length_one():
    history, scale = torch.tensor([[3.5, 0.0]]), torch.tensor([2.0, 2.0])
    new_history, new_scale = ref.delayed_scaling_update(history, scale, 448.0, 2.0, "max")
    assert new_history.tolist() == [[0.0, 0.0]] and new_scale.tolist() == [32.0, 2.0]
    assert history.tolist() == [[3.5, 0.0]] and scale.tolist() == [2.0, 2.0]  # inputs untouched


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("margin", [0.0, 2.0])
def test_delayed_scaling_random_run_vs_list_simulation(algo, length, margin):
    n, fp8_max = 5, 57344.0
    history, scale = torch.zeros(length, n), torch.ones(n)
    sim_rows, sim_scale = [[0.0] * n for _ in range(length)], [1.0] * n
    for _ in range(6):
        amaxes = (torch.rand(n) * 100).tolist()
        history[0], sim_rows[0] = torch.tensor(amaxes), amaxes
        history, scale = ref.delayed_scaling_update(history, scale, fp8_max, margin, algo)
        for slot in range(n):
            column = [float(torch.tensor(row[slot], dtype=torch.float32)) for row in sim_rows]
            amax = max(column) if algo == "max" else column[0]
            if amax > 0:
                sim_scale[slot] = fp8_max / amax / 2.0**margin
        sim_rows = sim_rows[1:] + [sim_rows[0]]
        sim_rows[0] = [0.0] * n
        torch.testing.assert_close(history.double(), torch.tensor(sim_rows, dtype=torch.float64), **dtype_tols(torch.float32))
        torch.testing.assert_close(scale.double(), torch.tensor(sim_scale, dtype=torch.float64), **dtype_tols(torch.float32))


def test_delayed_scaling_in_place_hand_computed():
    """L=3, N=5, margin 1, "most_recent": active, idle (0), NaN (active: rolled, scale kept), idle (-0.0), subnormal."""
    nan = math.nan
    history = torch.tensor([[2.0, 0.0, nan, -0.0, 1e-40], [5.0] * 5, [7.0] * 5])
    scale, scale_inv = torch.tensor([2.0, 4.0, 8.0, 0.5, 1.0]), torch.zeros(5)
    assert ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 1.0, "most_recent") is None
    expected_history = [[0.0, 0.0, 0.0, -0.0, 0.0], [7.0, 5.0, 7.0, 5.0, 7.0], [2.0, 7.0, nan, 7.0, float(torch.tensor(1e-40))]]
    torch.testing.assert_close(history, torch.tensor(expected_history), rtol=0, atol=0, equal_nan=True)
    assert math.copysign(1.0, history[0, 3].item()) == -1.0  # the idle -0.0 is not rewritten
    assert scale.tolist() == [112.0, 4.0, 8.0, 0.5, _FP32_MAX]
    assert torch.equal(scale_inv, torch.tensor([1 / 112.0, 0.25, 0.125, 2.0, 1 / _FP32_MAX], dtype=torch.float32))


def _idle_histories(length, n):
    """H [L, N] over 40 decades with zeros, inf and NaN; row 0 starts with idle (0, -0.0), NaN, inf, tiny,
    subnormal amaxes, then every third column idle; s [N] > 0."""
    history = torch.rand(length, n) * 10.0 ** (torch.rand(length, n) * 40 - 20)
    pick = torch.rand(length, n)
    history[pick < 0.1], history[pick > 0.95] = math.inf, math.nan
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, 1e-40, 2.0**-149, 1e-38, 3.0])
    history[0, : min(n, 8)] = special[: min(n, 8)]
    history[0, 8::3] = 0.0
    return history, torch.rand(n) * 4


def five_step_update(history, scale, fp8_max, margin, algo):
    """(H, s, scale_inv) of the 5-launch sequence delayed_update ran before: op, bool, 2 where, reciprocal."""
    history, scale, scale_inv = history.clone(), scale.clone(), torch.empty_like(scale)
    new_history, new_scale = ref.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    active = history[0].bool()
    torch.where(active, new_history, history, out=history)
    torch.where(active, new_scale, scale, out=scale)
    torch.reciprocal(scale, out=scale_inv)
    return history, scale, scale_inv


def _assert_in_place_is_five_steps(history, scale, scale_inv, fp8_max, margin, algo):
    """delayed_scaling_update_ equals delayed_scaling_update, bool, two where and reciprocal, bit for bit."""
    h, s, s_inv = five_step_update(history, scale, fp8_max, margin, algo)
    ref.delayed_scaling_update_(history, scale, scale_inv, fp8_max, margin, algo)
    for got, want in ((history, h), (scale, s), (scale_inv, s_inv)):
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("length", [1, 2, 16, 31])
def test_delayed_scaling_in_place_is_the_five_step_sequence(length, n, algo):
    for margin, fp8_max in ((0.0, 448.0), (2.0, torch.rand(n) * 6e4), (2.0, torch.tensor([57344.0]))):
        history, scale = _idle_histories(length, n)
        _assert_in_place_is_five_steps(history, scale, torch.empty(n), fp8_max, margin, algo)


def test_delayed_scaling_in_place_long_and_strided():
    history, scale = _idle_histories(1024, 9)
    _assert_in_place_is_five_steps(history, scale, torch.empty(9), 448.0, 0.0, "max")
    wide, scale_buf = _idle_histories(6, 22)
    wide_before, inv_buf = wide.clone(), torch.full((22,), 7.0)
    _assert_in_place_is_five_steps(wide[:, 4:15], scale_buf[::2], inv_buf[::2], 448.0, 1.0, "most_recent")
    for outside in (slice(0, 4), slice(15, None)):
        assert torch.equal(wide[:, outside].view(torch.int32), wide_before[:, outside].view(torch.int32))
    assert torch.all(inv_buf[1::2] == 7.0)


def fold_then_update(history, scale, amax, fp8_max, margin, algo):
    """(H, s, scale_inv) of H[0, :K] = max(H[0, :K], amax [K]) by torch.maximum, then the 5-step sequence."""
    history, k = history.clone(), amax.shape[0]
    history[0, :k] = torch.maximum(history[0, :k], amax)
    return five_step_update(history, scale, fp8_max, margin, algo)


def amaxes_to_fold(n):
    """float32 [n] amaxes over 40 decades with idle (0), NaN, inf and a subnormal among them."""
    amax = torch.rand(n) * 10.0 ** (torch.rand(n) * 40 - 20)
    amax[::4] = 0.0
    amax[: min(n, 4)] = torch.tensor([math.nan, math.inf, 1e-40, 0.0])[: min(n, 4)]
    return amax


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length, n", [(1, 7), (16, 300), (1024, 9)])
def test_delayed_scaling_in_place_folds_amax_first(length, n, algo):
    """``amax``: H[0] = max(H[0], amax) (NaN from either side), then the update, bit for bit; amax untouched."""
    history, scale = _idle_histories(length, n)
    amax = amaxes_to_fold(n)
    expected, amax_before = fold_then_update(history, scale, amax, 448.0, 1.0, algo), amax.clone()
    scale_inv = torch.empty(n)
    ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 1.0, algo, amax=amax)
    for got, want in zip((history, scale, scale_inv), expected):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(amax.view(torch.int32), amax_before.view(torch.int32))


@pytest.mark.parametrize("k", [1, 5])
def test_delayed_scaling_in_place_folds_the_amaxes_of_the_first_k_columns(k):
    """``amax`` [K < N]: columns 0..K-1 folded, columns K.. left as they are (their -0.0 too), then the update."""
    history, scale = _idle_histories(8, 9)
    amax = amaxes_to_fold(k)
    expected = fold_then_update(history, scale, amax, 448.0, 0.0, "max")
    scale_inv = torch.empty(9)
    ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "max", amax=amax)
    for got, want in zip((history, scale, scale_inv), expected):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_delayed_scaling_in_place_amax_hand_computed():
    """H[0] = [2, 0, 0], amax = [1, 0, 4]: slot 0 keeps its 2, slot 1 stays idle, slot 2 becomes active with 4."""
    history, scale, scale_inv = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), torch.ones(3), torch.empty(3)
    ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "most_recent", amax=torch.tensor([1.0, 0.0, 4.0]))
    assert history.tolist() == [[0.0, 0.0, 0.0], [2.0, 1.0, 4.0]]
    assert scale.tolist() == [224.0, 1.0, 112.0]


def test_delayed_scaling_in_place_rejects_a_bad_amax_before_any_work():
    history, scale, scale_inv = torch.tensor([[2.0, 0.0]]), torch.ones(2), torch.zeros(2)
    bad = [
        (torch.ones(3), ValueError, r"amax has shape \(3,\).*needs \[K\] with 0 < K <= 2"),
        (torch.ones(0), ValueError, r"amax has shape \(0,\).*0 < K <= 2"),
        (torch.ones(1, 2), ValueError, r"amax has shape \(1, 2\)"),
        (torch.ones(2, dtype=torch.float16), TypeError, "amax has dtype torch.float16"),
        (torch.ones(2, device="meta"), ValueError, "amax is on meta"),
        ([1.0, 2.0], TypeError, "amax must be a torch.Tensor"),
    ]
    for amax, error, match in bad:
        with pytest.raises(error, match=match):
            ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "max", amax=amax)
    assert history.tolist() == [[2.0, 0.0]] and scale.tolist() == [1.0, 1.0]


def test_delayed_scaling_in_place_is_one_in_place_op():
    spec = get_spec("delayed_scaling_update_")
    assert spec.inplace and spec.key_param == "amax_history"
    history, scale, scale_inv = torch.tensor([[2.0, 0.0]]), torch.ones(2), torch.zeros(2)
    with with_preference("reference"), with_strict_mode():
        assert ops.delayed_scaling_update_.traced(history, scale, scale_inv, 448.0, 0.0, "max")[1].impl_id == IMPL_ID
    assert history.tolist() == [[0.0, 0.0]] and scale.tolist() == [224.0, 1.0]
    assert torch.equal(scale_inv, torch.tensor([1 / 224.0, 1.0], dtype=torch.float32))


# ---------------------------------------------------------------- errors


def _update_(history, scale, scale_inv):
    """ref.delayed_scaling_update_ with fp8_max 448, margin 0, "max" (the error table's calls)."""
    return ref.delayed_scaling_update_(history, scale, scale_inv, 448.0, 0.0, "max")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ref.delayed_scaling_update(torch.zeros(2, 3), torch.ones(3), 448.0, 0.0, "mean"), ValueError, "most_recent"),
        (lambda: ref.delayed_scaling_update(torch.zeros(2, 3), torch.ones(2), 448.0, 0.0, "max"), ValueError, r"needs \[3\]"),
        (lambda: _update_(torch.ones(2, 3), torch.ones(3), torch.ones(3).half()), TypeError, "scale_inv has dtype torch.float16"),
        (lambda: _update_(torch.ones(2, 3).double(), torch.ones(3), torch.ones(3)), TypeError, "float32"),
        (lambda: _update_(torch.ones(2, 3), torch.ones(3), torch.ones(4)), ValueError, r"scale_inv has shape \(4,\)"),
        (lambda: _update_(torch.ones(2, 3), torch.ones(2), torch.ones(3)), ValueError, r"needs \[3\]"),
        (lambda: _update_(torch.ones(2, 3), torch.ones(3), torch.ones(3, device="meta")), ValueError, "device"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
