"""torch.compile over the TE modules: no graph breaks, and compiled steps equal eager ones bit for bit.

The compiled runs use ``backend="aot_eager"`` (Dynamo + AOTAutograd, eager kernels): on the CPU the catalog
ops trace as the reference backend's tensor ops, the very ones eager runs, so a compiled step must give
exactly the eager step's outputs, gradients and scaling state (amax histories, scales) after several
optimizer steps. Inductor compiles those tensor ops itself: its runs are compared by SQNR.
Delayed scaling builds its scaling state outside the graph on a module's first traced FP8 call (one
graph break, see ``TransformerEngineBaseModule._build_states_eagerly``), so fullgraph runs start from
one eager step, as a model does that ran before it was compiled.
"""

import copy
import subprocess
import sys

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import sqnr
from transformer_engine.common.recipe import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
)

RECIPES = {
    "bf16": None,
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
}
MODULES = {
    "Linear": lambda: te.Linear(64, 32),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 48),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128),
    "LayerNormMLP_swiglu_rms": lambda: te.LayerNormMLP(64, 128, activation="swiglu", normalization="RMSNorm"),
    "LayerNorm": lambda: te.LayerNorm(64),
    "RMSNorm": lambda: te.RMSNorm(64),
    # two modules under one autocast: their backward states are updated together at the end of backward
    "two_Linears": lambda: torch.nn.Sequential(te.Linear(64, 64), te.Linear(64, 64)),
}


class _SelfAttention(torch.nn.Module):
    """te.DotProductAttention on q = k = v = x viewed as [s, b, 4 heads, 16]."""

    def __init__(self, **kwargs):
        super().__init__()
        self.attention = te.DotProductAttention(4, 16, **kwargs)

    def forward(self, x):
        heads = x.view(*x.shape[:-1], 4, 16)
        return self.attention(heads, heads, heads)


#: attention modules: under torch.compile their attention is PyTorch's SDPA (the same math, not the same
#: rounding as the reference backend's), so compiled and eager agree to float32 precision, not bit for bit
ATTENTION_MODULES = {
    "DotProductAttention": lambda: _SelfAttention(attention_dropout=0.0),
    "DotProductAttention_causal": lambda: _SelfAttention(attention_dropout=0.0, attn_mask_type="causal"),
    "MultiheadAttention": lambda: te.MultiheadAttention(64, 4, attention_dropout=0.0, attn_mask_type="causal"),
    "TransformerLayer": lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0),
    "TransformerLayer_gqa_rms_swiglu": lambda: te.TransformerLayer(
        64, 128, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", hidden_dropout=0.0,
        attention_dropout=0.0),
}


def _step_fn(module, recipe):
    def step(x):
        if recipe is None:
            return module(x)
        with te.autocast(recipe=recipe):
            return module(x)

    return step


def _train(step, module, xs, loss=lambda y: y.float().square().mean(), lr=0.01):
    """Forward + backward + SGD on each input; returns the outputs and input gradients."""
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=lr) if params else None
    outs = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        y = step(x)
        loss(y).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        outs.append((y.detach().clone(), x.grad.clone()))  # clones: a CUDA-graph replay reuses its outputs
    return outs


