"""make_graphed_callables: graphed modules match eager ones step for step (FP8 scaling state included).

The argument checks run everywhere; the captures need a CUDA GPU (``gpu`` marker).
"""

import copy
import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch.quantization.autocast import current_config

from tests.utils import DTYPE_TOLS

HIDDEN, TOKENS = 64, 32


def _fp8_or_skip():
    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        pytest.skip(reason)


# --------------------------------------------------------------------------- argument checks (any device)


def test_alias_and_new_name_together_is_an_error():
    with pytest.raises(ValueError, match="fp8_enabled is the deprecated name of enabled"):
        te.make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), enabled=True, fp8_enabled=True)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="fp8_enable"):
        te.make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), fp8_enable=True)


def test_weight_caching_of_a_callable_captured_twice_is_refused():
    layer = torch.nn.Linear(4, 4)
    with pytest.warns(DeprecationWarning, match="fp8_weight_caching"):
        with pytest.raises(NotImplementedError, match="a callable captured more than once"):
            te.make_graphed_callables((layer, layer), ((torch.randn(2, 4),), (torch.randn(2, 4),)), enabled=True,
                                      fp8_weight_caching=True)


def test_sample_args_per_callable_are_checked():
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="a tuple of 2 tuples, one per callable"):
        te.make_graphed_callables(layers, (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="enabled has 3 entries for 2 callables"):
        te.make_graphed_callables(layers, ((torch.randn(2, 4),), (torch.randn(2, 4),)), enabled=(True, False, True))
    with pytest.raises(ValueError, match="enabled has 3 entries for 2 callables"):  # lists of args pass the check, as in TE
        te.make_graphed_callables(layers, [[torch.randn(2, 4)], (torch.randn(2, 4),)], enabled=(True, False, True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_cpu_has_no_cuda_graphs():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        te.make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


# --------------------------------------------------------------------------- captures (GPU)


def _train(model, optimizer, inputs, grads, recipe):
    """SGD steps; returns each step's output and the parameters' gradients."""
    outputs, param_grads = [], []
    for x, dy in zip(inputs, grads):
        optimizer.zero_grad(set_to_none=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.backward(dy)
        outputs.append(y.detach().clone())
        param_grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return outputs, param_grads


def _scaling_tensors(model):
    found = []
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key) if meta else None
            if state is not None and state.has_amax_history:
                found += [state.amax_history, state.scale, state.scale_inv]
    return found


def _layer():
    return te.TransformerLayer(HIDDEN, 4 * HIDDEN, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), Float8CurrentScaling()],
                         ids=["bf16", "delayed", "current"])
@pytest.mark.parametrize("build", [lambda: te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"), _layer],
                         ids=["Linear", "TransformerLayer"])
def test_graphed_training_matches_eager(build, recipe):
    if recipe is not None:
        _fp8_or_skip()
    torch.manual_seed(1234)  # reproducible data: at lr 0.1 some draws take a bf16 layer non-finite within 4 steps
    eager = build()
    graphed = copy.deepcopy(eager)
    shape = (TOKENS, 2, HIDDEN) if isinstance(eager, te.TransformerLayer) else (TOKENS, HIDDEN)
    sample = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (sample,), enabled=recipe is not None, recipe=recipe)
    for tensor in _scaling_tensors(graphed):  # warm-up left no trace in the scaling state
        assert torch.equal(tensor, torch.zeros_like(tensor) if tensor.dim() == 2 else torch.ones_like(tensor))
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    grads = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    expected = _train(eager, torch.optim.SGD(eager.parameters(), lr=0.1), inputs, grads, recipe)
    actual = _train(graphed, torch.optim.SGD(graphed.parameters(), lr=0.1), inputs, grads, recipe)
    tols = DTYPE_TOLS[torch.bfloat16]
    for y_eager, y_graphed in zip(expected[0], actual[0]):
        torch.testing.assert_close(y_graphed, y_eager, **tols)
    for g_eager, g_graphed in zip(expected[1], actual[1]):
        for a, b in zip(g_graphed, g_eager):
            torch.testing.assert_close(a, b, **tols)
    for a, b in zip(_scaling_tensors(graphed), _scaling_tensors(eager)):  # the updates ran inside the graphs
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


def _layer_mlp():
    return te.LayerNormMLP(HIDDEN, 4 * HIDDEN, params_dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("build", [lambda: te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"), _layer_mlp, _layer],
                         ids=["Linear", "LayerNormMLP", "TransformerLayer"])
def test_cached_fp8_weights_over_micro_batches_match_eager(build, recipe):
    """cache_quantized_params: three optimizer steps of two micro-batches each, is_first_microbatch True then False,
    graphed as eager (the second micro-batch reads the weights the first cast; the optimizer changes them between steps)."""
    _fp8_or_skip()
    torch.manual_seed(1234)
    eager = build()
    graphed = copy.deepcopy(eager)
    shape = (TOKENS, 2, HIDDEN) if isinstance(eager, te.TransformerLayer) else (TOKENS, HIDDEN)
    sample = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (sample,), enabled=True, recipe=recipe, cache_quantized_params=True)
    with pytest.raises(TypeError, match="each call takes is_first_microbatch"):
        graphed(sample)
    results = []
    for model in (eager, graphed):
        optimizer, outputs = torch.optim.SGD(model.parameters(), lr=0.1), []
        torch.manual_seed(7)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            for micro_batch in range(2):
                x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                with te.autocast(recipe=recipe):
                    y = model(x, is_first_microbatch=micro_batch == 0)
                y.backward(torch.randn_like(y))
                outputs.append(y.detach().clone())
            optimizer.step()
        results.append((outputs, [p.detach().clone() for p in model.parameters()], _scaling_tensors(model)))
    (eager_out, eager_params, eager_state), (graph_out, graph_params, graph_state) = results
    for a, b in zip(graph_out + graph_params, eager_out + eager_params):
        torch.testing.assert_close(a, b, **DTYPE_TOLS[torch.bfloat16])
    for a, b in zip(graph_state, eager_state):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


@pytest.mark.gpu
def test_weight_caching_without_fp8_takes_is_first_microbatch_and_replays_one_capture():
    reference = te.Linear(HIDDEN, HIDDEN, device="cuda")
    layer = te.make_graphed_callables(copy.deepcopy(reference), (torch.randn(TOKENS, HIDDEN, device="cuda"),),
                                      cache_quantized_params=True)
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    with pytest.raises(TypeError, match="each call takes is_first_microbatch"):
        layer(x)
    expected = reference(x)
    for first in (True, False):
        torch.testing.assert_close(layer(x, is_first_microbatch=first), expected, **DTYPE_TOLS[torch.float32])


@pytest.mark.gpu
def test_gradients_accumulate_over_micro_batches():
    """Two backward passes without zero_grad add up: .grad never aliases the graph's static buffer."""
    layer = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device="cuda")
    reference = copy.deepcopy(layer)
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    layer = te.make_graphed_callables(layer, (x,))
    dys = [torch.randn(TOKENS, HIDDEN, device="cuda") for _ in range(2)]
    for dy in dys:
        layer(x).backward(dy)
        reference(x).backward(dy)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, **DTYPE_TOLS[torch.float32])


