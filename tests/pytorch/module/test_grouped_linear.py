"""te.GroupedLinear against n separate te.Linear modules (bit for bit, in bf16 and every recipe), its options,
errors and torch.compile."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import dtype_tols, randn
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
}
SPLITS = [32, 0, 48, 16]  # uneven, one empty; multiples of 8, so that te.Linear (TE's FP8 shape rule) takes each
IN, OUT = 64, 32


def _run(module, x, recipe, **kwargs):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        return module(x, **kwargs)


def _grouped_and_linears(dtype, bias=True, **kwargs):
    """A GroupedLinear and n te.Linear holding the same weights and (non-zero) biases."""
    grouped = GroupedLinear(len(SPLITS), IN, OUT, bias=bias, params_dtype=dtype, **kwargs)
    linears = [te.Linear(IN, OUT, bias=bias, params_dtype=dtype, **kwargs) for _ in SPLITS]
    with torch.no_grad():
        for i, linear in enumerate(linears):
            linear.weight.copy_(getattr(grouped, f"weight{i}"))
            if bias:
                getattr(grouped, f"bias{i}").normal_()
                linear.bias.copy_(getattr(grouped, f"bias{i}"))
    return grouped, linears


def _linears_step(linears, x, recipe, **kwargs):
    """The split i of x through linear i, each in its own autocast (each is then the first module of its
    autocast and updates its backward scales in its own backward, as the one grouped module does)."""
    return torch.cat([_run(linear, part, recipe, **kwargs) for linear, part in zip(linears, x.split(SPLITS))])


def _sgd(params, lr=0.1):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def _state(module_or_modules, key):
    """(amax_history, scale) of ``key`` ("scaling_fwd" / "scaling_bwd"), the separate modules' slots side by side."""
    states = [m.fp8_meta[key] for m in module_or_modules]
    return torch.cat([s.amax_history for s in states], dim=1), torch.cat([s.scale for s in states])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_equals_separate_linears(recipe_name, dtype, device):
    """Outputs, input / weight / bias gradients and the delayed-scaling state over three SGD steps: bit for bit
    (on a GPU through the flagos and vendor kernels, as te.Linear runs them)."""
    torch.manual_seed(0)
    recipe = RECIPES[recipe_name]
    grouped, linears = _grouped_and_linears(dtype, device=device)
    for _ in range(3):
        x = randn(sum(SPLITS) // 2, 2, IN, dtype=dtype, device=device)
        dy = randn(sum(SPLITS) // 2, 2, OUT, dtype=dtype, device=device)
        x_g, x_l = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_g = _run(grouped, x_g, recipe, m_splits=SPLITS)
        y_l = _linears_step(linears, x_l.view(-1, IN), recipe).view(y_g.shape)
        y_g.backward(dy)
        y_l.backward(dy)
        one_call = device == "cuda" and recipe_name in ("delayed", "current")
        assert y_g.dtype == dtype
        _check_equal(y_g, y_l, one_call)
        _check_equal(x_g.grad, x_l.grad, one_call)
        for i, linear in enumerate(linears):
            _check_equal(getattr(grouped, f"weight{i}").grad, linear.weight.grad, one_call)
            _check_equal(getattr(grouped, f"bias{i}").grad, linear.bias.grad, one_call)
        assert not getattr(grouped, "weight1").grad.any() and not getattr(grouped, "bias1").grad.any()  # the empty split
        _sgd(grouped.parameters())
        _sgd([p for linear in linears for p in linear.parameters()])
    if recipe is not None and recipe.delayed():
        for key in ("scaling_fwd", "scaling_bwd"):
            history, scale = _state([grouped], key)
            assert history.shape[1] == len(SPLITS) * (3 if key == "scaling_fwd" else 2)
            expected = _state(linears, key)
            assert torch.equal(history, expected[0]) and torch.equal(scale, expected[1]), key
            assert history.abs().sum() > 0


def _check_equal(grouped: torch.Tensor, linear: torch.Tensor, one_call: bool) -> None:
    """Bit for bit, but for GroupedLinear's one-call FP8 path on a GPU (delayed and current scaling), whose GEMMs read slices of one operand
    (cuBLASLt may pick another kernel for another alignment, summing in another order; CUTLASS's grouped GEMM
    does) and whose bias gradients are column sums in torch rather than in the flagos cast: float32 sums in
    another order, then one rounding (2^-9 of the largest value: Hopper's FP8 accumulator, see test_gemm.py)."""
    if not one_call:
        assert torch.equal(grouped, linear)
        return
    scale = linear.abs().max().item()
    torch.testing.assert_close(grouped, linear, rtol=max(dtype_tols(grouped.dtype)["rtol"], 2.0**-9), atol=2.0**-9 * scale + 1e-6)


def test_parameters_and_bias_options():
    layer = GroupedLinear(3, 16, 8)
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("weight0", (8, 16)), ("bias0", (8,)), ("weight1", (8, 16)), ("bias1", (8,)), ("weight2", (8, 16)), ("bias2", (8,))]
    assert all(not getattr(layer, f"bias{i}").any() for i in range(3))
    no_bias = GroupedLinear(3, 16, 8, bias=False)
    assert [n for n, _ in no_bias.named_parameters()] == ["weight0", "weight1", "weight2"] and no_bias.bias1 is None
    column = GroupedLinear(2, 16, 8, tp_size=2, parallel_mode="column", bias=False)
    row = GroupedLinear(2, 16, 8, tp_size=2, parallel_mode="row", bias=False)
    assert column.weight1.shape == (4, 16) and column.weight1.partition_dim == 0
    assert row.weight1.shape == (8, 8) and row.weight1.partition_dim == 1


def test_return_bias():
    """(y without the biases, [b_i] in the activation dtype), bit for bit as te.Linear(return_bias=True)."""
    grouped, linears = _grouped_and_linears(torch.float32, return_bias=True)
    x = randn(sum(SPLITS), IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, biases = grouped(x, SPLITS)
        expected = [linear(part) for linear, part in zip(linears, x.split(SPLITS))]
    assert torch.equal(y, torch.cat([out for out, _ in expected]))
    assert len(biases) == len(SPLITS) and all(torch.equal(b, e) and b.dtype == torch.bfloat16 for b, (_, e) in zip(biases, expected))
    _, none = GroupedLinear(2, 16, 8, bias=False, return_bias=True)(randn(8, 16), [3, 5])
    assert none == [None, None]


@pytest.mark.parametrize("placeholder", [False, True])
def test_fuse_wgrad_accumulation_into_main_grad(placeholder):
    layer = GroupedLinear(3, 16, 8, fuse_wgrad_accumulation=True)
    for i in range(3):
        weight = getattr(layer, f"weight{i}")
        weight.main_grad = torch.zeros(8, 16)
        if placeholder:
            weight.grad_added_to_main_grad = False
            weight.zero_out_wgrad = True
    splits = [4, 0, 6]
    x, dy = randn(10, 16), randn(10, 8)
    for _ in range(2):
        layer(x, splits).backward(dy)
    for i, (x_i, dy_i) in enumerate(zip(x.split(splits), dy.split(splits))):
        weight = getattr(layer, f"weight{i}")
        torch.testing.assert_close(weight.main_grad, 2 * dy_i.t() @ x_i, rtol=1e-5, atol=1e-5)
        if placeholder:
            assert weight.grad_added_to_main_grad and torch.equal(weight.grad, torch.zeros(8, 16))
        else:
            assert weight.grad is None


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block"])
def test_is_first_microbatch_caches_the_fp8_weights(recipe_name):
    """True casts and caches each W_i; False reuses the casts (weights changed since are not seen); None casts again."""
    recipe = RECIPES[recipe_name]
    layer = GroupedLinear(2, 32, 16)
    x, splits = randn(32, 32), [16, 16]
    with te.autocast(recipe=recipe):
        first = layer(x, splits, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight0.add_(1.0)
            layer.weight1.add_(1.0)
        cached = layer(x, splits, is_first_microbatch=False)
        fresh = layer(x, splits, is_first_microbatch=None)
    assert torch.equal(first, cached) and not torch.equal(first, fresh)


def test_cached_weights_record_no_amax():
    """Delayed scaling: a call with is_first_microbatch=False records the inputs' amaxes, not the weights'."""
    layer = GroupedLinear(2, 32, 16)
    x, splits = randn(32, 32), [16, 16]
    _run(layer, x, RECIPES["delayed"], m_splits=splits, is_first_microbatch=True)
    with te.autocast(recipe=RECIPES["delayed"]):
        layer(x, splits, is_first_microbatch=False)
        newest = layer.fp8_meta["scaling_fwd"].amax_history[0]
        assert newest[0::3].all() and not newest[1::3].any()


def test_m_splits_as_a_tensor_and_a_3d_input():
    layer = GroupedLinear(2, 16, 8)
    x = randn(3, 4, 16)
    y = layer(x, torch.tensor([5, 7]))
    assert y.shape == (3, 4, 8) and torch.equal(y, layer(x, [5, 7]))


def test_checkpoint_round_trip_of_the_delayed_scaling_state():
    recipe = RECIPES["delayed"]
    layer = GroupedLinear(3, 32, 16)
    x = randn(48, 32)
    _run(layer, x, recipe, m_splits=[16, 8, 24]).sum().backward()
    restored = GroupedLinear(3, 32, 16)
    restored.load_state_dict(layer.state_dict())
    for key in ("scaling_fwd", "scaling_bwd"):
        assert all(torch.equal(a, b) for a, b in zip(_state([layer], key), _state([restored], key)))
    assert torch.equal(_run(layer, x, recipe, m_splits=[16, 8, 24]), _run(restored, x, recipe, m_splits=[16, 8, 24]))


def test_te_flags_used_by_megatron_core():
    layer = GroupedLinear(2, 16, 16)
    assert not layer.fp8 and not layer.fp8_calibration
    with te.autocast(recipe=RECIPES["current"]):
        assert layer.fp8
    with te.autocast(enabled=False, calibrating=True, recipe=RECIPES["delayed"]):
        assert layer.fp8_calibration and not layer.fp8
    layer.init_fp8_metadata(num_gemms=2)
    with pytest.raises(ValueError, match="num_gemms=3"):
        layer.init_fp8_metadata(num_gemms=3)


@pytest.mark.parametrize("m_splits, match", [
    ([8, 8, 8], "3 entries but GroupedLinear has num_gemms=2"),
    ([8, 7], "sums to 15"),
    ([20, -4], "non-negative ints"),
    ([8.0, 8], "non-negative ints"),
])
def test_bad_m_splits(m_splits, match):
    with pytest.raises(ValueError, match=match):
        GroupedLinear(2, 16, 8)(randn(16, 16), m_splits)


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block"])
def test_splits_of_any_row_count_equal_the_padded_splits(recipe_name):
    """Splits of 11 / 11 / 10 rows (not multiples of 16, as NVIDIA TE's grouped GEMM takes them) give what the
    same module gives on the splits padded with zero rows (``Fp8Padding``, then ``Fp8Unpadding``): the same FP8
    operands (zero rows leave every amax as it is), so outputs and gradients agree up to float32 summation
    order (the float32 GEMM of the emulation runs 11 and 16 rows through different BLAS kernels, and the
    weight gradients sum exact zeros in another order), and the scaling state ends equal."""
    torch.manual_seed(0)
    recipe, splits = RECIPES[recipe_name], [11, 11, 10]
    direct = GroupedLinear(3, IN, OUT)
    padded = copy.deepcopy(direct)
    pad, unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
    x, dy = randn(sum(splits), IN), randn(sum(splits), OUT)
    x_d, x_p = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_d = _run(direct, x_d, recipe, m_splits=splits)
    x_padded, padded_splits = pad(x_p, splits)
    y_p = unpad(_run(padded, x_padded, recipe, m_splits=padded_splits), splits)
    y_d.backward(dy)
    y_p.backward(dy)
    torch.testing.assert_close(y_d, y_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_d.grad, x_p.grad, rtol=1e-6, atol=1e-6)
    for name, param in direct.named_parameters():
        torch.testing.assert_close(param.grad, dict(padded.named_parameters())[name].grad, rtol=1e-6, atol=1e-6)
    if recipe.delayed():
        for key in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(_state([direct], key)[0], _state([padded], key)[0]), key


def test_mxfp8_splits_need_32_rows():
    """MXFP8's column-wise copy has one scale per 32 rows: a split of another row count is refused, naming it."""
    with pytest.raises(ValueError, match=r"first dim \(11\) must be divisible by 32"):
        _run(GroupedLinear(2, 64, 32), randn(32, 64), MXFP8BlockScaling(), m_splits=[11, 21])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"single_grouped_weight": True}, NotImplementedError, "single_grouped_weight"),
    ({"single_grouped_bias": True}, NotImplementedError, "single_grouped_bias"),
    ({"ub_overlap_ag": True}, ValueError, "Userbuffer overlap"),
    ({"ub_overlap_rs": True}, ValueError, "Userbuffer overlap"),
    ({"tp_size": 2, "parallel_mode": "column"}, ValueError, "bias with tp_size=2"),
    ({"use_grouped_tensor": "yes"}, TypeError, "use_grouped_tensor"),
    ({"parallel_mode": "diagonal"}, ValueError, "parallel_mode"),
])
def test_unsupported_constructor_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        GroupedLinear(2, 16, 8, **kwargs)


