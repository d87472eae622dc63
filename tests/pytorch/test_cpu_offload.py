"""te.get_cpu_offload_context (pytorch/cpu_offload.py): activations saved in the first num_layers layers wait
in host memory between forward and backward, and training computes exactly what it computes without them.

On the CPU the tests let CPU tensors take the offload path (``_DEVICE_TYPES``), so the layer counting, the
hooks and the reloads run as on a GPU, streams aside; the GPU test checks that device memory goes down."""

import copy
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import cpu_offload

HIDDEN, TOKENS, LAYERS = 64, 32, 3


def _model(device="cpu"):
    torch.manual_seed(7)
    return torch.nn.ModuleList([te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=device) for _ in range(LAYERS)])


def _train_step(model, x, context=None, sync=None, recipe=None):
    model.zero_grad(set_to_none=True)
    h = x
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        for layer in model:
            with context if context is not None else torch.enable_grad():
                h = layer(h)
            h = sync(h) if sync is not None else h
    h.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


@pytest.fixture
def offload_on_cpu(monkeypatch):
    """CPU tensors of any size take the offload path; returns the list of stashes offloaded."""
    monkeypatch.setattr(cpu_offload, "_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(cpu_offload, "_MIN_BYTES", 0)
    offloaded, offload = [], cpu_offload._Stash.offload

    def spy(stash, stream):
        offloaded.append(stash)
        return offload(stash, stream)

    monkeypatch.setattr(cpu_offload._Stash, "offload", spy)
    return offloaded


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["fp32", "fp8_delayed"])
def test_training_with_offload_equals_training_without(offload_on_cpu, recipe):
    eager, offloaded = _model(), _model()
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=LAYERS - 1, model_layers=LAYERS)
    for _ in range(2):  # the layer count starts again with the next forward (and delayed scaling moves on in both)
        offload_on_cpu.clear()
        expected = _train_step(eager, x.detach().requires_grad_(), recipe=recipe)
        got = _train_step(offloaded, x.detach().requires_grad_(), context, sync, recipe=recipe)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert offload_on_cpu, "nothing was offloaded"
        assert all(s.tensor is None and s.reloaded is not None for s in offload_on_cpu), "every stash went out and came back"
        assert not any(isinstance(s.reloaded, torch.nn.Parameter) for s in offload_on_cpu)


def test_only_the_first_num_layers_offload(offload_on_cpu):
    model = _model()
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=LAYERS)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    with context:
        h = model[0](x)
    h = sync(h)
    first = len(offload_on_cpu)
    for layer in model[1:]:
        with context:
            h = layer(h)
        h = sync(h)
    assert first > 0 and len(offload_on_cpu) == first, "layers 1 and 2 keep their tensors"
    h.sum().backward()


def test_weights_and_small_tensors_stay(monkeypatch):
    monkeypatch.setattr(cpu_offload, "_DEVICE_TYPES", ("cpu",))
    weight = torch.nn.Parameter(torch.ones(1024, 1024))
    assert not cpu_offload._offloadable(weight) and not cpu_offload._offloadable(weight.t())
    assert cpu_offload._offloadable(torch.ones(1024, 1024)) and not cpu_offload._offloadable(torch.ones(16))


def test_context_says_when_it_is_entered():
    """NVIDIA TE's ``inside_context``, which Megatron-Core's linear layers read."""
    context, _ = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    assert context.inside_context is False
    with context:
        assert context.inside_context is True
    assert context.inside_context is False


def test_disabled_is_a_null_context_and_identity():
    context, sync = te.get_cpu_offload_context(enabled=False, num_layers=5, model_layers=2)
    x = torch.ones(2)
    with context:
        assert sync(x) is x


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="nothing would be offloaded"):
        te.get_cpu_offload_context(enabled=True, offload_activations=False, offload_weights=False)
    with pytest.raises(ValueError, match=r"num_layers must be in \[0, model_layers - 1\]"):
        te.get_cpu_offload_context(enabled=True, num_layers=4, model_layers=4)
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, offload_weights=True)
    with pytest.warns(UserWarning, match="double_buffering"):
        te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, double_buffering=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)


@pytest.mark.gpu
def test_offload_frees_device_memory_and_keeps_the_gradients():
    """Four TransformerLayers, the first three offloaded: less device memory after forward, same gradients."""
    torch.manual_seed(3)
    layers = torch.nn.ModuleList([te.TransformerLayer(1024, 4096, 16, hidden_dropout=0.0, attention_dropout=0.0,
                                                      params_dtype=torch.bfloat16, device="cuda") for _ in range(4)])
    twin = copy.deepcopy(layers)
    x = torch.randn(512, 4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward(model, context, sync):
        h = x
        for layer in model:
            with context:
                h = layer(h)
            h = sync(h)
        torch.cuda.synchronize()
        return h, torch.cuda.memory_allocated()

    base = torch.cuda.memory_allocated()
    h_plain, plain = forward(layers, torch.enable_grad(), lambda t: t)
    plain -= base
    h_plain.float().square().sum().backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    x.grad = None
    del h_plain
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4)
    base = torch.cuda.memory_allocated()  # now with the gradients and their copies
    h_off, offloaded = forward(twin, context, sync)
    offloaded -= base
    assert offloaded < 0.6 * plain, (plain, offloaded)
    h_off.float().square().sum().backward()
    for a, b in zip([p.grad for p in twin.parameters()] + [x.grad], grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_recomputation_inside_backward_is_not_offloaded(offload_on_cpu):
    """A checkpointed layer recomputes its forward in backward, where no sync follows: its tensors stay."""
    model = _model()
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=LAYERS)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    h = x
    for layer in model:
        with context:
            h = te.checkpoint(layer, h)
        h = sync(h)
    offloaded_in_forward = len(offload_on_cpu)
    h.sum().backward()
    assert len(offload_on_cpu) == offloaded_in_forward
    handler = sync.__self__
    assert handler.pending == [], "no stash left waiting for a sync"
