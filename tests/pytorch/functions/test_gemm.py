"""The GEMM wrapper of the autograd Functions: an FP8 operand stored both ways reaches ops.gemm in the TN layout, same result."""

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin import ops
from transformer_engine.pytorch._functions import gemm as _gemm
from transformer_engine.pytorch.quantization import Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(rows, cols, dtype=E4M3):
    q, scale_inv, _ = ops.quantize(randn(rows, cols), torch.tensor(32.0), dtype)
    return Float8Tensor(q, scale_inv)


class _Spy:
    """Records the (trans_a, trans_b) of every ops.gemm call and forwards it."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = ops.gemm

        def gemm(a, b, *, trans_a, trans_b, **rest):
            self.calls.append((trans_a, trans_b))
            return real(a, b, trans_a=trans_a, trans_b=trans_b, **rest)

        monkeypatch.setattr(_gemm, "ops", type("Ops", (), {"gemm": staticmethod(gemm)}))


@pytest.mark.parametrize("name, a_shape, b_shape, trans_a, trans_b", [
    ("fprop", (48, 32), (16, 32), False, True),   # x @ W^T
    ("dgrad", (48, 16), (16, 32), False, False),  # dy @ W
    ("wgrad", (48, 16), (48, 32), True, False),   # dy^T @ x
])
def test_both_layouts_give_tn_and_the_same_product(monkeypatch, name, a_shape, b_shape, trans_a, trans_b):
    a, b = _fp8(*a_shape, E5M2 if name != "fprop" else E4M3), _fp8(*b_shape)
    expected = _gemm.gemm(a, b, trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
    spy = _Spy(monkeypatch)
    got = _gemm.gemm(a.with_transpose(), b.with_transpose(), trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
    only_t = _gemm.gemm(a.transpose_only(), b.transpose_only(), trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
    assert spy.calls[0] == (False, True)  # op(a) row-major, op(b) column-major
    assert spy.calls[1] == (not trans_a, not trans_b)  # only the transposes: the flags flip, the matrix does not
    assert torch.equal(got, expected) and torch.equal(only_t, expected)


def test_high_precision_operands_pass_unchanged(monkeypatch):
    spy = _Spy(monkeypatch)
    a, b = randn(8, 4), randn(8, 6)
    got = _gemm.gemm(a, b, trans_a=True)
    assert spy.calls == [(True, False)]
    torch.testing.assert_close(got, a.t() @ b)