@pytest.mark.parametrize("recipe_name", [None, "current"])
def test_preallocated_buffers_receive_y_and_dx(recipe_name):
    """out: the returned y is the buffer, holding what a call without it returns; dgrad_out receives dx. The
    gradients are those of a call without buffers."""
    recipe = {None: None, "current": Float8CurrentScaling()}[recipe_name]
    module = GroupedLinear(3, 32, 48)
    x, splits = randn(64, 32), [16, 0, 48]

    def run(**buffers):
        x_in = x.clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x_in, splits, **buffers)
        y.square().sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return y, x_in.grad, grads

    y_ref, dx_ref, grads_ref = run()
    out, dgrad_out = torch.full((64, 48), float("nan")), torch.full((64, 32), float("nan"))
    y, dx, grads = run(out=out.detach(), dgrad_out=dgrad_out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, y_ref.detach()) and torch.equal(y, y_ref)
    assert torch.equal(dgrad_out, dx_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(g, g_ref) for g, g_ref in zip(grads, grads_ref))


@pytest.mark.parametrize("name, buffer, match", [
    ("out", torch.empty(16, 9), r"shape \(16, 9\) is not \(16, 8\)"),
    ("out", torch.empty(16, 8, dtype=torch.float64), "dtype torch.float64"),
    ("out", torch.empty(8, 16).t(), "not contiguous"),
    ("out", torch.empty(16, 8, requires_grad=True), "buffer.detach"),
    ("out", torch.empty(16, 8, device="meta"), "on meta"),
    ("dgrad_out", torch.empty(16, 8), r"shape \(16, 8\) is not \(16, 16\)"),
])
def test_bad_preallocated_buffers_are_named(name, buffer, match):
    with pytest.raises(ValueError, match=f"preallocated {name} buffer cannot be used: .*{match}"):
        GroupedLinear(2, 16, 8)(randn(16, 16), [8, 8], **{name: buffer})
    with pytest.raises(ValueError, match="needs a 2-D input"):
        GroupedLinear(2, 16, 8)(randn(2, 8, 16), [8, 8], out=torch.empty(2, 8))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        GroupedLinear(2, 16, 8)(randn(16, 16), [8, 8], out=[0.0])


