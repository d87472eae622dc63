"""torch.compile on the GPU: Inductor (reduce-overhead, dynamic shapes, its C++ wrapper) tracks eager over training steps,
and a compiled training step never synchronizes."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch._compile import MODULES, RECIPES, _assert_inductor_tracks_eager, _scaling_state, _step_fn, _train
from tests.utils import sqnr


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
    # bf16: te.Linear runs torch.nn.functional.linear where vendor.cuda's GEMM (PyTorch's matmul) is the first choice
    gemms = ("_scaled_mm",) if recipe is not None else ("function linear>",)
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