def _scaling_state(module):
    """{(submodule name, role): (amax_history, scale, scale_inv)} of every delayed-scaling state in ``module``."""
    state = {}
    for name, sub in module.named_modules():
        for role in ("scaling_fwd", "scaling_bwd"):
            meta = getattr(sub, "fp8_meta", {}).get(role)
            if meta is not None and getattr(meta, "has_amax_history", False):
                state[(name, role)] = (meta.amax_history.clone(), meta.scale.clone(), meta.scale_inv.clone())
    return state


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module_name", list(MODULES) + list(ATTENTION_MODULES) + ["TransformerLayer_dropout"])
def test_no_graph_breaks(module_name, recipe_name):
    table = {**MODULES, **ATTENTION_MODULES, "TransformerLayer_dropout": lambda: te.TransformerLayer(64, 128, 4)}
    module, recipe = table[module_name](), RECIPES[recipe_name]
    step = _step_fn(module, recipe)
    x = torch.randn(16, 2, 64, requires_grad=True)
    step(x).float().sum().backward()  # delayed scaling: the state exists before tracing
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module_name", list(MODULES))
def test_compiled_training_equals_eager(module_name, recipe_name):
    """Three SGD steps, eager against fullgraph-compiled from the same weights and state: bit-identical
    outputs, input gradients, weights and scaling state."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = MODULES[module_name]()
    xs = [torch.randn(16, 2, 64) for _ in range(4)]
    _train(_step_fn(eager, recipe), eager, xs[:1])  # state and warm-up, then the two copies diverge
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs[1:]), _train(step, compiled, xs[1:])):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_c, p_e, rtol=0, atol=0, msg=name)
    expected, actual = _scaling_state(eager), _scaling_state(compiled)
    assert actual.keys() == expected.keys()
    for role in expected:
        for a, e in zip(actual[role], expected[role]):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=role)
    if recipe is not None and recipe.delayed() and module_name not in ("LayerNorm", "RMSNorm"):
        assert any(role == "scaling_bwd" and h.abs().sum() > 0 for (_, role), (h, _, _) in expected.items())


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
@pytest.mark.parametrize("module_name", list(ATTENTION_MODULES))
def test_compiled_attention_modules_track_eager(module_name, recipe_name):
    """Three SGD steps, fullgraph-compiled against eager. The compiled attention is SDPA (see
    ``dot_product_attention._traced_sdpa``): in high precision the results agree to float32 precision;
    under FP8 a float32-sized difference may move single casts across a rounding boundary (one E4M3 step
    is 2^-3 relative), so the results are compared by SQNR: 40 dB, far above FP8's own noise (~25-30 dB
    against high precision) and far below what a wrong scale or operand gives."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = ATTENTION_MODULES[module_name]()
    xs = [torch.randn(16, 2, 64) for _ in range(4)]
    _train(_step_fn(eager, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs[1:]), _train(step, compiled, xs[1:])):
        for actual, expected in ((y_c, y_e), (dx_c, dx_e)):
            if recipe is None:
                torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
            else:
                assert sqnr(expected, actual) > 40.0
    expected, actual = _scaling_state(eager), _scaling_state(compiled)
    assert actual.keys() == expected.keys()
    for key in expected:  # amaxes of float32-close tensors; every history rolled and scale updated alike
        for a, e in zip(actual[key], expected[key]):
            torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-6, msg=str(key))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("module_name", ["Linear", "LayerNormMLP"])
def test_inductor_training_tracks_eager(module_name, recipe_name):
    """Inductor (CPU), fullgraph, gradients large enough that a stale scale would saturate the FP8 casts,
    over three steps: compiled outputs and input gradients sit closer to eager's than FP8's own
    rounding noise (eager against high precision). Guards against the partitioner recomputing, in
    backward, a cast whose scale the forward's update has since overwritten.

    Inductor compiles the reference backend's tensor ops itself, so it is not bit for bit: it is told to
    keep eager's roundings to bf16 (``emulate_precision_casts``), and a one-ulp FP8 difference in an
    early step still moves later weights a little."""
    eager = MODULES[module_name]().to(torch.bfloat16)
    big = {"loss": lambda y: y.float().square().sum(), "lr": 1e-3}
    _assert_inductor_tracks_eager(eager, RECIPES[recipe_name], [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(4)], **big)


def _assert_inductor_tracks_eager(eager, recipe, xs, **train_kwargs):
    """One eager step of ``eager`` on xs[0], then copies trained on xs[1:] eagerly, compiled by Inductor
    (fullgraph, told to keep eager's roundings to bf16) and in high precision: the compiled outputs and
    input gradients must sit closer to eager's than FP8's own rounding noise (eager against high
    precision; at most 40 dB asked, which is also the bar without FP8). Different kernels round an FP8
    element here and there the other way; a wrong scale or operand lands far below that bar."""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    _train(_step_fn(eager, recipe), eager, xs[:1], **train_kwargs)
    compiled, high_precision = copy.deepcopy(eager), copy.deepcopy(eager)
    with inductor_config.patch(emulate_precision_casts=True):
        step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="inductor")
        runs = zip(_train(_step_fn(eager, recipe), eager, xs[1:], **train_kwargs), _train(step, compiled, xs[1:], **train_kwargs),
                   _train(_step_fn(high_precision, None), high_precision, xs[1:], **train_kwargs))
        for (y_e, dx_e), (y_c, dx_c), (y_h, dx_h) in runs:
            assert sqnr(y_e, y_c) > min(sqnr(y_h, y_e), 40.0)
            assert sqnr(dx_e, dx_c) > min(sqnr(dx_h, dx_e), 40.0)
    return eager, compiled


