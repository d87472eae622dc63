"""The helpers shared by the modules' autograd Functions."""

from dataclasses import dataclass

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, QParams

from transformer_engine.pytorch._functions.common import (
    backward_frees_graph, grad_output_operand, no_torch_autocast, release, rows_of, unflatten, without_operands,
)
from transformer_engine.pytorch.parallel import NO_COMM
from transformer_engine.pytorch.quantization import Float8BlockQuantizer, Float8Tensor
from transformer_engine.pytorch.quantization.float8_blockwise_tensor import Float8BlockwiseTensor
from transformer_engine.pytorch.quantization.quantizer import IDENTITY
from transformer_engine.pytorch.quantization.recipe_state import RecipeState

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


class _ReducingComm:
    """No communication in the cast, but the bias gradient is all-reduced afterwards (as row + SP)."""

    reduces_bias_grad = True
    gathers_grad_output = False

    def pipelines_grad_gather(self, quantizer):
        return False

    def for_grad_cast(self, quantizer):
        return self

    def gather_grad_output(self, t):
        return t


def test_bias_gradient_dtype_follows_the_bias_and_the_reduction():
    dy = (torch.randn(300, 24) * 10).to(torch.bfloat16)
    exact32 = dy.sum(0, dtype=torch.float32)
    dy_op, db, gathered = grad_output_operand(IDENTITY, dy, NO_COMM, need_dw=True, db_dtype=torch.bfloat16, amaxes=[])
    assert dy_op is dy and not gathered
    assert db.dtype == torch.bfloat16 and torch.equal(db, exact32.to(torch.bfloat16))  # float32 sum, one rounding
    db = grad_output_operand(IDENTITY, dy, NO_COMM, need_dw=True, db_dtype=torch.float32, amaxes=[])[1]
    assert db.dtype == torch.float32 and torch.equal(db, exact32)  # a float32 bias keeps every bit of the sum
    db = grad_output_operand(IDENTITY, dy, _ReducingComm(), need_dw=True, db_dtype=torch.bfloat16, amaxes=[])[1]
    assert db.dtype == torch.float32 and torch.equal(db, exact32)  # all-reduced in float32 first
    assert grad_output_operand(IDENTITY, dy, NO_COMM, need_dw=False, db_dtype=None, amaxes=[])[1] is None


def _backward_quantizer(recipe):
    return RecipeState.create(recipe, mode="backward", num_gemms=1, device="cpu").make_quantizers()[0]


_GRAD_QUANTIZERS = {
    "delayed": lambda: _backward_quantizer(DelayedScaling()),
    "current": lambda: _backward_quantizer(Float8CurrentScaling()),
    "block": lambda: _backward_quantizer(Float8BlockScaling()),
    "block 2-D tiles": lambda: Float8BlockQuantizer(torch.float8_e4m3fn, 2, QParams(power_2_scale=True)),
}


@pytest.mark.parametrize("name, fused", [("delayed", True), ("current", True), ("block", True), ("block 2-D tiles", False)])
def test_fp8_grad_output_fuses_the_bias_gradient_where_the_cast_can(name, fused):
    # the delayed / current casts and block scaling's 1-D cast (its gradients' tiles) sum dy on the way, in
    # float32, rounded once to the bias dtype by the cast itself; a cast that cannot (2-D tiles) leaves the
    # one-kernel sum in the bias dtype
    quantizer = _GRAD_QUANTIZERS[name]()
    assert quantizer.fuses_dbias is fused
    dy = (torch.randn(256, 128) * 10).to(torch.bfloat16)
    dy_op, db, _ = grad_output_operand(quantizer, dy, NO_COMM, need_dw=True, db_dtype=torch.bfloat16, amaxes=[])
    assert isinstance(dy_op, (Float8Tensor, Float8BlockwiseTensor)) and dy_op.data_t is not None
    exact32 = dy.sum(0, dtype=torch.float32)
    assert db.dtype == torch.bfloat16 and torch.equal(db, exact32.to(torch.bfloat16))


def test_rows_of_and_unflatten_keep_what_is_already_in_shape():
    x = torch.randn(6, 4)
    assert rows_of(x) is x and unflatten(x, x.shape) is x
    x3 = torch.randn(2, 3, 4)
    rows = rows_of(x3)
    assert rows.shape == (6, 4) and rows.is_contiguous() and torch.equal(unflatten(rows, x3.shape), x3)
    strided = torch.randn(4, 6).t()
    assert rows_of(strided).is_contiguous() and torch.equal(rows_of(strided), strided)


@dataclass(frozen=True)
class _Args:
    dtype: torch.dtype
    operand: object
    other: object = None


def test_without_operands_clears_the_named_fields_of_a_copy():
    args = _Args(torch.bfloat16, torch.ones(2), other=3)
    kept = without_operands(args, "operand")
    assert type(kept) is _Args and kept.operand is None and kept.dtype == torch.bfloat16 and kept.other == 3
    assert args.operand is not None  # the original is untouched