@pytest.mark.gpu
def test_two_callables_chain_and_dropout_draws_anew():
    first = te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    second = te.TransformerLayer(HIDDEN, 2 * HIDDEN, 4, hidden_dropout=0.5, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(TOKENS, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(TOKENS, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    first, second = te.make_graphed_callables((first, second), ((x,), (h,)))
    y1 = second(first(x)).clone()
    y2 = second(first(x))
    assert not torch.equal(y1, y2)  # a new keep mask at each replay
    y2.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in (*first.parameters(), *second.parameters()))


@pytest.mark.gpu
def test_calls_are_checked_and_eval_runs_eagerly():
    layer = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    graphed = te.make_graphed_callables(layer, (x,))
    with pytest.raises(ValueError, match="static in a CUDA graph"):
        graphed(torch.randn(TOKENS + 1, HIDDEN, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="structure"):
        graphed(x, x)
    graphed.eval()
    y = graphed(torch.randn(TOKENS + 1, HIDDEN, device="cuda", dtype=torch.bfloat16))  # eager: any shape
    assert y.shape == (TOKENS + 1, HIDDEN)


@pytest.mark.gpu
def test_capture_leaves_the_callers_autocast_alone():
    _fp8_or_skip()
    recipe = DelayedScaling()
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with te.autocast(enabled=False):
        te.make_graphed_callables(te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"), (x,),
                                  enabled=True, recipe=recipe)
        assert current_config().enabled is False


@pytest.mark.gpu
def test_graphed_attention_dropout_on_a_tracker_stream_draws_anew():
    """Attention dropout forked onto a CudaRNGStatesTracker stream captures (the fork swaps generator objects,
    not set_rng_state, which capture forbids) and each replay draws new masks from that stream, leaving the
    default generator's eager draws alone."""
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    layer = te.TransformerLayer(HIDDEN, 2 * HIDDEN, 4, hidden_dropout=0.0, attention_dropout=0.5, get_rng_state_tracker=lambda: tracker,
                                params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(TOKENS, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(layer, (x,))
    y1, y2 = graphed(x).clone(), graphed(x).clone()
    assert not torch.equal(y1, y2)  # fresh attention masks at each replay
    graphed(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    before = tracker.get_states()["model-parallel-rng"].get_state()
    graphed(x)
    assert not torch.equal(tracker.get_states()["model-parallel-rng"].get_state(), before)  # the stream advanced


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_graphed_dropout_masks_have_eagers_statistics(p):
    """Each replay draws a fresh Bernoulli(1 - p) keep mask, as eager dropout does: over 2^20 elements the
    keep fraction is within 5 sigma of 1 - p (eager's too), kept values are x / (1 - p), backward applies the
    forward's mask, and two replays' masks agree on (1 - p)^2 of the elements, as independent draws do."""
    from transformer_engine.pytorch._dropout import dropout

    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(256, device="cuda"))

        def forward(self, x):
            return dropout(x * self.weight, p, training=True)

    n = 1 << 20
    x = (torch.rand(n // 256, 256, device="cuda") + 1.0).requires_grad_()
    eager, graphed = Drop(), te.make_graphed_callables(Drop(), (x,))

    def within(fraction, expected):
        return abs(fraction - expected) < 5 * math.sqrt(expected * (1 - expected) / n)

    assert within((eager(x) != 0).float().mean().item(), 1 - p)
    masks = []
    for _ in range(3):
        y = graphed(x)
        keep = y != 0
        assert within(keep.float().mean().item(), 1 - p)
        torch.testing.assert_close(y[keep], x[keep].detach() / (1 - p), rtol=1e-6, atol=0)
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad != 0, keep)  # backward's mask is the forward's
        x.grad = None
        masks.append(keep)
    assert within((masks[0] & masks[1]).float().mean().item(), (1 - p) ** 2)
    assert within((masks[1] & masks[2]).float().mean().item(), (1 - p) ** 2)


@pytest.mark.gpu
def test_capture_leaves_the_random_streams_alone():
    """Warm-up and capture of a module that draws no random numbers leave the CUDA generator where it was, so
    a graphed model sees the same random data as an eager one after the same seed (NVIDIA TE's graph tests
    compare the two bit for bit); sample args may come as a list, as TE takes them."""
    layer = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    before = torch.cuda.get_rng_state()
    te.make_graphed_callables(layer, [torch.ones(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)])
    assert torch.equal(torch.cuda.get_rng_state(), before)


def _interleaved_training(graphed: bool):
    """NVIDIA TE's interleaved pipeline case: two Linear chunks, three micro-batches, Megatron's schedule."""
    torch.manual_seed(4321)
    model = torch.nn.ModuleList([te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device="cuda") for _ in range(2)])
    order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
    forwards = {(c, m): model[c] for c in range(2) for m in range(3)}
    if graphed:
        samples = tuple((torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True),) for _ in range(6))
        functions = te.make_graphed_callables(tuple(model), samples, allow_unused_input=True, _order=order)
        forwards = {(i // 3, i % 3): f for i, f in enumerate(functions)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(99)
    outputs = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        inputs = {(c, m): torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True) for c in range(2) for m in range(3)}
        grads = {key: torch.randn(TOKENS, HIDDEN, device="cuda") for key in inputs}
        done = {True: [0, 0], False: [0, 0]}
        pending = {}
        for token in order:
            c = abs(token) - 1
            m = done[token > 0][c]
            done[token > 0][c] += 1
            if token > 0:
                pending[(c, m)] = forwards[(c, m)](inputs[(c, m)])
                outputs.append(pending[(c, m)].detach().clone())
            else:
                pending.pop((c, m)).backward(grads[(c, m)])
        optimizer.step()
    return outputs, [p.detach().clone() for p in model.parameters()], [i.grad for i in inputs.values()]


@pytest.mark.gpu
def test_interleaved_pipeline_order_matches_eager():
    """``_order`` (Megatron-Core's interleaved pipeline parallelism): one graphed function per (chunk,
    micro-batch), captured in the schedule's order, trains as the eager chunks do."""
    expected, actual = _interleaved_training(graphed=False), _interleaved_training(graphed=True)
    for eager, graphed in zip(expected, actual):
        assert len(eager) == len(graphed)
        for a, b in zip(graphed, eager):
            torch.testing.assert_close(a, b, **DTYPE_TOLS[torch.float32])
