"""GroupedLinear's one-call-per-pass FP8 path (``_grouped_fp8_function``): when it runs, and that it equals the
per-split path (bit for bit on the reference backend, to FP8 GEMM rounding on a GPU)."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch.module import _grouped_fp8_function
from transformer_engine.pytorch.module._grouped_fp8_function import stacked_weights
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear

SPLITS = [32, 0, 48, 16]  # multiples of 16, one empty
IN, OUT = 64, 32
RECIPES = {
    "delayed hybrid": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "delayed e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4),
    "current hybrid": Float8CurrentScaling(fp8_format=Format.HYBRID),
}


@pytest.fixture
def calls(monkeypatch):
    """The number of GroupedFp8Function.forward calls so far (a list holding one count)."""
    count = [0]
    forward = _grouped_fp8_function.GroupedFp8Function.forward

    def counted(ctx, *args):
        count[0] += 1
        return forward(ctx, *args)

    monkeypatch.setattr(_grouped_fp8_function.GroupedFp8Function, "forward", staticmethod(counted))
    return count


def _step(layer, x, splits, recipe, **kwargs):
    with te.autocast(recipe=recipe):
        return layer(x, splits, **kwargs)


@pytest.mark.parametrize(
    "splits, recipe, kwargs, expected",
    [
        (SPLITS, DelayedScaling(), {}, 1),
        ([40, 0, 40, 16], DelayedScaling(), {}, 0),  # 40 rows: not an FP8 GEMM's multiple of 16
        (SPLITS, Float8CurrentScaling(), {}, 1),
        (SPLITS, Float8BlockScaling(), {}, 0),  # block scaling casts per split
        (SPLITS, DelayedScaling(), {"is_first_microbatch": True}, 1),  # the FP8 weights cached for the next microbatches
    ],
)
def test_which_path_runs(calls, splits, recipe, kwargs, expected):
    layer = GroupedLinear(len(splits), IN, OUT)
    _step(layer, randn(sum(splits), IN), splits, recipe, **kwargs).sum().backward()
    assert calls[0] == expected


@pytest.mark.parametrize("option", ["fuse_wgrad_accumulation", "delay_wgrad_compute"])
def test_options_acting_per_split_take_the_split_path(calls, option):
    layer = GroupedLinear(len(SPLITS), IN, OUT, **{option: True})
    _step(layer, randn(sum(SPLITS), IN), SPLITS, DelayedScaling())
    assert calls[0] == 0


def test_cached_weights_serve_later_microbatches(calls):
    """is_first_microbatch=False reuses the FP8 weights of the first microbatch (a changed weight is not seen) and
    records no weight amax, on the one-call path as per split."""
    layer = GroupedLinear(len(SPLITS), IN, OUT)
    x = randn(sum(SPLITS), IN)
    with te.autocast(recipe=DelayedScaling()):
        first = layer(x, SPLITS, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight0.add_(1.0)
        history = layer.fp8_meta["scaling_fwd"].amax_history
        weight_amaxes = history[0, 1::3].clone()
        again = layer(x, SPLITS, is_first_microbatch=False)
        assert torch.equal(history[0, 1::3], weight_amaxes)
    assert torch.equal(first, again) and calls[0] == 2


def _twin_layers(dtype, device, bias, return_bias=False):
    torch.manual_seed(1)
    one_call = GroupedLinear(len(SPLITS), IN, OUT, bias=bias, return_bias=return_bias, params_dtype=dtype, device=device)
    per_split = GroupedLinear(len(SPLITS), IN, OUT, bias=bias, return_bias=return_bias, params_dtype=dtype, device=device)
    per_split.load_state_dict(one_call.state_dict())
    with torch.no_grad():
        for a, b in zip(one_call.parameters(), per_split.parameters()):
            a.normal_()
            b.copy_(a)
    per_split._split_casters = lambda *args: None
    return one_call, per_split


def _train(layer, xs, dys, recipe, return_bias):
    """Outputs, input / parameter gradients and the scaling state of three SGD steps."""
    outputs, grads = [], []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_()
        y = _step(layer, x, SPLITS, recipe)
        if return_bias:
            y, biases = y
            outputs.extend(biases)
        y.backward(dy)
        outputs.append(y.detach())
        grads.extend([x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None])
        with torch.no_grad():
            for p in layer.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None
    states = [t.clone() for key in ("scaling_fwd", "scaling_bwd") if recipe.delayed()
              for t in (layer.fp8_meta[key].scale, layer.fp8_meta[key].amax_history)]
    return outputs, grads, states


def _compare(dtype, device, recipe_name, bias, return_bias, check):
    one_call, per_split = _twin_layers(dtype, device, bias, return_bias)
    recipe = RECIPES[recipe_name]
    xs = [randn(sum(SPLITS) // 2, 2, IN, dtype=dtype, device=device) for _ in range(3)]
    dys = [randn(sum(SPLITS) // 2, 2, OUT, dtype=dtype, device=device) for _ in range(3)]
    for got, want in zip(_train(one_call, xs, dys, recipe, return_bias), _train(per_split, xs, dys, recipe, return_bias)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            check(a, b)


def _bitwise(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias, return_bias", [(True, False), (False, False), (True, True)])
def test_equals_the_per_split_path_on_the_reference_backend(recipe_name, dtype, bias, return_bias):
    _compare(dtype, "cpu", recipe_name, bias, return_bias, _bitwise)


def test_under_torch_autocast():
    """fp32 parameters under torch.autocast(bfloat16): the GEMMs in bf16, the gradients in float32, as per split."""
    one_call, per_split = _twin_layers(torch.float32, "cpu", bias=True)
    x, dy = randn(sum(SPLITS), IN), randn(sum(SPLITS), OUT)
    results = []
    for layer in (one_call, per_split):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = _step(layer, x, SPLITS, DelayedScaling())
        y.backward(dy.bfloat16())
        results.append([y] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        _bitwise(a, b)
    assert results[0][0].dtype == torch.bfloat16 and results[0][1].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_per_split_path_on_a_gpu(recipe_name, bias):
    """The grouped casts are bit-exact; the grouped GEMM (CUTLASS, E4M3 without bias) may round its products
    otherwise than cuBLASLt: outputs and gradients within a bf16 unit, the scaling state equal."""
    def close(a, b):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3)

    _compare(torch.bfloat16, "cuda", recipe_name, bias, return_bias=False, check=close)


def test_the_weights_lie_in_one_buffer_which_the_casts_read_in_place():
    """GroupedLinear's weights are slices of one buffer (again after .to()); the one-call path reads them as the
    stacked weights without a copy, and copies (same values, same results) once a weight has its own tensor."""
    layer = GroupedLinear(len(SPLITS), IN, OUT).to(torch.bfloat16)
    weights = [getattr(layer, f"weight{i}") for i in range(len(SPLITS))]
    assert weights[0].dtype == torch.bfloat16
    assert stacked_weights(weights).data_ptr() == weights[0].data_ptr()
    x = randn(sum(SPLITS), IN, dtype=torch.bfloat16)
    shared = _step(layer, x, SPLITS, DelayedScaling())
    weights[2].data = weights[2].data.clone()
    copied = stacked_weights(weights)
    assert copied.data_ptr() != weights[0].data_ptr() and torch.equal(copied, torch.cat(weights))
    layer.fp8_meta["scaling_fwd"].amax_history.zero_()
    layer.fp8_meta["scaling_fwd"].scale.fill_(1.0)
    assert torch.equal(_step(layer, x, SPLITS, DelayedScaling()), shared)
