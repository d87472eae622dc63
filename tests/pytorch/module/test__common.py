"""The helpers shared by the modules' autograd Functions."""

import torch

from transformer_engine.pytorch.module._common import no_torch_autocast

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
