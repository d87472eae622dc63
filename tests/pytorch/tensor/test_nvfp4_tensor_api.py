"""The public NVFP4 tensor (NVFP4Tensor, NVFP4Quantizer): casts, usages, views, copies, dispatch, pickling, CustomRecipe."""

import inspect
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import CustomRecipe, NVFP4BlockScaling
from transformer_engine.plugin import ops
from transformer_engine.pytorch.quantization.nvfp4_tensor import NVFP4Tensor as NVFP4Operand
from transformer_engine.pytorch.tensor import DType, NVFP4Quantizer, NVFP4Tensor, QuantizedTensor

BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise", "_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise")
GRAD_ROLES = ("linear_grad_output", "linear_grad_input")


def _x(shape, dtype=torch.float32):
    """Values whose 16-element blocks differ in magnitude by powers of ten (each block gets a scale of its own)."""
    x = torch.randn(shape, dtype=torch.float32)
    cols = torch.arange(shape[-1])
    return (x * 10.0 ** ((cols // 16) % 3 - 1)).to(dtype)


def _buffers(t):
    return [getattr(t, key) for key in BUFFERS]


def _equal(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("rht, two_d", [(False, False), (True, False), (False, True)], ids=["plain", "rht", "2d"])
@pytest.mark.parametrize("shape", [(64, 96), (2, 32, 64)])
def test_copies_are_the_catalog_cast_in_tes_layout(shape, rht, two_d):
    """Row-wise: ops.quantize_nvfp4's data shaped (*lead, K / 2); column-wise: its x^T copy [K, M / 2] as the op writes it
    (TE's layout); compact scales [M, K / 16] and [K, M / 16]; one float32 amax per copy."""
    x = _x(shape, torch.bfloat16)
    q = NVFP4Quantizer(with_rht=rht, with_post_rht_amax=rht, with_2d_quantization=two_d)
    x_q = q(x)
    m, k = x.numel() // shape[-1], shape[-1]
    expected = ops.quantize_nvfp4(x.reshape(m, k), rowwise=True, columnwise=True, block_2d=two_d, rht=rht, stochastic_rounding=False,
                                  seed=None)
    assert isinstance(x_q, NVFP4Tensor) and isinstance(x_q, QuantizedTensor) and x_q.shape == shape and x_q.dtype == torch.bfloat16
    assert x_q._rowwise_data.shape == (*shape[:-1], k // 2) and x_q._columnwise_data.shape == (k, m // 2)
    assert x_q._rowwise_scale_inv.shape == (m, k // 16) and x_q._columnwise_scale_inv.shape == (k, m // 16)
    assert x_q._fp4_dtype == DType.kFloat4E2M1 and x_q._amax_rowwise.dtype == torch.float32
    got = [x_q._rowwise_data.reshape(m, k // 2)] + _buffers(x_q)[1:]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    data, scale, amax = expected[:3]
    assert torch.equal(x_q.dequantize(), ops.dequantize_nvfp4(data, scale, amax, torch.bfloat16).reshape(shape))


def test_dequantized_values_quantize_to_the_same_data():
    """NVIDIA TE's test_fp4_dequantize: Q(dequantize(Q(a))) has Q(a)'s data."""
    q = NVFP4Quantizer()
    a = torch.rand(256, 272)
    x_q = q(a)
    again = q(x_q.dequantize())
    assert torch.equal(again._rowwise_data, x_q._rowwise_data)
    torch.testing.assert_close(again.dequantize(), x_q.dequantize())


def test_the_column_wise_copy_dequantizes_only_where_it_is_x_transposed():
    x = _x((64, 32))
    plain = NVFP4Quantizer(rowwise=False)(x)
    data_t, scale_t, amax_t = ops.quantize_nvfp4(x, rowwise=False, columnwise=True, block_2d=False, rht=False, stochastic_rounding=False,
                                                 seed=None)[3:]
    assert torch.equal(plain.dequantize(), ops.dequantize_nvfp4(data_t, scale_t, amax_t, torch.float32).t())
    transformed = NVFP4Quantizer(rowwise=False, with_rht=True, with_post_rht_amax=True)(x.bfloat16())
    with pytest.raises(RuntimeError, match=r"RHT\(x\^T\) \(with_rht=True\), not x\^T"):
        transformed.dequantize()
    unknown = NVFP4Tensor(x.shape, torch.float32, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=data_t,
                          columnwise_scale_inv=scale_t, amax_columnwise=amax_t)
    with pytest.raises(RuntimeError, match="no quantizer says"):
        unknown.dequantize()
    assert "column-wise copy only" in repr(transformed)


def test_shapes_that_blocks_do_not_divide_raise_and_is_quantizable_says_so():
    q = NVFP4Quantizer()
    assert q.is_quantizable(torch.zeros(64, 32)) and q.is_quantizable(torch.zeros(2, 8, 32))
    assert not q.is_quantizable(torch.zeros(40, 32)) and not q.is_quantizable(torch.zeros(64, 24)) and not q.is_quantizable(torch.zeros(64))
    with pytest.raises(ValueError, match="16"):
        q(torch.randn(40, 32))
    with pytest.raises(ValueError, match=r"last dim \(24\) is not a multiple of 16"):
        q.make_empty((64, 24))
    q.set_usage(rowwise=True, columnwise=False)
    assert q(torch.randn(40, 32)).get_usages() == {"rowwise": True, "columnwise": False}  # the row-wise copy needs K % 16 only


def test_options_that_are_not_implemented_raise_at_construction():
    with pytest.raises(NotImplementedError, match="with_amax_reduction=True"):
        NVFP4Quantizer(with_amax_reduction=True)
    with pytest.raises(NotImplementedError, match="with_post_rht_amax=False"):
        NVFP4Quantizer(with_rht=True)
    with pytest.raises(NotImplementedError, match="with_random_sign_mask=False"):
        NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_random_sign_mask=False)
    with pytest.raises(ValueError, match="kFloat4E2M1"):
        NVFP4Quantizer(fp4_dtype=DType.kFloat8E4M3)
    assert NVFP4Quantizer(with_random_sign_mask=False).rht_matrix_random_sign_mask_t == 0  # no RHT: no effect, as in TE
    q = NVFP4Quantizer(DType.kFloat4E2M1, True, False, False, None, True, True, True, True)  # noqa: FBT003 - TE's positional order is what is tested
    flags = (q.rowwise_usage, q.columnwise_usage, q.with_rht, q.with_post_rht_amax, q.with_2d_quantization, q.stochastic_rounding)
    assert flags == (True, False, True, True, True, True)
    assert q.rht_matrix_random_sign_mask_t == 0xD7E8 and q.copy()._settings() == q._settings()


def test_update_usage_drops_copies_with_their_amax_and_cannot_make_one_from_the_other():
    x = _x((64, 64))
    rowwise = NVFP4Quantizer(columnwise=False)(x)
    with pytest.raises(RuntimeError, match="quantization of its own"):
        rowwise.update_usage(columnwise_usage=True)
    both = NVFP4Quantizer()(x)
    both.update_usage(columnwise_usage=False)
    assert both.get_usages() == {"rowwise": True, "columnwise": False}
    assert both._columnwise_scale_inv is None and both._amax_columnwise is None and both._amax_rowwise is not None
    with pytest.raises(RuntimeError, match="without data"):
        both.update_usage(rowwise_usage=False)
    only_t = NVFP4Quantizer(rowwise=False)(x)
    with pytest.raises(RuntimeError, match="only holds its column-wise copy"):
        only_t.update_usage(rowwise_usage=True)


def test_views_keep_the_last_dim_and_share_the_buffers():
    x_q = NVFP4Quantizer()(_x((4, 32, 64)))
    flat = x_q.view(128, 64)
    assert isinstance(flat, NVFP4Tensor) and flat.shape == (128, 64) and flat._rowwise_data.shape == (128, 32)
    assert flat._rowwise_data.data_ptr() == x_q._rowwise_data.data_ptr()
    assert flat._columnwise_data.data_ptr() == x_q._columnwise_data.data_ptr()
    assert torch.equal(flat.dequantize(), x_q.dequantize().view(128, 64))
    assert torch.equal(x_q.reshape(2, 64, 64).dequantize(), x_q.dequantize().reshape(2, 64, 64))
    with pytest.raises(NotImplementedError, match="last dimension"):
        x_q.view(4, 64, 32)


def test_detach_clone_and_empty_like_keep_the_class():
    x_q = NVFP4Quantizer(with_2d_quantization=True)(_x((32, 64)))
    detached, cloned = x_q.detach(), x_q.clone()
    assert detached._rowwise_data.data_ptr() == x_q._rowwise_data.data_ptr()
    assert cloned._rowwise_data.data_ptr() != x_q._rowwise_data.data_ptr() and all(map(_equal, _buffers(cloned), _buffers(x_q)))
    empty = torch.empty_like(x_q)
    assert type(empty) is NVFP4Tensor and empty.get_usages() == x_q.get_usages() and empty._quantizer.with_2d_quantization
    assert torch.equal(empty.dequantize(), torch.zeros(32, 64))


def test_copy_between_tensors_of_one_layout_copies_bytes_and_from_high_precision_requantizes():
    q = NVFP4Quantizer()
    src, dst = q(_x((64, 64))), q(torch.zeros(64, 64))
    dst.copy_(src)
    assert all(torch.equal(a, b) for a, b in zip(_buffers(dst), _buffers(src)))
    y = _x((64, 64))
    buffer = dst._rowwise_data
    dst.copy_(y)  # a high-precision source: dst = Q(y), written into dst's own buffers
    assert dst._rowwise_data is buffer and torch.equal(dst.dequantize(), q(y).dequantize())
    dst.add_(1.0)  # in-place ops run in high precision and quantize again
    assert torch.equal(dst.dequantize(), q(q(y).dequantize() + 1.0).dequantize())


def test_a_copy_records_what_its_column_wise_bytes_hold():
    """The column-wise bytes of an RHT quantizer hold RHT(x^T): a tensor that takes them (byte copy or update_quantized)
    takes that quantizer's settings, so it refuses to read them as x^T."""
    x = _x((64, 64), torch.bfloat16)
    rht = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    dst = NVFP4Quantizer()(torch.zeros(64, 64, dtype=torch.bfloat16))
    dst.copy_(rht(x))
    assert dst._quantizer.with_rht
    other = NVFP4Quantizer(rowwise=False)(torch.zeros(64, 64, dtype=torch.bfloat16))
    rht.update_quantized(x, other)
    with pytest.raises(RuntimeError, match="with_rht=True"):
        other.dequantize()


def test_high_precision_ops_run_on_the_dequantized_values():
    x_q = NVFP4Quantizer()(_x((64, 32), torch.bfloat16))
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(torch.matmul(x_q, w), torch.matmul(x_q.dequantize(), w))
    assert torch.equal(x_q * 2, x_q.dequantize() * 2)


def test_make_empty_dequantizes_to_zeros_and_update_quantized_fills_it():
    q = NVFP4Quantizer(with_2d_quantization=True)
    empty = q.make_empty((2, 32, 64), dtype=torch.bfloat16)
    assert empty.dtype == torch.bfloat16 and empty._rowwise_data.shape == (2, 32, 32) and empty._columnwise_data.shape == (64, 32)
    assert empty._rowwise_scale_inv.shape == (64, 4) and empty._columnwise_scale_inv.shape == (64, 4)
    assert torch.equal(empty.dequantize(dtype=torch.float32), torch.zeros(2, 32, 64))
    x = _x((2, 32, 64))
    q.update_quantized(x, empty)
    assert all(torch.equal(a, b) for a, b in zip(_buffers(empty), _buffers(q(x))))
    with pytest.raises(ValueError, match="shape"):
        q.update_quantized(torch.zeros(64, 64), empty)


@pytest.mark.parametrize("noop", [0.0, 1.0])
def test_noop_flag_keeps_the_tensor_where_set(noop):
    q = NVFP4Quantizer()
    x = q(torch.randn(64, 128))
    before = [t.clone() for t in _buffers(x)]
    y = torch.randn(64, 128) * 3
    x.quantize_(y, noop_flag=torch.tensor([noop]))
    if noop:
        assert all(torch.equal(a, b) for a, b in zip(_buffers(x), before))
    else:
        assert torch.equal(x.dequantize(), q(y).dequantize())


def test_stochastic_rounding_repeats_under_manual_seed():
    q = NVFP4Quantizer(stochastic_rounding=True)
    x = _x((64, 64))

    def cast(seed):
        torch.manual_seed(seed)
        return q(x)._rowwise_data

    assert torch.equal(cast(1), cast(1)) and not torch.equal(cast(1), cast(2))
    assert not torch.equal(cast(1), NVFP4Quantizer()(x)._rowwise_data)


def test_weights_only_pickling_round_trip_keeps_the_quantizer_settings():
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_2d_quantization=True)
    x_q, only_t = q(_x((64, 96), torch.bfloat16)), NVFP4Quantizer(rowwise=False, with_rht=True, with_post_rht_amax=True)(_x((64, 96)))
    buffer = io.BytesIO()
    torch.save({"w": x_q, "t": only_t}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["w"]) is NVFP4Tensor and loaded["w"].dtype == torch.bfloat16 and loaded["w"].shape == x_q.shape
    assert all(torch.equal(a, b) for a, b in zip(_buffers(loaded["w"]), _buffers(x_q)))
    assert loaded["w"]._quantizer._settings() == x_q._quantizer._settings() and torch.equal(loaded["w"].dequantize(), x_q.dequantize())
    with pytest.raises(RuntimeError, match="with_rht=True"):
        loaded["t"].dequantize()


def test_constructor_checks_the_buffers():
    data, scale, amax = torch.zeros(64, 32, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8), torch.zeros(1)
    kwargs = dict(rowwise_data=data, rowwise_scale_inv=scale, amax_rowwise=amax)
    with pytest.raises(ValueError, match="neither"):
        NVFP4Tensor((64, 64), torch.float32, rowwise_data=None, rowwise_scale_inv=None)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv must be uint8 E4M3 bits of shape \(64, 4\)"):
        NVFP4Tensor((64, 64), torch.float32, **{**kwargs, "rowwise_scale_inv": torch.zeros(128, 4, dtype=torch.uint8)})  # TE pads
    with pytest.raises(TypeError, match="uint8"):
        NVFP4Tensor((64, 64), torch.float32, **{**kwargs, "rowwise_data": data.float()})
    with pytest.raises(ValueError, match="amax_rowwise must be a one-element float32"):
        NVFP4Tensor((64, 64), torch.float32, **{**kwargs, "amax_rowwise": None})
    with pytest.raises(ValueError, match="columnwise_data has shape"):
        NVFP4Tensor((64, 64), torch.float32, rowwise_data=None, rowwise_scale_inv=None, columnwise_data=data[:, :16],
                    columnwise_scale_inv=scale, amax_columnwise=amax)
    with pytest.raises(ValueError, match="kFloat4E2M1"):
        NVFP4Tensor((64, 64), torch.float32, **kwargs, fp4_dtype=DType.kFloat8E4M3)
    assert torch.equal(NVFP4Tensor((64, 64), torch.float32, **kwargs).dequantize(), torch.zeros(64, 64))


def test_operand_is_the_module_container_over_the_same_buffers():
    x_q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)(_x((2, 32, 64), torch.bfloat16))
    operand = x_q.operand()
    assert type(operand) is NVFP4Operand and operand.rht_t and operand.shape == (64, 64)
    assert operand.data.data_ptr() == x_q._rowwise_data.data_ptr() and operand.data_t is x_q._columnwise_data
    w_q = NVFP4Quantizer(with_2d_quantization=True)(_x((48, 64)))
    (a, a_scale, a_amax), (b, b_scale, b_amax) = operand.nvfp4_operand(transposed=False), w_q.operand().nvfp4_operand(transposed=False)
    y = ops.gemm_nvfp4(a, b, a_scale=a_scale, b_scale=b_scale, a_amax=a_amax, b_amax=b_amax, out_dtype=torch.float32)
    torch.testing.assert_close(y, x_q.dequantize(dtype=torch.float32).reshape(64, 64) @ w_q.dequantize().t())


# -- CustomRecipe ----------------------------------------------------------------------------------------------
def _nvfp4_factory(stochastic_rounding):
    """NVFP4BlockScaling's quantizers as a factory: RHT on inputs' and gradients' column-wise copies, 16 x 16 weight tiles,
    stochastic rounding on gradients (where asked)."""
    def factory(role):
        if role == "linear_weight":
            return NVFP4Quantizer(with_2d_quantization=True)
        return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=stochastic_rounding and role in GRAD_ROLES)

    return factory


def _train(layer, recipe, xs):
    """Steps of SGD on a loss with a wide range in dy; returns the outputs, input gradients and final parameters."""
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for step, x in enumerate(xs):
        torch.manual_seed(step)  # the stochastic-rounding seeds
        x = x.clone().requires_grad_(requires_grad=True)
        with te.autocast(recipe=recipe):
            y = layer(x)
        (y.float() * torch.logspace(-2, 2, y.shape[-1])).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        out += [y.detach(), x.grad]
    return out + [p.detach().clone() for p in layer.parameters()]


@pytest.mark.parametrize("stochastic_rounding", [False, True], ids=["nearest", "stochastic"])
def test_custom_recipe_of_nvfp4_quantizers_trains_as_nvfp4_block_scaling(stochastic_rounding):
    torch.manual_seed(4)
    layers = [te.Linear(64, 32, params_dtype=torch.bfloat16) for _ in range(3)]
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    xs = [torch.randn(2, 16, 64, dtype=torch.bfloat16) for _ in range(3)]
    expected = _train(layers[0], NVFP4BlockScaling(disable_stochastic_rounding=not stochastic_rounding), xs)
    got = _train(layers[1], CustomRecipe(qfactory=_nvfp4_factory(stochastic_rounding)), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(layers[2](xs[0]), got[0])  # NVFP4 did run: the bf16 layer's first output differs


def test_nvfp4_weights_under_a_custom_recipe_are_its_weight_quantization():
    """quantized_model_init with a CustomRecipe of NVFP4Quantizers: the weight is an NVFP4Tensor of the factory's
    "linear_weight" settings (the parameter tests are in tests/pytorch/quantization/test_model_init.py)."""
    with te.quantized_model_init(recipe=CustomRecipe(qfactory=_nvfp4_factory(stochastic_rounding=False))):
        layer = te.Linear(64, 32)
    assert isinstance(layer.weight, NVFP4Tensor)
    made = _nvfp4_factory(stochastic_rounding=False)("linear_weight")
    assert layer.weight._get_quantizer().with_2d_quantization == made.with_2d_quantization


def test_exported_at_tes_paths():
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer as by_module

    assert te.NVFP4Quantizer is NVFP4Quantizer is by_module and te.NVFP4Tensor is NVFP4Tensor


# -- 4over6 ---------------------------------------------------------------------------------------------
def test_4over6_quantizer_takes_tes_arguments_in_tes_order():
    names = list(inspect.signature(NVFP4Quantizer).parameters)
    assert names[8:] == ["stochastic_rounding", "row_scaled_nvfp4", "nvfp4_use_4over6", "nvfp4_e4m3_max",
                         "nvfp4_4over6_err_mode", "with_random_sign_mask"]
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="mse")
    assert (q.nvfp4_use_4over6, q.nvfp4_e4m3_max, q.nvfp4_4over6_err_mode, q.row_scaled_nvfp4) == (True, 256, "MSE", False)
    assert q.copy()._settings() == q._settings()
    assert NVFP4Quantizer(nvfp4_e4m3_max=256).nvfp4_e4m3_max == 448  # without 4over6 the bound is 448, as TE sets it


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("bound", [448, 256])
def test_4over6_copies_are_the_catalog_cast_and_carry_the_bound(bound, two_d):
    x = _x((64, 96), torch.bfloat16)
    q = NVFP4Quantizer(with_2d_quantization=two_d, nvfp4_use_4over6=True, nvfp4_e4m3_max=bound, nvfp4_4over6_err_mode="MAE")
    x_q = q(x)
    expected = ops.quantize_nvfp4(x, rowwise=True, columnwise=True, block_2d=two_d, rht=False, stochastic_rounding=False, seed=None,
                                  four_over_six="MAE", e4m3_max=bound)
    assert all(torch.equal(a, b) for a, b in zip(_buffers(x_q), expected))
    assert x_q._nvfp4_use_4over6 and x_q._nvfp4_e4m3_max == bound and x_q.operand().e4m3_max == bound
    decoded = ops.dequantize_nvfp4(expected[0], expected[1], expected[2], torch.float32, e4m3_max=bound)
    assert torch.equal(x_q.dequantize(dtype=torch.float32), decoded)
    assert torch.equal(x_q.view(2, 32, 96).dequantize(dtype=torch.float32), decoded.view(2, 32, 96))
    if bound == 256:
        assert not torch.equal(ops.dequantize_nvfp4(*expected[:3], torch.float32), decoded)  # the bound is part of the decode


def test_4over6_tensors_pickle_copy_and_update_with_their_bound():
    q256 = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)
    x_q = q256(_x((64, 64)))
    buffer = io.BytesIO()
    torch.save(x_q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded._nvfp4_e4m3_max == 256 and loaded._nvfp4_use_4over6 and torch.equal(loaded.dequantize(), x_q.dequantize())
    detached = x_q.detach()
    assert detached._nvfp4_e4m3_max == 256 and torch.equal(detached.dequantize(), x_q.dequantize())
    dst = NVFP4Quantizer()(torch.zeros(64, 64))
    dst.copy_(x_q)  # another bound: not a byte copy, dst = Q(x_q) with dst's own quantizer and bound
    assert dst._nvfp4_e4m3_max == 448 and torch.equal(dst.dequantize(), NVFP4Quantizer()(x_q.dequantize()).dequantize())
    q256.update_quantized(_x((64, 64)), dst)
    assert dst._nvfp4_e4m3_max == 256 and dst._nvfp4_use_4over6 and dst._quantizer.nvfp4_use_4over6
    same = q256(torch.zeros(64, 64))
    same.copy_(x_q)  # one bound: the bytes
    assert all(torch.equal(a, b) for a, b in zip(_buffers(same), _buffers(x_q)))


def test_4over6_refusals_name_the_value_and_the_rule():
    with pytest.raises(ValueError, match=r"nvfp4_use_4over6=True, with_rht=True.*does not support RHT"):
        NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, nvfp4_use_4over6=True)
    with pytest.raises(ValueError, match=r"stochastic_rounding=True.*does not support stochastic rounding"):
        NVFP4Quantizer(stochastic_rounding=True, nvfp4_use_4over6=True)
    with pytest.raises(ValueError, match=r"nvfp4_e4m3_max=300"):
        NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=300)
    with pytest.raises(ValueError, match=r"nvfp4_4over6_err_mode='L1'"):
        NVFP4Quantizer(nvfp4_4over6_err_mode="L1")
    with pytest.raises(NotImplementedError, match=r"row_scaled_nvfp4=True"):
        NVFP4Quantizer(row_scaled_nvfp4=True)


def test_setting_data_takes_the_other_tensor_s_4over6_flags():
    plain = NVFP4Quantizer()(_x((32, 64)))
    other = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)(_x((32, 64)))
    plain.data = other
    assert plain._nvfp4_use_4over6 and plain._nvfp4_e4m3_max == 256 and torch.equal(plain.dequantize(), other.dequantize())