def _compile_step(module, recipe):
    def step(x):
        return _run(module, x, recipe, m_splits=SPLITS)

    return step


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_no_graph_breaks(recipe_name, fresh_dynamo):
    recipe = RECIPES[recipe_name]
    step = _compile_step(GroupedLinear(len(SPLITS), IN, OUT), recipe)
    x = randn(sum(SPLITS), IN).requires_grad_()
    step(x).float().sum().backward()  # delayed scaling: the state exists before tracing
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_compiled_training_equals_eager(recipe_name, fresh_dynamo):
    """Three SGD steps, eager against fullgraph-compiled (aot_eager) from the same weights and state: bit-identical
    outputs, input gradients, weights and scaling state."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = GroupedLinear(len(SPLITS), IN, OUT)
    xs = [randn(sum(SPLITS), IN) for _ in range(4)]
    results = {}

    def train(step, module, inputs):
        outs = []
        for x in inputs:
            x = x.clone().requires_grad_()
            y = step(x)
            y.float().square().mean().backward()
            _sgd(module.parameters(), lr=0.01)
            outs.append((y.detach(), x.grad))
        return outs

    train(_compile_step(eager, recipe), eager, xs[:1])  # state and warm-up, then the two copies diverge
    compiled = copy.deepcopy(eager)
    results["eager"] = train(_compile_step(eager, recipe), eager, xs[1:])
    results["compiled"] = train(torch.compile(_compile_step(compiled, recipe), fullgraph=True, backend="aot_eager"), compiled, xs[1:])
    for (y_e, dx_e), (y_c, dx_c) in zip(results["eager"], results["compiled"]):
        assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p_c, p_e), name
    if recipe is not None and recipe.delayed():
        for key in ("scaling_fwd", "scaling_bwd"):
            for a, e in zip(_state([compiled], key), _state([eager], key)):
                assert torch.equal(a, e), key


def test_preallocated_buffers_trace_whole(fresh_dynamo):
    """With out / dgrad_out (fresh views of the buffers each call): one graph, no break, and the compiled step
    (fullgraph, aot_eager) gives eager's y, dx and buffer contents."""
    module = GroupedLinear(2, 32, 48)
    out, dgrad_out = torch.empty(32, 48), torch.empty(32, 32)

    def step(x):
        return module(x, [16, 16], out=out.detach(), dgrad_out=dgrad_out.detach())

    x = randn(32, 32).requires_grad_()
    y_eager = step(x)
    y_eager.sum().backward()
    y_eager, dx_eager, x.grad = y_eager.detach().clone(), x.grad.clone(), None  # (the next call writes the same buffers)
    out.fill_(float("nan"))
    dgrad_out.fill_(float("nan"))
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    y.sum().backward()
    assert torch.equal(y, y_eager) and torch.equal(x.grad, dx_eager) and torch.equal(dgrad_out, dx_eager)
