"""Float8BlockScaling: the block quantizer per role, Float8BlockwiseTensor's copies, saving for backward."""

import pytest
import torch

from tests.utils import randn, sqnr
from transformer_engine.common.recipe import Float8BlockScaling, QParams
from transformer_engine.plugin import ops
from transformer_engine.pytorch._functions.common import save, saved
from transformer_engine.pytorch.quantization import Float8BlockQuantizer, Float8BlockwiseTensor
from transformer_engine.pytorch.quantization.recipe_state import Float8BlockScalingRecipeState, RecipeState

E4M3 = torch.float8_e4m3fn
POW2 = QParams(power_2_scale=True)


def test_recipe_state_gives_each_role_its_tiles():
    recipe = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)
    forward = RecipeState.create(recipe, mode="forward", num_gemms=2, device="cpu")
    backward = RecipeState.create(recipe, mode="backward", num_gemms=2, device="cpu")
    assert isinstance(forward, Float8BlockScalingRecipeState) and forward.split_accumulator == (True, True, True)
    assert [q.block for q in forward.make_quantizers()] == [(128, 128), (1, 128), (128, 128)] * 2
    assert [q.block for q in backward.make_quantizers()] == [(1, 128)] * 4
    assert all(q.qparams.power_2_scale for q in forward.make_quantizers())
    f32 = RecipeState.create(Float8BlockScaling(use_f32_scales=True), mode="forward", num_gemms=1, device="cpu")
    assert not f32.make_quantizers()[0].qparams.power_2_scale


def test_1d_cast_writes_both_directions_with_their_own_scales():
    x = randn(200, 300)
    operand = Float8BlockQuantizer(E4M3, 1, POW2).quantize(x, columnwise=True)
    q, s, q_t, s_t = ops.cast_transpose_blockwise(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0)
    assert operand.block == (1, 128) and operand.block_t == (1, 128)
    assert torch.equal(operand.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(operand.scale_inv, s)
    assert torch.equal(operand.data_t.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(operand.scale_inv_t, s_t)
    assert sqnr(x, operand.dequantize(torch.float32)) > 25.0
    assert sqnr(x, operand.transpose_only().dequantize(torch.float32)) > 25.0


def test_1d_cast_with_dbias_is_the_cast_plus_the_column_sums():
    x = randn(200, 300)
    quantizer = Float8BlockQuantizer(E4M3, 1, POW2)
    operand, dbias = quantizer.quantize_with_dbias(x)
    plain = quantizer.quantize(x, columnwise=True)
    assert quantizer.fuses_dbias and operand.block == (1, 128)
    for a, b in ((operand.data, plain.data), (operand.data_t, plain.data_t)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(operand.scale_inv, plain.scale_inv) and torch.equal(operand.scale_inv_t, plain.scale_inv_t)
    assert dbias.dtype == torch.float32
    torch.testing.assert_close(dbias, x.sum(0, dtype=torch.float32))
    square = Float8BlockQuantizer(E4M3, 2, POW2)  # 2-D tiles: the cast, then the sums
    operand, dbias = square.quantize_with_dbias(x)
    assert not square.fuses_dbias and operand.block == (128, 128) and operand.data_t is not None
    torch.testing.assert_close(dbias, x.sum(0, dtype=torch.float32))


def test_1d_cast_writes_rows_only_unless_asked_and_cannot_transpose_later():
    operand = Float8BlockQuantizer(E4M3, 1, POW2).quantize(randn(64, 256))
    assert operand.data_t is None
    with pytest.raises(RuntimeError, match="columnwise=True"):
        operand.transpose_only()


def test_2d_tiles_transpose_exactly():
    w = randn(300, 260)
    operand = Float8BlockQuantizer(E4M3, 2, POW2).quantize(w)
    assert operand.data_t is None and operand.scale_inv.shape == (3, 3)
    both = operand.with_transpose()
    assert torch.equal(both.data_t.view(torch.uint8), operand.data.t().contiguous().view(torch.uint8))
    data_t, scale_inv_t, block = both.gemm_operand(transposed=True)
    assert block == (128, 128) and torch.equal(scale_inv_t, operand.scale_inv.t())
    torch.testing.assert_close(both.transpose_only().dequantize(torch.float32), operand.dequantize(torch.float32))


def test_transposed_cast_keeps_only_the_column_wise_copy():
    w = randn(300, 260)
    square = Float8BlockQuantizer(E4M3, 2, POW2)
    direct, via_transpose = square.quantize_transposed(w), square.quantize(w, columnwise=True).transpose_only()
    assert direct.data is None and direct.block == (128, 128)
    assert torch.equal(direct.data_t.view(torch.uint8), via_transpose.data_t.view(torch.uint8))
    assert torch.equal(direct.scale_inv_t, via_transpose.scale_inv_t)
    torch.testing.assert_close(direct.dequantize(torch.float32), square.quantize(w).dequantize(torch.float32))
    rows = Float8BlockQuantizer(E4M3, 1, POW2).quantize_transposed(w)  # 1-D tiles: x^T quantized along the tokens
    assert rows.data is None and rows.block_t == (1, 128) and rows.data_t.shape == (260, 300)


def test_sharded_tensors_are_gathered_before_the_cast():
    quantizer = Float8BlockQuantizer(E4M3, 1, POW2)
    assert not quantizer.gathers_quantized and quantizer.for_sharded_tensor(lambda amax: amax) is quantizer


def test_errors():
    with pytest.raises(ValueError, match="block_dim"):
        Float8BlockQuantizer(E4M3, 3, POW2)
    with pytest.raises(ValueError, match="2-D"):
        Float8BlockQuantizer(E4M3, 1, POW2).quantize(randn(2, 3, 128))
    with pytest.raises(ValueError, match="scale_inv"):
        Float8BlockwiseTensor(torch.zeros(2, 2, dtype=E4M3), None, block=(1, 128))


def test_saved_for_backward_and_rebuilt():
    rebuilt = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, operand):
            save(ctx, operand, x)
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            rebuilt.append(saved(ctx)[0])
            return dy, None

    x = randn(130, 140).requires_grad_(requires_grad=True)
    operand = Float8BlockQuantizer(E4M3, 1, POW2).quantize(x.detach(), columnwise=True).transpose_only()
    Keep.apply(x, operand).sum().backward()
    (back,) = rebuilt
    assert isinstance(back, Float8BlockwiseTensor) and back.block == (1, 128) and back.data is None
    assert back.data_t is operand.data_t and back.scale_inv_t is operand.scale_inv_t
