"""flagos multi-tensor Adam / scale / L2 norm vs the reference backend, mixed dtypes in one call."""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import assert_close
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import optimizer as fo
from transformer_engine.plugin.backends.reference import optimizer as ref

# odd and empty sizes, a size that is a multiple of 16 (the vector-aligned group), mixed dtypes
SIZES = [(7,), (33, 5), (0,), (4099,), (32,)]
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32]
CHUNK = 2048  # small chunks: the 4099-element tensor spans three programs


def _flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def _adam_lists(device):
    grads = [randn(*s, dtype=d, device=device) for s, d in zip(SIZES, PARAM_DTYPES)]
    params = [randn(*s, dtype=d, device=device) for s, d in zip(SIZES, PARAM_DTYPES)]
    exp_avgs = [randn(*s, device=device) for s in SIZES]
    exp_avg_sqs = [torch.rand(s, device=device) + 0.1 for s in SIZES]
    return [grads, params, exp_avgs, exp_avg_sqs]


def _clone(tensor_lists):
    return [[t.clone() for t in lst] for lst in tensor_lists]


@pytest.mark.parametrize("mode, bias_correction", [(0, True), (1, True), (1, False)])
def test_adam(mode, bias_correction, device):
    lists = _adam_lists(device)
    expected = _clone(lists)
    args = (1e-3, 0.9, 0.999, 1e-8, 3, mode, bias_correction, 0.01)
    fo.multi_tensor_adam(CHUNK, _flag(device), lists, *args)
    ref.multi_tensor_adam(CHUNK, _flag(device), expected, *args)
    for actual_list, expected_list in zip(lists[1:], expected[1:]):
        for actual, want in zip(actual_list, expected_list):
            assert_close(actual, want)


def test_adam_noop_flag_skips_everything(device):
    lists = _adam_lists(device)
    before = _clone(lists)
    fo.multi_tensor_adam(CHUNK, _flag(device, 1), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, bias_correction=True, weight_decay=0.0)
    assert all(torch.equal(a, b) for la, lb in zip(lists, before) for a, b in zip(la, lb))


def test_scale_and_non_finite_flag(device):
    inputs = [randn(*s, dtype=d, device=device) for s, d in zip(SIZES, PARAM_DTYPES)]
    outputs = [torch.empty(s, device=device) for s in SIZES]
    expected = [torch.empty(s, device=device) for s in SIZES]
    flag = _flag(device)
    fo.multi_tensor_scale(CHUNK, flag, [inputs, outputs], 0.37)
    ref.multi_tensor_scale(CHUNK, _flag(device), [inputs, expected], 0.37)
    assert flag.item() == 0
    for actual, want in zip(outputs, expected):
        assert torch.equal(actual, want)  # one float32 product on both sides
    inputs[3][4098] = math.inf
    fo.multi_tensor_scale(CHUNK, flag, [inputs, outputs], 0.37)
    assert flag.item() == 1 and outputs[3][4098].item() == math.inf


@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm(per_tensor, device):
    tensors = [randn(*s, dtype=d, device=device) for s, d in zip(SIZES, PARAM_DTYPES)]
    flag = _flag(device)
    total, per = fo.multi_tensor_l2norm(CHUNK, flag, [tensors], per_tensor)
    total_ref, per_ref = ref.multi_tensor_l2norm(CHUNK, _flag(device), [tensors], per_tensor)
    assert flag.item() == 0 and total.shape == (1,)
    assert_close(total, total_ref, reduction=True)
    assert_close(per, per_ref, reduction=True)
    tensors[0][3] = math.nan
    fo.multi_tensor_l2norm(CHUNK, flag, [tensors], per_tensor)
    assert flag.item() == 1


def test_errors_and_supports(device):
    with pytest.raises(ValueError, match="equal sizes"):
        fo.multi_tensor_scale(CHUNK, _flag(device), [[randn(3, device=device)], [randn(4, device=device)]], 1.0)
    with pytest.raises(ValueError, match="mode"):
        fo.multi_tensor_adam(CHUNK, _flag(device), _adam_lists(device), 1e-3, 0.9, 0.999, 1e-8, 1, 2, bias_correction=True,
                             weight_decay=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        x = randn(4, 4, device=device).t()
        fo.multi_tensor_scale(CHUNK, _flag(device), [[x], [torch.empty_like(x)]], 1.0)
    verdict = fo.SUPPORTS["multi_tensor_scale"](CHUNK, torch.zeros(1, dtype=torch.int64, device=device), [[], []], 1.0)
    assert not verdict and "int32" in verdict.reason
    verdict = fo.SUPPORTS["multi_tensor_l2norm"](CHUNK, _flag(device), [[randn(4, 4, device=device).t()]])
    assert not verdict and "contiguous" in verdict.reason
    assert fo.SUPPORTS["multi_tensor_l2norm"](CHUNK, _flag(device), [[randn(4, 4, device=device)]])


@pytest.mark.gpu
def test_large_gpu():
    sizes = [(4096, 4096), (11008, 4096), (4096,), (17,)]
    lists = [[randn(*s, device="cuda") for s in sizes] for _ in range(3)] + [[torch.rand(s, device="cuda") for s in sizes]]
    expected = _clone(lists)
    fo.multi_tensor_adam(65536, _flag("cuda"), lists, 1e-3, 0.9, 0.999, 1e-8, 10, 1, bias_correction=True, weight_decay=0.1)
    ref.multi_tensor_adam(65536, _flag("cuda"), expected, 1e-3, 0.9, 0.999, 1e-8, 10, 1, bias_correction=True, weight_decay=0.1)
    for actual, want in zip(lists[1], expected[1]):
        assert_close(actual, want)
    total, _ = fo.multi_tensor_l2norm(65536, _flag("cuda"), [lists[0]], per_tensor=False)
    assert_close(total, ref.multi_tensor_l2norm(65536, _flag("cuda"), [lists[0]], per_tensor=False)[0], reduction=True)
