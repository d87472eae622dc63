"""torch.compile and delayed scaling: the scaling state a traced step builds, reads and updates (amaxes of repeated
and gradient-free calls, one grad amax a backward, static state tensors, reserved tensors, recompiles), compiled
against eager bit for bit as in test_compile.py."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch._compile import RECIPES, _scaling_state, _step_fn, _train
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format


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
