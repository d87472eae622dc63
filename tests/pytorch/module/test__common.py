"""The helpers shared by the modules' autograd Functions."""

import torch

from transformer_engine.pytorch.module._common import backward_frees_graph, no_torch_autocast, release
from transformer_engine.pytorch.quantization import Float8Tensor

_CPU = torch.device("cpu")


def test_no_torch_autocast_disables_an_active_autocast_and_restores_it():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with no_torch_autocast(_CPU):
            assert not torch.is_autocast_enabled("cpu")
            inside = torch.mm(a, b)
        outside = torch.mm(a, b)
        assert torch.is_autocast_enabled("cpu")
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, (a.double() @ b.double()).float())
    assert outside.dtype == torch.bfloat16


def test_no_torch_autocast_without_autocast_changes_nothing():
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    for _ in range(2):  # the shared context can be entered again
        with no_torch_autocast(_CPU):
            assert not torch.is_autocast_enabled("cpu")
            out = torch.mm(a, b)
    assert out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")


class _Probe(torch.autograd.Function):
    """Records what backward_frees_graph() says inside its backward."""

    seen = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        _Probe.seen.append(backward_frees_graph())
        return dy * 2


def test_backward_frees_graph_only_inside_a_backward_that_frees_it():
    assert not backward_frees_graph()  # outside any backward
    x = torch.randn(3, requires_grad=True)
    _Probe.seen.clear()
    y = _Probe.apply(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.autograd.grad(_Probe.apply(x).sum(), x)
    assert _Probe.seen == [False, True, True]


def test_release_frees_fp8_values_and_leaves_high_precision_tensors_alone():
    data, data_t, scale_inv = torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(8, 4, dtype=torch.float8_e4m3fn), torch.ones(())
    release(Float8Tensor(data, scale_inv, data_t))
    assert data.untyped_storage().nbytes() == 0 and data_t.untyped_storage().nbytes() == 0
    assert scale_inv.item() == 1.0  # shared with other operands: kept
    user_tensor = torch.ones(4, 8)
    release(user_tensor)
    assert torch.equal(user_tensor, torch.ones(4, 8))