#: MXFP8 and NVFP4 (emulated): every GEMM dim a multiple of 32; NVFP4 without stochastic rounding, whose random bits
#: eager and compiled runs would draw from different generator states
BLOCK_RECIPES = {"mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True)}
BLOCK_MODULES = {
    "Linear": lambda: te.Linear(64, 64),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128),
    "TransformerLayer": lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0),
}


@pytest.mark.parametrize("recipe_name", list(BLOCK_RECIPES))
@pytest.mark.parametrize("module_name", list(BLOCK_MODULES))
def test_mxfp8_and_nvfp4_trace_whole_and_train_as_eagerly(module_name, recipe_name):
    """One graph, no break, and three compiled (aot_eager) SGD steps as eager ones: bit for bit, but for the
    TransformerLayer, whose compiled attention is SDPA (float32-close; see test_compiled_attention_modules_track_eager)."""
    recipe = BLOCK_RECIPES[recipe_name]
    eager = BLOCK_MODULES[module_name]()
    compiled = copy.deepcopy(eager)
    xs = [torch.randn(16, 2, 64) for _ in range(3)]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_step_fn(copy.deepcopy(eager), recipe))(xs[0].clone().requires_grad_())
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="aot_eager")
    exact = module_name != "TransformerLayer"
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs), _train(step, compiled, xs)):
        for actual, expected in ((y_c, y_e), (dx_c, dx_e)):
            assert torch.equal(actual, expected) if exact else sqnr(expected, actual) > 40.0
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):  # (a key bias stays ~0: no SQNR)
        torch.testing.assert_close(p_c, p_e, rtol=0 if exact else 1e-3, atol=0 if exact else 1e-5, msg=name)


def _assert_same_scaling_state(compiled, eager):
    expected, actual = _scaling_state(eager), _scaling_state(compiled)
    assert actual.keys() == expected.keys()
    for key in expected:
        for a, e in zip(actual[key], expected[key]):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=str(key))


