"""torch.compile over the TE modules: no graph breaks, and compiled steps equal eager ones bit for bit.

The compiled runs use ``backend="aot_eager"`` (Dynamo + AOTAutograd, eager kernels): on the CPU the catalog
ops trace as the reference backend's tensor ops, the very ones eager runs, so a compiled step must give
exactly the eager step's outputs, gradients and scaling state (amax histories, scales) after several
optimizer steps. Inductor compiles those tensor ops itself: its runs are compared by SQNR.
Delayed scaling builds its scaling state outside the graph on a module's first traced FP8 call (one
graph break, see ``TransformerEngineBaseModule._build_states_eagerly``), so fullgraph runs start from
one eager step, as a model does that ran before it was compiled.

The delayed-scaling state under tracing: test_compile_delayed.py; how the catalog ops trace: test_compile_ops.py;
Inductor on the GPU: test_compile_gpu.py; the modules and helpers they share: _compile.py.
"""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch._compile import ATTENTION_MODULES, MODULES, RECIPES, _assert_inductor_tracks_eager, _scaling_state, _step_fn, _train
from tests.utils import sqnr
from transformer_engine.common.recipe import MXFP8BlockScaling, NVFP4BlockScaling


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
    ``dot_product_attention._sdpa``): in high precision the results agree to float32 precision;
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