def _train_delayed_both_ways(make_step, xs):
    """The steps ``make_step(module)`` of a LayerNormMLP, eager and fullgraph-compiled (aot_eager) from one
    eager warm-up step: bit-identical outputs, input gradients and scaling state."""
    torch._dynamo.reset()
    eager = te.LayerNormMLP(64, 128)
    _train(make_step(eager), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    step = torch.compile(make_step(compiled), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(make_step(eager), eager, xs[1:]), _train(step, compiled, xs[1:])):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    _assert_same_scaling_state(compiled, eager)
    return eager, compiled


def test_compiled_module_under_an_eager_autocast_equals_eager():
    """The autocast outside the compiled call (its update runs eagerly at exit): the traced casts write their
    amaxes into the histories themselves, which the eager update then reads, as in an eager step."""
    recipe, xs = RECIPES["delayed"], [torch.randn(16, 2, 64) for _ in range(4)]
    torch._dynamo.reset()
    eager = te.LayerNormMLP(64, 128)
    _train(_step_fn(eager, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    compiled_module = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    runs = zip(_train(_step_fn(eager, recipe), eager, xs[1:]), _train(_step_fn(compiled_module, recipe), compiled, xs[1:]))
    for (y_e, dx_e), (y_c, dx_c) in runs:
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    _assert_same_scaling_state(compiled, eager)


def test_module_called_twice_in_one_traced_autocast_keeps_the_larger_amax():
    """One module run twice in one step: each slot's amax is the larger of its two casts', forward (the
    buffer the traced update folds in) and backward (the amaxes one backward hands its update)."""
    def make_step(module):
        def step(x):
            with te.autocast(recipe=RECIPES["delayed"]):
                return module(module(x) * 3.0)
        return step

    _train_delayed_both_ways(make_step, [torch.randn(16, 2, 64) for _ in range(4)])


def test_traced_forward_without_grad_leaves_its_amaxes_in_the_history():
    """Under torch.no_grad the autocast's exit runs no update: the amaxes of a traced forward go into the
    histories' row 0, as an eager forward leaves them, for the next training step's update."""
    recipe = RECIPES["delayed"]

    def make_step(module):
        def step(x):
            with torch.no_grad(), te.autocast(recipe=recipe):
                module(x * 4.0)
            with te.autocast(recipe=recipe):
                return module(x)
        return step

    eager, _ = _train_delayed_both_ways(make_step, [torch.randn(16, 2, 64) for _ in range(3)])
    with torch.no_grad(), te.autocast(recipe=recipe):
        eager(torch.randn(16, 2, 64))
    assert eager.fp8_meta["scaling_fwd"].amax_history[0].abs().sum() > 0  # what this test relies on eagerly


def test_traced_backward_hands_one_grad_amax_to_its_update_without_a_stack():
    """A Linear's backward casts dy alone (slot 0 of its backward state): its update reads that amax as is,
    one element, rather than a stack of every slot with zeros for those not cast (a kernel per module and
    step). test_compiled_training_equals_eager checks the values."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def record_backward(graph, _):
        backward_ops.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return make_boxed_func(graph)

    module = te.Linear(64, 32)
    with te.autocast(recipe=RECIPES["delayed"]):  # the states, built eagerly
        module(torch.randn(16, 64))
    backend = aot_autograd(fw_compiler=lambda graph, _: make_boxed_func(graph), bw_compiler=record_backward)
    torch.compile(_step_fn(module, RECIPES["delayed"]), backend=backend)(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert "aten.roll.default" in backward_ops  # the update (the reference backend's tensor ops on the CPU)
    assert not [op for op in backward_ops if "stack" in op or "new_zeros" in op], backward_ops


def test_delayed_state_tensors_are_static_addresses():
    """The state tensors carry what torch._dynamo.mark_static_address sets (set without importing Dynamo)."""
    from transformer_engine.pytorch.quantization.recipe_state import _static

    marked = torch.zeros(2)
    torch._dynamo.mark_static_address(marked, guard=False)
    assert _static(torch.zeros(2))._dynamo_static_input_type == marked._dynamo_static_input_type
    module = te.Linear(64, 32)
    with te.autocast(recipe=RECIPES["delayed"]):
        module(torch.randn(16, 64))
    state = module.fp8_meta["scaling_bwd"]
    assert all(t._dynamo_static_input_type == "unguarded" for t in (state.scale, state.scale_inv, state.amax_history))


def test_fresh_module_traces_whole_under_delayed_scaling():
    """A module that never ran FP8, compiled with fullgraph under DelayedScaling of the default history
    length: its scaling tensors were reserved at construction, so the first traced step needs no graph
    break, and the steps equal eager ones."""
    torch._dynamo.reset()
    recipe = DelayedScaling()
    eager = te.LayerNormMLP(64, 128)
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, backend="aot_eager")
    xs = [torch.randn(32, 64) for _ in range(3)]
    big = {"loss": lambda y: y.float().square().sum(), "lr": 1e-3}
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs, **big), _train(step, compiled, xs, **big)):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    for key, tensors in _scaling_state(eager).items():
        for a, e in zip(_scaling_state(compiled)[key], tensors):
            torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_reserved_state_on_another_device_is_not_taken_while_traced():
    """Reserved tensors left on another device (a module moved after construction) do not fit: the first
    traced step builds the state outside the graph (one break) instead of inside it (which AOTAutograd
    rejects), and the steps equal eager ones."""
    torch._dynamo.reset()
    recipe = DelayedScaling()
    eager = te.Linear(64, 32)
    compiled = copy.deepcopy(eager)
    compiled._reserved_states = {mode: tuple(t.to("meta") for t in tensors) for mode, tensors in compiled._reserved_states.items()}
    step = torch.compile(_step_fn(compiled, recipe), backend="aot_eager")
    xs = [torch.randn(32, 64) for _ in range(3)]
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs), _train(step, compiled, xs)):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    assert compiled.fp8_meta["scaling_fwd"].amax_history.device.type == "cpu"


def test_deprecated_fp8_autocast_traces_without_breaks():
    """``te.fp8_autocast`` (what HF Accelerate wraps each forward in) traces whole; it warns only eagerly."""
    module, recipe = te.Linear(64, 32), RECIPES["delayed"]

    def step(x):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            return module(x)

    x = torch.randn(16, 64)
    with pytest.warns(DeprecationWarning):
        step(x).sum().backward()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


def test_first_traced_delayed_step_builds_state_eagerly():
    """A module that never ran FP8: its first compiled step (default fullgraph=False) gives the eager
    result, with one graph break for the state; later steps trace whole."""
    torch._dynamo.reset()
    recipe = RECIPES["delayed"]
    eager = te.Linear(64, 32)
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), backend="aot_eager")
    xs = [torch.randn(32, 64) for _ in range(3)]
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs), _train(step, compiled, xs)):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    for a, e in zip(_scaling_state(compiled)[("", "scaling_bwd")], _scaling_state(eager)[("", "scaling_bwd")]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
@pytest.mark.parametrize("module_name", ["Linear", "LayerNormMLP", "two_Linears"])
def test_under_torch_autocast(module_name, recipe_name):
    """HF Accelerate's FP8 step: the modules under torch.autocast(bf16) and the FP8 autocast, compiled
    fullgraph: traces (torch 2.11-2.13 refused an autocast state set inside a module's Function) and
    equals eager bit for bit over three SGD steps."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = MODULES[module_name]()

    def step_fn(module):
        inner = _step_fn(module, recipe)

        def step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return inner(x)

        return step

    xs = [torch.randn(16, 2, 64) for _ in range(4)]
    _train(step_fn(eager), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    step = torch.compile(step_fn(compiled), fullgraph=True, backend="aot_eager")
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(step_fn(eager), eager, xs[1:]), _train(step, compiled, xs[1:])):
        assert y_c.dtype == y_e.dtype == torch.bfloat16
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_dynamic_shapes(recipe_name):
    """dynamic=True: one graph for every token count, results equal to eager."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = te.LayerNormMLP(64, 128)
    _train(_step_fn(eager, recipe), eager, [torch.randn(16, 64)])
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True, dynamic=True, backend="aot_eager")
    xs = [torch.randn(rows, 64) for rows in (16, 48, 32)]
    for (y_e, dx_e), (y_c, dx_c) in zip(_train(_step_fn(eager, recipe), eager, xs), _train(step, compiled, xs)):
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)


def test_recompiles_on_recipe_change_only():
    """The call that builds a module's scaling state changes what the next trace sees (one recompile);
    after it, identical steps reuse the graph and only another recipe recompiles."""
    torch._dynamo.reset()
    module = te.Linear(64, 32)
    recipe = {"r": RECIPES["current"]}

    def step(x):
        with te.autocast(recipe=recipe["r"]):
            return module(x)

    counting = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    x = torch.randn(16, 64)
    compiled(x)  # builds the state inside the graph
    compiled(x)
    frames = counting.frame_count
    compiled(x)
    compiled(torch.randn(16, 64))
    assert counting.frame_count == frames
    recipe["r"] = Float8CurrentScaling(fp8_format=Format.E4M3)
    compiled(x)
    assert counting.frame_count == frames + 1


def test_eager_use_imports_no_dynamo():
    """Building a module and running a training step eagerly leaves torch._dynamo unimported (it costs over
    a second): the compile paths are set up without it."""
    code = ("import sys, torch, transformer_engine.pytorch as te; from transformer_engine.common.recipe import DelayedScaling\n"
            "m = te.LayerNormMLP(32, 64)\n"
            "with te.autocast(recipe=DelayedScaling()):\n    y = m(torch.randn(16, 32))\n"
            "y.sum().backward()\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _traced_cast(monkeypatch, mode):
    """(target names in the Dynamo graph, compiled results, eager results, the amax written) of one
    ``ops.cast_transpose`` under ``TE_FL_COMPILE_OPS=mode``."""
    from transformer_engine.plugin import ops

    monkeypatch.setenv("TE_FL_COMPILE_OPS", mode)
    torch._dynamo.reset()
    ops.prepare_for_compile()
    x, scale, amax = torch.randn(8, 32), torch.tensor(4.0), torch.zeros(())

    def cast(x):
        q, q_t, scale_inv, amax_out = ops.cast_transpose(x, scale, torch.float8_e4m3fn, amax)
        return q.float() * scale_inv, q_t, amax_out

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(cast, backend=backend, fullgraph=True)
    expected = cast(x)
    amax.zero_()
    actual = compiled(x)
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    return targets, actual, expected, amax == x.abs().max()


@pytest.mark.parametrize("mode", ["traced", "custom_op"])
def test_catalog_ops_trace_as_tensor_ops_or_custom_ops(monkeypatch, mode):
    """By default an op traces as the tensor ops of its compiled form (here the reference backend's, which
    Inductor compiles); under TE_FL_COMPILE_OPS=custom_op as torch.ops.te_fl.<name>, whose fake
    implementation gives the shapes and dtypes of the real one. Both compute what eager does."""
    targets, actual, expected, amax_written = _traced_cast(monkeypatch, mode)
    custom_ops = {t for t in targets if t.startswith("te_fl.")}
    assert custom_ops == ({"te_fl.cast_transpose.default"} if mode == "custom_op" else set())
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a.float(), e.float(), rtol=0, atol=0)
    assert amax_written


def test_unknown_compile_ops_mode_is_named(monkeypatch):
    with pytest.raises(Exception, match="TE_FL_COMPILE_OPS='inline': use 'traced'"):
        _traced_cast(monkeypatch, "inline")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module_name", ["Linear", "LayerNormLinear", "LayerNormMLP", "LayerNormMLP_swiglu_rms"])
def test_inductor_on_gpu_matches_eager(module_name, recipe_name):
    """Inductor on the GPU, fullgraph: Inductor's kernels for the reference backend's tensor ops, the
    cuBLASLt GEMMs through torch._scaled_mm; outputs and gradients track eager's flagos and vendor kernels
    (see ``_assert_inductor_tracks_eager``), and the amax histories agree over three steps."""
    with torch.device("cuda"):
        module = MODULES[module_name]().to(torch.bfloat16)
        xs = [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(4)]
    eager, compiled = _assert_inductor_tracks_eager(module, RECIPES[recipe_name], xs)
    expected, actual = _scaling_state(eager), _scaling_state(compiled)
    for role in expected:
        torch.testing.assert_close(actual[role][0], expected[role][0], rtol=0.02, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["bf16", "current", "delayed"])
def test_reduce_overhead_training_step_on_gpu(recipe_name):
    """mode="reduce-overhead" (CUDA graphs through Inductor) on a training step, dynamic token counts
    off: the loss follows eager's over several SGD steps."""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    with torch.device("cuda"):
        eager = te.LayerNormMLP(64, 256, params_dtype=torch.bfloat16)
        xs = [torch.randn(128, 64, dtype=torch.bfloat16) for _ in range(6)]
    _train(_step_fn(eager, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), mode="reduce-overhead", fullgraph=True)
    for (y_e, _), (y_c, _) in zip(_train(_step_fn(eager, recipe), eager, xs[1:]), _train(step, compiled, xs[1:])):
        torch.testing.assert_close(y_c, y_e, rtol=0.05, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("cpp_wrapper", [False, True])
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_dynamic_shapes_on_gpu_use_the_fast_kernels(recipe_name, cpp_wrapper):
    """dynamic=True on the GPU (Inductor's Python or C++ wrapper): at every token count the compiled steps
    track eager ones, and the graphs hold cuBLASLt's GEMMs (torch._scaled_mm for FP8) and the traced casts:
    nothing falls back to the reference backend's float32 GEMM or to an opaque dispatch."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    eager = te.Linear(64, 64, device="cuda", params_dtype=torch.bfloat16)
    _train(_step_fn(eager, recipe), eager, [torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)])
    compiled = copy.deepcopy(eager)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    step = torch.compile(_step_fn(compiled, recipe), backend=inductor, dynamic=True, fullgraph=True)
    xs = [torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16) for rows in (32, 96, 160)]
    with inductor_config.patch(cpp_wrapper=cpp_wrapper):
        runs = list(zip(_train(_step_fn(eager, recipe), eager, xs), _train(step, compiled, xs)))
    for (y_e, dx_e), (y_c, dx_c) in runs:
        assert sqnr(y_e, y_c) > 30.0 and sqnr(dx_e, dx_c) > 30.0
    targets = [str(node.target) for graph in graphs for gm in graph.modules() if isinstance(gm, torch.fx.GraphModule)
               for node in gm.graph.nodes if node.op == "call_function"]  # module Functions: fwd / bwd subgraphs
    custom_ops = {t for t in targets if "te_fl" in t}
    assert not custom_ops, custom_ops
    if recipe is not None:  # dy's cast with the bias gradient: the flagos Triton kernel itself, which Inductor launches
        assert any("triton_kernel_wrapper" in t for t in targets), targets
    gemms = ("_scaled_mm",) if recipe is not None else ("method mm ", "method addmm ")
    assert any(gemm in t for t in targets for gemm in gemms), targets


@pytest.mark.gpu
@pytest.mark.parametrize("cpp_wrapper", [False, True])
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_transformer_layer_inductor_on_gpu_tracks_eager(recipe_name, cpp_wrapper):
    """te.TransformerLayer (bf16 parameters, no dropout) fullgraph under Inductor on the GPU, with Inductor's
    Python wrapper and with its C++ one (``cpp_wrapper``, which launches the same kernels, ours included, from
    generated C++): three steps track eager by SQNR (the compiled attention is SDPA, the eager one the vendor
    backend's cuDNN call: two bf16 kernels, so no bit equality; 30 dB is far above what a wrong scale or
    operand gives). The C++ wrapper is set for the whole run, as ``TORCHINDUCTOR_CPP_WRAPPER=1`` sets it: the
    backward graph compiles at the first backward (torch 2.11 does not carry ``options={"cpp_wrapper": True}``
    there)."""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    with torch.device("cuda"):
        eager = te.TransformerLayer(128, 512, 2, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                                    self_attn_mask_type="causal")
        xs = [torch.randn(64, 4, 128, dtype=torch.bfloat16) for _ in range(4)]
    _train(_step_fn(eager, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    step = torch.compile(_step_fn(compiled, recipe), fullgraph=True)
    with inductor_config.patch(cpp_wrapper=cpp_wrapper):
        runs = list(zip(_train(_step_fn(eager, recipe), eager, xs[1:]), _train(step, compiled, xs[1:])))
    for (y_e, dx_e), (y_c, dx_c) in runs:
        assert sqnr(y_e, y_c) > 30.0 and sqnr(dx_e, dx_c) > 30.0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current"])
def test_training_step_on_gpu_never_synchronizes(recipe_name):
    """A warm training step of te.TransformerLayer (dropout on), eager and compiled by Inductor, makes no
    synchronizing CUDA call (torch's sync debug mode raises on one): a sync makes the host wait for the
    GPU, so a host-bound step can no longer run ahead. (A CPU tensor written into a device one in a
    traced update once cost a compiled FP8 step three of them.)"""
    torch._dynamo.reset()
    recipe = RECIPES[recipe_name]
    with torch.device("cuda"):
        layer = te.TransformerLayer(128, 512, 2, params_dtype=torch.bfloat16, self_attn_mask_type="causal")
        x = torch.randn(64, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    eager = _step_fn(layer, recipe)
    compiled = torch.compile(_step_fn(layer, recipe), fullgraph=True)
    for step in (eager, compiled):
        for _ in range(2):  # warm: the state built, the graphs compiled
            step(x).float().sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(x).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
